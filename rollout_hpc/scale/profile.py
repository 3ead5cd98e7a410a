"""A profile: the measured costs of one model on one cluster, from which `rollout-hpc plan` predicts any layout.

`rollout-hpc profile CONFIG --out PROFILE.json` writes one (runtime/profile_program.py measures on the config's
ranks); `rollout_hpc.scale.roofline` makes one from a model size and hardware figures instead (no measurement).
Every cost is per rank and measured alone (one rank computing at a time), so the simulation can add contention
for the layout it is asked about. The cost model behind each field is in docs/scale.md.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from rollout_hpc.errors import UserError

PROFILE_VERSION = 1
PROFILE_FILE = "profile.json"  # what run.program 'profile' writes into its run directory


class ProfileError(UserError):
    """A profile file that is missing, damaged or of another version."""


@dataclass
class Costs:
    # Generation on one rank: a batch of n responses whose longest has L tokens takes
    # gen_fixed_s + gen_row_s * n + L * (gen_token_s + gen_token_row_s * n): the prompts' prefill and set-up per
    # row, then one decode step per token until the longest row ends.
    gen_fixed_s: float
    gen_row_s: float
    gen_token_s: float
    gen_token_row_s: float
    # One RL train step on one trainer rank (log-probs, loss, backward, optimizer): train_fixed_s + train_token_s x
    # the rank's tokens (prompt + response), without the data-parallel gradient all-reduce (modelled from the links).
    train_fixed_s: float
    train_token_s: float
    # Scoring one sample with the config's reward (on the generator's reward workers) and logging it (HDF5 log).
    reward_s_per_sample: float
    log_s_per_sample: float
    # Point to point between two ranks (the exchange between nodes): alpha + bytes / bandwidth.
    mpi_alpha_s: float
    mpi_gb_per_s: float
    # One stage of the weight broadcast tree, per chunk: bcast_alpha_s + chunk_bytes / bcast_gb_per_s.
    bcast_alpha_s: float
    bcast_gb_per_s: float
    ring_gb_per_s: float  # the node ring (generator -> forwarder), one producer
    fs_write_gb_per_s: float  # one writer to the run directory's file system, fsync included
    fs_read_gb_per_s: float
    startup_s: float  # a rank from start to its first step: each (re)start of an allocation pays it
    # Generation and training speed with every core of a node, relative to the measured thread count (CPU runs;
    # 1.0 on GPUs): what a colocated rank gains, since it has the node's cores in its phase.
    gen_speedup_all_cores: float = 1.0
    train_speedup_all_cores: float = 1.0
    fs_aggregate_gb_per_s: float = 0.0  # bandwidth all writers share (0: unknown, writers do not slow each other)
    # What a real step costs beyond the parts above, from a short real run of the profile's own layout split by
    # the trainer's timing of each step, minus the model's parts: on a generator rank per row it generates
    # (prompt encoding, decoding the texts, building the batch), and on the trainers per step (sorting,
    # metrics, the progress line, the exchange's bookkeeping).
    gen_row_overhead_s: float = 0.0
    step_overhead_s: float = 0.0


@dataclass
class Workload:
    response_lengths: list[int]  # tokens per response, sampled from the task at the profiled policy
    prompt_len_mean: float
    max_new_tokens: int
    record_bytes_per_token: float  # a trajectory record's bytes per token in the exchange (ids, log-probs, masks)
    record_fixed_bytes: float
    weight_bytes: int  # what one weight sync sends
    checkpoint_bytes: int  # one checkpoint (weights and optimizer state)
    weight_chunk_bytes: int


@dataclass
class Machine:
    hostname: str
    cores_per_node: int  # CPUs a node gives the job (SLURM_CPUS_ON_NODE, else this machine's)
    gpus_per_node: int
    gen_threads: int  # torch threads the generator rank was measured with
    train_threads: int
    # True when all the profiled "nodes" are one machine (the local launcher, a Slurm test cluster on one host):
    # then every rank of a layout shares its cores, and the simulation slows phases that oversubscribe them.
    shared_host: bool
    nodes_measured: int
    ranks_measured: int


@dataclass
class Profile:
    costs: Costs
    workload: Workload
    machine: Machine
    source: str = "measured"  # "measured" (rollout-hpc profile) or "roofline" (from hardware figures, no run)
    config_digest: str = ""
    config_path: str = ""
    created: str = ""
    versions: dict = field(default_factory=dict)
    measurements: dict = field(default_factory=dict)  # the raw points behind each fit, for the curious
    version: int = PROFILE_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ProfileError(
                f"{path}: no such profile; make one with `rollout-hpc profile CONFIG --out {path}`"
            ) from None
        except (OSError, ValueError) as exc:
            raise ProfileError(f"{path} is not a profile ({exc}); make it again with `rollout-hpc profile`") from None
        if not isinstance(raw, dict) or raw.get("version") != PROFILE_VERSION:
            found = raw.get("version") if isinstance(raw, dict) else None
            raise ProfileError(
                f"{path}: profile version {found}, this rollout-hpc reads version {PROFILE_VERSION}; "
                "make it again with `rollout-hpc profile`"
            )
        try:
            return cls(
                costs=_section(Costs, raw["costs"]),
                workload=_section(Workload, raw["workload"]),
                machine=_section(Machine, raw["machine"]),
                **{
                    k: raw[k]
                    for k in ("source", "config_digest", "config_path", "created", "versions", "measurements")
                    if k in raw
                },
            )
        except (KeyError, TypeError) as exc:
            raise ProfileError(f"{path}: damaged profile (missing or wrong field: {exc}); make it again") from None

    def record_bytes(self, tokens: float) -> float:
        return self.workload.record_fixed_bytes + self.workload.record_bytes_per_token * tokens


def _section(cls, raw: dict):
    names = {f.name for f in fields(cls)}
    missing = [
        f.name for f in fields(cls) if f.name not in raw and f.default is MISSING and f.default_factory is MISSING
    ]
    if missing:
        raise KeyError(", ".join(missing))
    return cls(**{k: v for k, v in raw.items() if k in names})


def fit_linear(xs: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Least squares for y = c0 + sum(ci * xi) with every c >= 0 (a cost cannot be negative; noise can make the
    unconstrained fit so). Exact for the few terms used here: the best non-negative fit over every subset of terms."""
    import itertools

    import numpy as np

    a = np.column_stack([np.ones(len(ys))] + [np.asarray(col, float) for col in zip(*xs)])
    y = np.asarray(ys, float)
    best, best_err = np.zeros(a.shape[1]), float(np.sum(y**2))
    for k in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), k):
            c, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
            if np.all(c >= 0):
                err = float(np.sum((a[:, cols] @ c - y) ** 2))
                if err < best_err:
                    best, best_err = np.zeros(a.shape[1]), err
                    best[list(cols)] = c
    return [float(c) for c in best]


def bcast_stages(ranks: int) -> int:
    """Stages of a binomial broadcast tree over `ranks` processes (the sender included)."""
    return max(1, math.ceil(math.log2(max(2, ranks))))
