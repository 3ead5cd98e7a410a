"""rollout-hpc doctor CONFIG: a preflight of what a run needs from the machines, before the queue wait.

Checks, each with the fix when it fails: MPI starts the run's rank layout (local: mpirun MPMD blocks; Slurm: srun
over both het groups) and an allreduce over it works; the Python and rollout-hpc versions agree on every rank
and with this node; ring_dir (/dev/shm) has room for the node rings on every node; the run directory is on a
file system every node sees (a token file written by rank 0 is read by every rank) and has room for
checkpoint.keep_last + 1 checkpoints (estimated from the model's parameter count: fp32 weights + two fp32 Adam
moments); the model, init_from, dataset and plugin paths are readable on every node. Exit 0: all passed; 2:
something failed. On the login node it starts the probe with mpirun (launcher local) or srun (which allocates the
layout for a minute); `--in-allocation` runs it inside an existing job (`srun --het-group=0,1`), e.g. as the first
step of the batch script. `rollout-hpc submit --doctor` runs it first and submits nothing when it fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import shlex
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from rollout_hpc import __version__
from rollout_hpc.commands import add_config_arguments, load, out
from rollout_hpc.config import Config, UserError
from rollout_hpc.launch.local import ENTRY, launch_env, mpirun_command
from rollout_hpc.launch.render import colocated_group, colocated_srun_args
from rollout_hpc.launch.submit import resolve_launcher

_MARK = "ROLLOUT_DOCTOR "  # the probe's result line on rank 0's stdout
BYTES_PER_PARAM = 4 + 8  # fp32 weights + Adam's two fp32 moments
GIB = 1 << 30


def _size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""


# --- what the run needs -------------------------------------------------------------------------------------------
def needed_paths(cfg: Config) -> list[str]:
    """Files and directories the ranks read: model, init_from, dataset files, plugin files."""
    paths = [p for p in (cfg.model.path, cfg.model.init_from) if p]
    params = cfg.task.params
    for key in ("train", "val"):
        value = params.get(key)
        for item in value if isinstance(value, list) else [value]:
            path = item.get("path") if isinstance(item, dict) else item
            if isinstance(path, str) and path:
                paths.append(path)
    for spec in (cfg.task.name, cfg.task.reward):
        if isinstance(spec, str) and ".py:" in spec:
            paths.append(spec.rsplit(":", 1)[0])
    return [str(Path(p).expanduser()) for p in paths]


def parameter_count(cfg: Config) -> int:
    """The policy's parameters: exact from safetensors headers where the model directory has them, else from its
    config.json (or the built-in model's sizes), as a decoder-only transformer: L x (4h^2 + 3h x ffn) + vocab x h."""
    m = cfg.model
    if m.path:
        directory = Path(m.path).expanduser()
        files = sorted(directory.glob("*.safetensors"))
        if files:
            return sum(_safetensors_params(f) for f in files)
        conf = json.loads((directory / "config.json").read_text())
        h, layers = int(conf.get("hidden_size", 0)), int(conf.get("num_hidden_layers", 0))
        ffn, vocab = int(conf.get("intermediate_size", 4 * h)), int(conf.get("vocab_size", 0))
        tied = bool(conf.get("tie_word_embeddings", False))
    else:  # the built-in tiny model (models/build.py: intermediate 4h, about 100 tokens)
        h, layers, ffn, vocab, tied = m.hidden_size, m.num_layers, 4 * m.hidden_size, 128, False
    return layers * (4 * h * h + 3 * h * ffn) + vocab * h * (1 if tied else 2)


def _safetensors_params(path: Path) -> int:
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    total = 0
    for name, entry in header.items():
        if name != "__metadata__":
            n = 1
            for dim in entry["shape"]:
                n *= int(dim)
            total += n
    return total


def checkpoint_bytes(cfg: Config) -> int:
    from rollout_hpc.algos import get_algorithm  # in here: the algorithm table (torch-free)

    models = 2 if get_algorithm(cfg.algorithm.name).needs_critic else 1  # PPO's critic is checkpointed too
    return parameter_count(cfg) * BYTES_PER_PARAM * models


def _existing(path: Path) -> Path:
    """The path, or its nearest existing ancestor (the run directory may not exist yet)."""
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return path


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _readable(path: str) -> bool:
    p = Path(path)
    try:
        if p.is_dir():
            os.listdir(p)
            return os.access(p, os.R_OK | os.X_OK)
        with open(p, "rb") as f:
            f.read(1)
        return True
    except OSError:
        return False


# --- the probe: every rank of the layout -------------------------------------------------------------------------
def probe(spec: dict) -> None:
    """Run by every rank (`python -m rollout_hpc.commands.doctor --probe SPEC`): an allreduce over the world, then
    rank 0 prints every rank's facts as one JSON line."""
    from mpi4py import MPI  # in here: importing it starts MPI, which only the probe's ranks do

    comm = MPI.COMM_WORLD
    total = comm.allreduce(1)
    token_path = Path(spec["token"])
    token = secrets.token_hex(8) if comm.rank == 0 else None
    if token is not None:
        token_path.write_text(token)
    token = comm.bcast(token, root=0)
    try:
        seen = token_path.read_text() == token
    except OSError:
        seen = False
    try:
        shm_free = _free(Path(spec["ring_dir"]))
    except OSError:
        shm_free = -1
    facts = {
        "rank": comm.rank,
        "node": os.environ.get("SLURMD_NODENAME") or os.environ.get("ROLLOUT_NODE") or socket.gethostname(),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "executable": sys.executable,
        "version": __version__,
        "allreduce": total,
        "size": comm.size,
        "run_dir_seen": seen,
        "shm_free": shm_free,
        "unreadable": [p for p in spec["paths"] if not _readable(p)],
    }
    everyone = comm.gather(facts, root=0)
    comm.Barrier()
    if comm.rank == 0:
        token_path.unlink(missing_ok=True)
        print(_MARK + json.dumps(everyone), flush=True)


def _probe_argv(python: str, spec: dict) -> list[str]:
    return [python, "-m", "rollout_hpc.commands.doctor", "--probe", json.dumps(spec)]


def probe_command(cfg: Config, spec: dict, in_allocation: bool) -> list[str]:
    """The probe over the run's rank layout: mpirun's MPMD blocks (local) or srun over both het groups (Slurm; a
    colocated run: one component, the job step's cyclic distribution)."""
    python = cfg.slurm.python or sys.executable
    if resolve_launcher(cfg) == "local":
        entry = [sys.executable, *ENTRY, "--run-dir", "RUN_DIR"]
        cmd, out_cmd = mpirun_command(cfg, Path("RUN_DIR")), []
        i = 0
        while i < len(cmd):  # the same layout, the probe instead of the runtime
            if cmd[i : i + len(entry)] == entry:
                out_cmd += _probe_argv(sys.executable, spec)
                i += len(entry)
            else:
                out_cmd.append(cmd[i])
                i += 1
        return out_cmd
    mpi = f"--mpi={cfg.slurm.mpi}"
    colocated = colocated_srun_args(cfg)  # one component, both groups on every node (else nothing)
    if in_allocation:
        return ["srun", *(colocated or ["--het-group=0,1"]), mpi, *_probe_argv(python, spec)]
    cmd = ["srun", mpi, "--job-name=rollout-hpc-doctor", "--time=00:05:00", *colocated]
    layouts = (colocated_group(cfg),) if colocated else (cfg.generator, cfg.trainer)  # as the job script's
    for i, group in enumerate(layouts):
        if i:
            cmd.append(":")
        cmd += [f"--nodes={group.nodes}", f"--ntasks-per-node={group.tasks_per_node}"]
        for option, value in (
            ("partition", group.partition or cfg.slurm.partition),
            ("account", cfg.slurm.account),
            ("qos", cfg.slurm.qos),
            ("constraint", group.constraint or cfg.slurm.constraint),
        ):
            if value:
                cmd.append(f"--{option}={value}")
        cmd += _probe_argv(python, spec)
    return cmd


def run_probe(cfg: Config, run_dir: Path, in_allocation: bool, timeout: float) -> tuple[list[dict] | None, str]:
    """(facts of every rank, or None; the command's output when it failed)."""
    token = _existing(run_dir) / f".rollout-doctor-{secrets.token_hex(4)}"
    spec = {"token": str(token), "ring_dir": cfg.exchange.ring_dir, "paths": needed_paths(cfg)}
    try:
        cmd = probe_command(cfg, spec, in_allocation)
        result, output = _result_line(cmd, timeout)
    except UserError as exc:  # no mpirun here
        return None, str(exc)
    except FileNotFoundError as exc:
        return None, f"{exc.filename} not found"
    finally:
        token.unlink(missing_ok=True)
    if result is None:
        return None, output.strip()[-600:] or f"no answer within {timeout:g}s: {shlex.join(cmd[:6])} ..."
    return json.loads(result[len(_MARK) :]), ""


def _result_line(cmd: list[str], timeout: float) -> tuple[str | None, str]:
    """(the probe's result line or None, all output). Stops waiting once the line is there: Slurm 22.05's srun may
    never exit after a het step with --mpi=pmix ended (slurm/rollout.sbatch works around the same)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=launch_env())
    lines: list[str] = []
    done = threading.Event()

    def read() -> None:
        assert proc.stdout is not None  # stdout=PIPE
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(_MARK):
                done.set()
        done.set()  # end of output

    threading.Thread(target=read, name="doctor-probe-output", daemon=True).start()
    done.wait(timeout)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return next((line for line in lines if line.startswith(_MARK)), None), "".join(lines)


# --- the checks ---------------------------------------------------------------------------------------------------
def login_checks(cfg: Config, run_dir: Path) -> list[Check]:
    checks = []
    missing = [p for p in needed_paths(cfg) if not _readable(p)]
    checks.append(
        Check(
            "paths readable here",
            not missing,
            "model, data and plugin files readable" if not missing else f"cannot read {', '.join(missing)}",
            "fix the path in the config, or copy the files to the shared file system",
        )
    )
    try:
        need = checkpoint_bytes(cfg) * (cfg.checkpoint.keep_last + 1)
    except (OSError, ValueError, KeyError) as exc:
        checks.append(Check("checkpoint room", False, f"cannot size the model: {exc}", "check model.path"))
        return checks
    where = _existing(run_dir)
    free = _free(where)
    checks.append(
        Check(
            "checkpoint room",
            free >= need,
            f"{cfg.checkpoint.keep_last} + 1 checkpoints of ~{_size(need / (cfg.checkpoint.keep_last + 1))} "
            f"need {_size(need)}; {where} has {_size(free)} free",
            "free space there, lower checkpoint.keep_last, or put run.dir on a larger file system",
        )
    )
    return checks


def probe_checks(cfg: Config, facts: list[dict] | None, failure: str) -> list[Check]:
    launcher = resolve_launcher(cfg)
    how = "mpirun" if launcher == "local" else "srun --mpi=" + cfg.slurm.mpi
    if facts is None:
        return [
            Check(
                "MPI across the het groups",
                False,
                f"the probe over {cfg.world_size} ranks failed ({failure})",
                f"check that `{how}` starts Python with mpi4py on these nodes (module load, slurm.mpi, slurm.python)",
            )
        ]
    nodes = sorted({f["node"] for f in facts})
    checks = [
        Check(
            "MPI across the het groups",
            len(facts) == cfg.world_size and all(f["allreduce"] == cfg.world_size for f in facts),
            f"{len(facts)} ranks on {len(nodes)} node(s) ({', '.join(nodes)}), allreduce over the world ok",
            f"the world must have {cfg.world_size} ranks: check {how} and the node counts",
        )
    ]
    here = (platform.python_version(), __version__)
    odd = sorted(
        {
            f"{f['node']}: Python {f['python']}, rollout-hpc {f['version']}"
            for f in facts
            if (f["python"], f["version"]) != here
        }
    )
    checks.append(
        Check(
            "versions agree",
            not odd,
            f"Python {here[0]}, rollout-hpc {here[1]} everywhere"
            if not odd
            else f"here {here}; differs on {'; '.join(odd)}",
            "install the same rollout-hpc in the Python the job runs (slurm.python) on every node",
        )
    )
    # Rings per host: one experience ring per (node, role); emulated local nodes share one host.
    rings: dict[str, set] = {}
    free: dict[str, int] = {}
    world_roles = ["generator"] * cfg.generator.ranks + ["trainer"] * cfg.trainer.ranks
    for f in facts:
        rings.setdefault(f["host"], set()).add(
            (f["node"], world_roles[f["rank"]] if f["rank"] < len(world_roles) else "?")
        )
        free[f["host"]] = min(free.get(f["host"], f["shm_free"]), f["shm_free"])
    short = [
        f"{host}: {len(r)} x {_size(cfg.exchange.ring_bytes)} needed, {_size(max(free[host], 0))} free"
        for host, r in sorted(rings.items())
        if free[host] < len(r) * cfg.exchange.ring_bytes
    ]
    checks.append(
        Check(
            f"ring room in {cfg.exchange.ring_dir}",
            not short,
            f"room for the node rings ({_size(cfg.exchange.ring_bytes)} each) on every node"
            if not short
            else "; ".join(short),
            "free /dev/shm (stale rollout-hpc.*.ring files of dead runs), lower exchange.ring_bytes, "
            "or set exchange.ring_dir to a tmpfs with room",
        )
    )
    blind = sorted({f["node"] for f in facts if not f["run_dir_seen"]})
    checks.append(
        Check(
            "run directory shared",
            not blind,
            "every node sees the run directory's file system" if not blind else f"not visible on {', '.join(blind)}",
            "put run.dir on a file system every node mounts (e.g. $SCRATCH or a project directory)",
        )
    )
    where: dict[str, list[str]] = {}
    for f in facts:
        for p in f["unreadable"]:
            where.setdefault(p, []).append(f["node"])
    unreadable = [f"{p} (on {', '.join(sorted(set(nodes)))})" for p, nodes in sorted(where.items())]
    checks.append(
        Check(
            "paths readable on every node",
            not unreadable,
            "model, data and plugin files readable on every node" if not unreadable else "; ".join(unreadable),
            "put them on a file system every node mounts, readable by the job's user",
        )
    )
    return checks


def doctor(cfg: Config, run_dir: Path, in_allocation: bool = False, timeout: float = 300.0) -> list[Check]:
    facts, failure = run_probe(cfg, run_dir, in_allocation, timeout)
    return login_checks(cfg, run_dir) + probe_checks(cfg, facts, failure)


def report(checks: list[Check], title: str) -> bool:
    """Prints the table; True when every check passed."""
    table = Table(title=title)
    for column in ("check", "result", "detail", "fix"):
        table.add_column(column)
    for c in checks:
        table.add_row(c.name, "[green]ok[/]" if c.ok else "[red]FAILED[/]", c.detail, "" if c.ok else c.fix)
    out.print(table)
    return all(c.ok for c in checks)


def passes(cfg: Config, run_dir: Path, in_allocation: bool = False, timeout: float = 300.0) -> bool:
    """Run every check and print the table and a verdict; True when all passed."""
    checks = doctor(cfg, run_dir, in_allocation, timeout)
    title = f"rollout-hpc doctor: run {cfg.run.name}, {cfg.world_size} ranks, launcher {resolve_launcher(cfg)}"
    if report(checks, title):
        out.print("[green]ok[/]: every check passed")
        return True
    out.print(f"[red]failed[/]: {', '.join(c.name for c in checks if not c.ok)} (see the fix column)")
    return False


def run(args: argparse.Namespace) -> int:
    cfg = load(args)
    run_dir = Path(args.run_dir) if args.run_dir else cfg.run.resolved_dir()
    return 0 if passes(cfg, run_dir, args.in_allocation, args.timeout) else 2


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="check MPI, /dev/shm, the run directory, paths and versions on the run's nodes",
        description=__doc__.splitlines()[0] if __doc__ else None,
        epilog="examples:\n  rollout-hpc doctor configs/quickstart.yaml\n"
        "  rollout-hpc doctor my.yaml --in-allocation          # inside a job: srun --het-group=0,1",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_arguments(p)
    p.add_argument("--in-allocation", action="store_true", help="run inside an existing (het) job allocation")
    p.add_argument("--run-dir", metavar="DIR", help="run directory (default: run.dir or runs/<run.name>)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S", help="give the probe this long (default 300)")
    p.set_defaults(func=run)


if __name__ == "__main__" and sys.argv[1:2] == ["--probe"]:
    probe(json.loads(sys.argv[2]))
