"""Submitting a run to Slurm: run directory, job script, `sbatch --parsable`, optional chain."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from rollout_hpc.config import Config
from rollout_hpc.errors import UserError
from rollout_hpc.launch import rundir
from rollout_hpc.launch.executables import require_executable
from rollout_hpc.launch.mpi_env import fresh_job_env
from rollout_hpc.launch.render import render_script

SBATCH_TIMEOUT_S = 120


@dataclass
class Submission:
    run_dir: Path
    script: Path
    job_ids: list[str] = field(default_factory=list)
    dry_run: bool = False


def resolve_launcher(cfg: Config, force_local: bool = False) -> str:
    """'slurm' or 'local'. auto = Slurm when sbatch is on PATH, else the local mpirun launcher."""
    if force_local:
        return "local"
    if cfg.launcher == "auto":
        return "slurm" if shutil.which("sbatch") else "local"
    return cfg.launcher


def require_sbatch() -> str:
    return require_executable(
        "sbatch",
        "launcher 'slurm' needs the `sbatch` command, but it is not on PATH. "
        "Run this on a Slurm login node (or `module load slurm`), or run on this machine with "
        "`rollout-hpc submit CONFIG --local` (or launcher: local in the config).",
    )


def sbatch(script: Path, *, dependency: str | None = None, export: str | None = None) -> str:
    """Submit script; returns the job id. sbatch's own message on refusal becomes a UserError."""
    cmd = [require_sbatch(), "--parsable"]
    if dependency:
        cmd.append(f"--dependency={dependency}")
    if export:
        cmd.append(f"--export={export}")
    cmd.append(str(script))
    try:
        # The job inherits this environment (--export=ALL): not a parent MPI process's variables, which srun's ranks
        # would take for their own.
        env = fresh_job_env(os.environ)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=SBATCH_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        raise UserError(
            f"sbatch did not answer within {SBATCH_TIMEOUT_S}s; is slurmctld reachable (`sinfo`)?"
        ) from None
    if done.returncode != 0:
        message = (done.stderr or done.stdout).strip() or f"exit code {done.returncode}"
        raise UserError(
            f"sbatch refused the job script {script}: {message} "
            "(check slurm.partition, slurm.account, slurm.qos, slurm.time and the group sizes in the config; "
            "`rollout-hpc render CONFIG` shows the #SBATCH lines)"
        )
    job_id = done.stdout.strip().split(";")[0]  # --parsable prints "id" or "id;cluster"
    if not job_id.isdigit():
        raise UserError(
            f"sbatch answered '{done.stdout.strip()}', not a job id; submission state unknown, check `squeue`"
        )
    return job_id


def scancel(job_ids: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(["scancel", *job_ids], capture_output=True, text=True, timeout=SBATCH_TIMEOUT_S)


def submit_slurm(
    cfg: Config,
    config_file: Path | None,
    overrides: list[str],
    *,
    dry_run: bool = False,
    chain: int = 0,
    run_dir: Path | None = None,
) -> Submission:
    """Create the run directory and submit its job (plus `chain` dependent jobs).

    Nothing is left behind when Slurm refuses: the run directory is removed and any job of the
    chain already queued is cancelled.
    """
    if not dry_run:
        require_sbatch()
    run_dir = Path(run_dir or cfg.run.resolved_dir()).absolute()
    rundir.refuse_existing(run_dir)
    source = str(config_file) if config_file else "(defaults)"
    script_text = render_script(cfg, run_dir, source)
    run_dir = rundir.create_run_dir(
        run_dir, cfg, config_file, launcher="slurm", script=script_text, overrides=overrides, dry_run=dry_run
    )
    submission = Submission(run_dir, run_dir / rundir.JOB_SCRIPT, dry_run=dry_run)
    if dry_run:
        return submission
    # With a chain the next job continues the run, so a job must not also requeue itself.
    export = "ALL,ROLLOUT_REQUEUE=0" if chain else None
    try:
        previous = None
        for _ in range(1 + chain):
            dependency = f"afterany:{previous}" if previous else None
            previous = sbatch(submission.script, dependency=dependency, export=export)
            submission.job_ids.append(previous)
        rundir.add_job_ids(run_dir, submission.job_ids)
    except BaseException:
        if submission.job_ids:
            scancel(submission.job_ids)
        rundir.remove_run_dir(run_dir)
        raise
    return submission
