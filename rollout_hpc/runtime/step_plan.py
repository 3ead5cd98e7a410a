"""Which prompts a step generates and trains on, with and without DAPO's dynamic sampling.

Without dynamic sampling, step s is prompts [s*P, (s+1)*P) (P = prompts_per_step).

With it, a step generates in rounds. A group whose (shaped) rewards are all
equal has zero advantage and teaches nothing, so after each round the groups
still missing are refilled with new prompts, until P groups are informative or
algorithm.dynamic_sampling_max_rounds rounds are done. Step s owns the block of
prompts [s*M, (s+1)*M), M = P * max_rounds, which every possible sequence of
rounds fits in; the rounds take its prompts in order, so the prompts a step
used are always a prefix [s*M, end) of its block. Two things follow:

- the step is still the whole data cursor: a resumed run regenerates exactly
  the same rounds from the same seeds, nothing else needs saving;
- generators and trainers agree on the rounds without a message: both replay
  this plan from the same rewards (generators to decide what to generate next,
  trainers to know when a step's experience is complete).

Unused prompts at the end of a block are skipped: free for procedural tasks,
and a finite dataset wraps around as always (envs.base.dataset_item).

A mixed dataset (task.params.train as a list of sources) splits every P
prompts of the stream by the sources' quotas (envs.datafile.QuotaLayout), so
a step's first round holds exactly each source's quota. Refills are per source:
source k gets as many new prompts as it misses informative groups (of its
quota), from its own share of the step's block, so the trained mixture is
each source's quota whenever the rounds suffice. A source's share of step s's
block is positions [s*q*R, (s+1)*q*R) of its own stream: its cursor is implied
by the step. With one source all this is the contiguous plan described above.
"""

from __future__ import annotations

import numpy as np

from rollout_hpc import algos
from rollout_hpc.envs.datafile import QuotaLayout
from rollout_hpc.trajectory import TrajectoryBatch

PromptIds = range | np.ndarray  # a contiguous range where the prompts are contiguous, else sorted indices
Informative = int | np.ndarray  # informative groups: a count, or one count per source of a mixed dataset


def uses_dynamic_sampling(cfg) -> bool:
    return bool(algos.get_algorithm(cfg.algorithm.name).dynamic_sampling or cfg.algorithm.dynamic_sampling)


def domain_quotas(cfg) -> list[int]:
    """Prompts per step of each source of a mixed dataset (config derived them from the weights), else [P]."""
    sources = cfg.task.sources()
    return [int(src["quota"]) for src in sources] if sources else [cfg.algorithm.prompts_per_step]


def stamp_domains(batch: TrajectoryBatch, dataset) -> TrajectoryBatch:
    """A mixed dataset's records name their source (the log's `domain`; per-domain metrics and normalisation)."""
    domain_of = getattr(dataset, "domain_of", None)
    if domain_of is not None:
        batch.fixed["domain"] = domain_of(batch.fixed["prompt_id"])
    return batch


def domain_names(cfg) -> list[str]:
    """The sources of a mixed dataset, in order ([] for any other task)."""
    return [str(src["name"]) for src in cfg.task.sources() or []]


