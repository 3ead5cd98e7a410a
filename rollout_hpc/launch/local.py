"""The local launcher: the Slurm job's rank layout under `mpirun`, in the foreground.

mpirun's MPMD form gives each emulated node its own app context, so every rank knows its node
from ROLLOUT_NODE (gen0, gen1, ..., train0, ..., rm0, ...) exactly as a Slurm rank knows it from its host.
World ranks are ordered like `srun --het-group=0-2`: generators, trainers, then the reward group (if any).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import BinaryIO

from rich.console import Console

from rollout_hpc.config import Config
from rollout_hpc.errors import UserError
from rollout_hpc.launch import rundir
from rollout_hpc.launch.executables import require_executable
from rollout_hpc.launch.mpi_env import fresh_job_env, placement_env
from rollout_hpc.rundir_layout import EXIT_CONTINUE
from rollout_hpc.store.atomic import is_disk_full, space_note

# Signals the foreground process passes on to mpirun; mpirun forwards USR1/USR2 to every rank
# and ends the job on INT/TERM.
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
ENTRY = ["-m", "rollout_hpc.runtime.entry"]


def require_mpirun() -> str:
    return require_executable(
        "mpirun",
        "the local launcher needs `mpirun` (Open MPI) on PATH; install openmpi-bin, "
        "or submit to Slurm with launcher: slurm",
    )


def mpirun_command(cfg: Config, run_dir: Path, python: str = sys.executable) -> list[str]:
    """One app context per emulated node: generator nodes, then trainer nodes, then reward and environment nodes."""
    # Ranks outnumber cores on a workstation; binding them would pile them onto a few cores.
    cmd = [require_mpirun(), "--oversubscribe", "--bind-to", "none"]
    # Colocated: generator and trainer ranks of emulated node i share its name, as they would share a host.
    gen, train = ("node", "node") if cfg.placement == "colocated" else ("gen", "train")
    names = {"generator": gen, "trainer": train, "reward": "rm", "env": "env"}
    nodes = [(f"{names[role]}{i}", g.tasks_per_node) for role, g, _ in cfg.het_groups for i in range(g.nodes)]
    for index, (node, tasks) in enumerate(nodes):
        if index:
            cmd.append(":")
        cmd += ["-np", str(tasks), "-x", f"ROLLOUT_NODE={node}", python, *ENTRY, "--run-dir", str(run_dir)]
    return cmd


def record_mpirun_command(cfg: Config, run_dir: Path) -> list[str]:
    """mpirun_command, also kept in the manifest (local_command): how this run is started here."""
    command = mpirun_command(cfg, run_dir)
    rundir.update_manifest(run_dir, lambda m: m.update(local_command=command))
    return command


def launch_env() -> dict[str, str]:
    # Not PYTHONUNBUFFERED: it splits a print into two writes, which mpirun may interleave across ranks.
    env = fresh_job_env(os.environ)  # not a parent MPI process's variables: mpirun would exit 1 without a word
    env["ROLLOUT_LAUNCHER"] = "local"
    # How PMIx proves that a process belongs to the job. Open MPI's PMIx tries munge first, and where no munged
    # answers (a workstation, a login node) it retries for ~2.3 s before falling back: every mpirun started that
    # much later (strace: connect() to /run/munge/munge.socket.2 refused, sleeps of 50, 100, ... 450 ms; mpirun of
    # `true` 2.35 s, 0.08 s with "native"). All of a local job's processes are on this machine, where the kernel's
    # socket credentials ("native") prove it. A user's own setting wins (fresh_job_env drops every PMIX_ name).
    env["PMIX_MCA_psec"] = os.environ.get("PMIX_MCA_psec", "native")
    if os.geteuid() == 0:  # Open MPI refuses root unless told it is intended
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def mpi_shm_dir(run_dir: Path) -> Path:
    """Where this run's mpirun puts Open MPI's shared-memory segments (vader_segment.*): one directory per run
    directory, so that the segments a SIGKILLed mpirun could not remove are found and removed by the next start."""
    digest = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]
    return Path("/dev/shm") / f"rollout-hpc.mpi.{digest}"


def _write_log(log: BinaryIO, raw: bytes, path: Path, console: Console) -> bool:
    """Copy a line of the ranks' output to the run's log; on a full disk say so once and go on without it
    (the launcher must live on to record how the run ends). Returns whether to keep logging."""
    try:
        log.write(raw)
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        console.print(f"cannot write {path}: {space_note(path.parent)}; the output continues here only", markup=False)
        return False
    return True


def run_local(cfg: Config, run_dir: Path, console: Console | None = None) -> int:
    """Run the job in the foreground, streaming rank output to the console and logs/local-<n>.out,
    then say how it ended (and how to continue a run that checkpointed and stopped early).

    Returns mpirun's exit code (128 + N when it died of signal N).
    """
    console = console or Console()
    cmd = mpirun_command(cfg, run_dir)
    manifest = rundir.read_manifest(run_dir)
    log_path = run_dir / rundir.LOGS / f"local-{len(manifest.get('local_runs', []))}.out"
    shm = mpi_shm_dir(run_dir)
    shutil.rmtree(shm, ignore_errors=True)  # a killed earlier start's; no other start of this run is going
    shm.mkdir(mode=0o700)
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**launch_env(), **placement_env(cfg), "OMPI_MCA_btl_vader_backing_directory": str(shm)},
        start_new_session=True,  # a terminal's Ctrl-C reaches us only; we pass it on once
    )
    run_record = {
        "pid": proc.pid,
        "host": os.uname().nodename,
        "started": rundir.now_utc(),
        "log": str(log_path),
        "exit_code": None,
    }
    rundir.update_manifest(run_dir, lambda m: m.setdefault("local_runs", []).append(run_record))

    terms: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        if proc.poll() is None:
            if signum in (signal.SIGTERM, signal.SIGINT) and not terms:
                # mpirun would end the ranks on TERM or INT (Ctrl-C); as USR1 it reaches every rank, which
                # checkpoints and exits 75 like a Slurm job told to stop. A second TERM or Ctrl-C ends the job outright.
                terms.append(signum)
                signum = signal.SIGUSR1
                if terms[0] == signal.SIGINT:
                    console.print(
                        "stopping after the current step (a checkpoint is written); Ctrl-C again to end now",
                        markup=False,
                    )
            proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    ranks = cfg.world_size
    layout = ", ".join(f"{g.nodes}x{g.tasks_per_node} {role}" for role, g, _ in cfg.het_groups)
    try:
        with (
            open(log_path, "ab", buffering=0) as log,  # unbuffered: on a full disk, close has nothing to flush
            console.status(f"[bold]mpirun[/]: {ranks} ranks ({layout}) in {run_dir}"),
        ):
            assert proc.stdout is not None
            logging = True
            printed = False
            for raw in proc.stdout:
                printed = True
                if logging:
                    logging = _write_log(log, raw, log_path, console)
                console.print(raw.decode(errors="replace").rstrip("\n"), markup=False, highlight=False, soft_wrap=True)
            code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:  # we are leaving early (an exception): do not orphan the ranks
            proc.terminate()
            proc.wait()
        shutil.rmtree(shm, ignore_errors=True)
    exit_code = 128 - code if code < 0 else code

    def finish(manifest: dict) -> None:
        for record in manifest.get("local_runs", []):
            if record.get("pid") == proc.pid and record.get("exit_code") is None:
                record.update(exit_code=exit_code, ended=rundir.now_utc())

    try:
        rundir.update_manifest(run_dir, finish)
    except UserError as exc:  # a full disk: say so, and still say how the run ended
        console.print(f"could not record the exit code in the manifest: {exc}", markup=False)
    console.print(f"mpirun exited with code {exit_code}; log: {run_dir / rundir.LOGS}/", markup=False)
    if exit_code == EXIT_CONTINUE:
        console.print(
            f"the run checkpointed and stopped early; continue it with `rollout-hpc resume {run_dir}`", markup=False
        )
    elif exit_code != 0 and not printed:
        console.print(
            "mpirun printed nothing: Open MPI could not start the ranks; `rollout-hpc doctor` checks MPI on this "
            "machine, and `mpirun -np 1 true` shows whether Open MPI starts at all",
            markup=False,
        )
    if exit_code not in (0, EXIT_CONTINUE):
        from rollout_hpc.store.checkpoint import list_checkpoints  # h5py: not when the CLI starts

        saved = list_checkpoints(run_dir)  # published ones only: never a crashed save's .tmp file
        where = f"from its newest checkpoint ({saved[-1].path.name})" if saved else "from the start (no checkpoint yet)"
        console.print(
            f"the run ended early (exit {exit_code}: an error above, or a rank was killed); nothing checkpointed is "
            f"lost: once the cause is fixed, `rollout-hpc resume {run_dir}` continues it {where}",
            markup=False,
        )
    return exit_code