class StepPlan:
    """The rounds of one step. `round` is the prompts to generate now; after it is scored,
    `advance(informative_groups_in_round)` says whether another round follows (per source for a mixture)."""

    def __init__(self, step: int, prompts_per_step: int, max_rounds: int = 1, quotas: list[int] | None = None):
        self.target = prompts_per_step
        self.max_rounds = max_rounds
        self.layout = QuotaLayout(quotas or [prompts_per_step])
        if self.layout.block != prompts_per_step:
            raise ValueError(f"StepPlan: quotas {quotas} do not add up to prompts_per_step {prompts_per_step}")
        self.start = step * prompts_per_step * max_rounds
        K = len(self.layout.quotas)
        # Source k's share of the block: positions base[k] + [0, q_k * R) of its own stream.
        self._base = step * max_rounds * self.layout.quotas
        self._lo, self._hi = np.zeros(K, np.int64), self.layout.quotas.copy()  # this round: slots [lo, hi) per source
        self._informative = np.zeros(K, np.int64)
        self.rounds = 1
        self.done = max_rounds == 1  # without refills the first round is the whole step

    @classmethod
    def for_step(cls, cfg, step: int) -> StepPlan:
        a = cfg.algorithm
        rounds = a.dynamic_sampling_max_rounds if uses_dynamic_sampling(cfg) else 1
        return cls(step, a.prompts_per_step, rounds, domain_quotas(cfg))

    def _ids(self, lo: np.ndarray, hi: np.ndarray) -> PromptIds:
        parts = [self.layout.index(k, self._base[k] + np.arange(lo[k], hi[k])) for k in range(len(lo))]
        ids = np.sort(np.concatenate(parts))
        if len(ids) and ids[-1] - ids[0] + 1 == len(ids):
            return range(int(ids[0]), int(ids[-1]) + 1)
        return ids

    @property
    def round(self) -> PromptIds:
        return self._ids(self._lo, self._hi)

    @property
    def prompts(self) -> PromptIds:
        """Every prompt of the step so far (all rounds)."""
        return self._ids(np.zeros_like(self._hi), self._hi)

    @property
    def informative(self) -> int:
        return int(self._informative.sum())

    @property
    def block_end(self) -> int:
        return self.start + self.target * self.max_rounds

    def advance(self, informative_in_round: Informative) -> bool:
        """Count the current round's informative groups (an int, or one count per source of a mixture);
        True if a refill round follows (now `round`)."""
        if self.done:
            raise RuntimeError("StepPlan.advance after the last round")
        self._informative += np.broadcast_to(np.asarray(informative_in_round, np.int64), self._informative.shape)
        missing = np.array(
            [algos.groups_to_refill(int(q), int(i)) for q, i in zip(self.layout.quotas, self._informative)]
        )
        if not missing.any() or self.rounds >= self.max_rounds:
            self.done = True
            return False
        self._lo, self._hi = self._hi, self._hi + missing
        self.rounds += 1
        return True


def shaped_rewards(cfg, rewards, response_len):
    """Task rewards plus DAPO's overlong shaping where configured (what advantages are computed from)."""
    import torch

    a = cfg.algorithm
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if a.overlong_buffer > 0:
        lengths = torch.as_tensor(response_len, dtype=torch.float32)
        rewards = rewards + algos.overlong_penalty(lengths, a.max_new_tokens, a.overlong_buffer, a.overlong_penalty)
    return rewards


def informative_groups(cfg, batch: TrajectoryBatch) -> Informative:
    """How many whole prompt groups in `batch` have rewards that are not all equal: an int, or for a mixed
    dataset one count per source (what StepPlan.advance takes). The same test the trainer's dynamic-sampling
    filter applies (algos.dynamic_sampling_filter)."""
    quotas = domain_quotas(cfg)
    G = cfg.algorithm.group_size
    if not len(batch):
        return 0 if len(quotas) == 1 else np.zeros(len(quotas), np.int64)
    order = np.argsort(batch.uids(G), kind="stable")
    f = batch.fixed[order]
    kept = group_informative(cfg, f["reward"], f["response_len"])
    if len(quotas) == 1:
        return int(kept.sum())
    domains = QuotaLayout(quotas).domain_of(f["prompt_id"][::G])
    return np.bincount(domains[kept], minlength=len(quotas))


def group_informative(cfg, rewards, response_len) -> np.ndarray:
    """Per group (rows in groups of group_size, one after another): True where its shaped rewards are not all equal,
    the test of the trainer's dynamic-sampling filter (algos.dynamic_sampling_filter)."""
    shaped = shaped_rewards(cfg, rewards, np.asarray(response_len, np.float32))
    G = cfg.algorithm.group_size
    return algos.dynamic_sampling_filter(shaped, G).keep.numpy()[::G]


def rank_share(prompts: PromptIds, rank: int, n_ranks: int) -> np.ndarray:
    """This rank's contiguous share of a round's prompts (some ranks may get none)."""
    return np.array_split(np.asarray(prompts, np.int64), n_ranks)[rank]


def in_prompts(prompt_ids: np.ndarray, prompts: PromptIds) -> np.ndarray:
    """Mask of the rows whose prompt is one of `prompts`."""
    if isinstance(prompts, range):
        return (prompt_ids >= prompts.start) & (prompt_ids < prompts.stop)
    return np.isin(prompt_ids, prompts)


def describe(prompts: PromptIds) -> str:
    """'[a, b)' for a range, else the first few ids (for messages)."""
    if isinstance(prompts, range):
        return f"[{prompts.start}, {prompts.stop})"
    head = ", ".join(str(int(i)) for i in prompts[:8])
    return f"{{{head}{', ...' if len(prompts) > 8 else ''}}} ({len(prompts)} prompts)"
