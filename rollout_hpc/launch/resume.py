"""Continuing a run in a new allocation (or a local run) from its newest valid checkpoint.

`plan_resume` checks everything before anything is launched: the run directory is a run
(manifest.json), no job or local run of it is still going (two writers of one run directory
would interleave checkpoints and the trajectory log), the newest checkpoint verifies (a
damaged newer one is moved aside as `<name>.damaged` with one line saying so, so that the
ranks, which load the newest valid checkpoint themselves, and later prunes agree on it), and
the checkpoint was written under a compatible config (store.checkpoint.check_compatible).

`--set` overrides apply on top of the run's config.resolved.yaml; `apply_plan` writes the new
resolved config (and re-renders job.sbatch) only once the plan was accepted. `--force` reaches
the ranks as ROLLOUT_RESUME_FORCE=1 in their environment (runtime/checkpointing.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from rollout_hpc.config import Config, load_config
from rollout_hpc.errors import UserError
from rollout_hpc.launch import rundir
from rollout_hpc.launch.render import render_script
from rollout_hpc.launch.status import ENDED, job_states, local_state
from rollout_hpc.rundir_layout import TRAJECTORY_LOG

if TYPE_CHECKING:
    from rollout_hpc.store.checkpoint import CheckpointInfo  # imports torch: at run time only where needed

FORCE_ENV = "ROLLOUT_RESUME_FORCE"
DAMAGED_SUFFIX = ".damaged"


@dataclass
class ResumePlan:
    run_dir: Path
    cfg: Config
    overrides: list[str]
    step: int = 0  # steps already done (0: no checkpoint yet, start from the beginning)
    policy_version: int | None = None
    checkpoint: Path | None = None
    config_changes: list[str] = field(default_factory=list)  # every key that differs from the checkpoint's config
    damaged: list[str] = field(default_factory=list)  # one line per damaged checkpoint moved aside
    force: bool = False
    discard_log: bool = False  # --from-scratch over a log of N steps: apply_plan moves the log aside

    @property
    def finished(self) -> bool:
        return self.step >= self.cfg.total_steps


def live_jobs(run_dir: Path, manifest: dict) -> list[str]:
    """Jobs and local runs of the run that have not ended, as 'job 123 (RUNNING)' / 'local run pid 4 (RUNNING)'."""
    live = []
    for job_id in manifest.get("job_ids", []):
        states = {c.state for c in job_states(job_id)}
        if not states <= ENDED:
            live.append(f"job {job_id} ({', '.join(sorted(states))})")
    for record in manifest.get("local_runs", []):
        state = local_state(record)
        if state.startswith("RUNNING"):
            live.append(f"local run pid {record.get('pid')} ({state})")
    return live


def newest_valid_checkpoint(run_dir: Path, move_aside: bool = True) -> tuple[CheckpointInfo, dict, list[str]] | None:
    """(CheckpointInfo, meta, damaged lines) of the newest checkpoint that verifies; damaged newer ones are moved aside.

    A sharded checkpoint is verified through shard 0 (every shard's checksum attribute is checked too)."""
    # In here: store.checkpoint imports torch (seconds), and every CLI command imports this module.
    from rollout_hpc.store.checkpoint import CheckpointCorrupt, checkpoint_dir, list_checkpoints, load_checkpoint

    damaged = []
    for info in reversed(list_checkpoints(run_dir)):
        try:
            _, _, meta = load_checkpoint(info, shard=0 if info.sharded else None)
        except CheckpointCorrupt as exc:
            aside = info.path.with_name(info.path.name + DAMAGED_SUFFIX)
            if move_aside:
                os.replace(info.path, aside)
            damaged.append(
                f"skipping damaged checkpoint {exc}; {'moved' if move_aside else 'would move'} it to {aside.name}"
            )
            continue
        return info, meta, damaged
    if damaged:
        raise UserError(
            f"every checkpoint in {checkpoint_dir(run_dir)} is damaged ({'; '.join(damaged)}); "
            "restore a copy, or start the run afresh with `rollout-hpc submit`"
        )
    return None


def logged_steps(run_dir: Path) -> int | None:
    """Steps the run's trajectory log holds (None: no log; -1: a log that cannot be read)."""
    from rollout_hpc.store.trajlog import TrajectoryReader  # in here: h5py; the CLI must start fast

    path = run_dir / TRAJECTORY_LOG
    if not path.exists():
        return None
    try:
        with TrajectoryReader(path) as reader:
            return int(reader.metric_rows)
    except Exception:  # noqa: BLE001 - any unreadable log counts as one that holds something
        return -1


def plan_resume(
    run_dir: Path, overrides: list[str], force: bool = False, dry_run: bool = False, from_scratch: bool = False
) -> ResumePlan:
    from rollout_hpc.store.checkpoint import check_compatible  # in here: imports torch; the CLI must start fast

    run_dir = Path(os.path.abspath(run_dir))
    manifest = rundir.read_manifest(run_dir)  # UserError: not a run directory
    resolved = run_dir / rundir.RESOLVED_CONFIG
    if not resolved.is_file():
        raise UserError(
            f"{resolved} is missing: {run_dir} is not a complete run directory; restore it from config.yaml "
            f"(`rollout-hpc render`), or start a new run"
        )
    live = live_jobs(run_dir, manifest)
    if live:
        raise UserError(
            f"run {run_dir} is still going: {', '.join(live)}. Wait for it to end (`rollout-hpc status {run_dir}`) "
            f"or stop it first (`rollout-hpc cancel {run_dir}`); two jobs must not write one run directory"
        )
    cfg = load_config(resolved, overrides)
    plan = ResumePlan(run_dir, cfg, list(overrides), force=force)
    found = newest_valid_checkpoint(run_dir, move_aside=not dry_run)
    if found is None:
        steps = logged_steps(run_dir)
        if steps:  # a log of earlier work and no checkpoint to continue it from: never drop it silently
            what = "an unreadable trajectory log" if steps < 0 else f"a trajectory log of {steps} logged steps"
            if not from_scratch:
                aside = sorted(p.name for p in (run_dir / rundir.CHECKPOINTS).glob(f"*{DAMAGED_SUFFIX}"))
                raise UserError(
                    f"{run_dir} has no valid checkpoint ({'set aside as damaged: ' + ', '.join(aside) if aside else 'none written'}) "
                    f"but {what}; a resume would start again at step 0 and discard them. Restore a checkpoint, or "
                    f"pass --from-scratch to start over (the old log is kept as trajectories.discarded-<time>.h5)"
                )
            plan.discard_log = True
        return plan
    info, meta, plan.damaged = found
    plan.step, plan.checkpoint = info.step, info.path
    plan.policy_version = meta.get("policy_version")
    try:
        plan.config_changes = check_compatible(meta, cfg, force=force)
    except UserError as exc:
        raise UserError(f"cannot resume from {info.path.name}: {exc}") from None
    if not dry_run:
        plan.damaged += repair_damaged_log(run_dir, plan.step)
    return plan


def repair_damaged_log(run_dir: Path, steps_done: int) -> list[str]:
    """A damaged trajectory log (every chunk is read to find out) is kept aside and replaced by its readable
    steps; one line says what is lost. The ranks check it again when they open it (store.trajlog)."""
    from rollout_hpc.store.trajlog import repair_log, repair_message  # in here: h5py; the CLI must start fast

    log = run_dir / TRAJECTORY_LOG
    repaired = repair_log(log, resume_step=steps_done - 1, verify=True)
    return [repair_message(log, repaired)] if repaired else []


def apply_plan(plan: ResumePlan, launcher: str) -> None:
    """Write what the new allocation reads: the resolved config (with the overrides) and, for Slurm, its job script;
    with --from-scratch, move the old trajectory log aside (kept, never deleted)."""
    if plan.discard_log:
        log = plan.run_dir / TRAJECTORY_LOG
        if log.exists():
            stamp = rundir.now_utc().replace(":", "").replace("-", "")
            os.replace(log, log.with_name(f"trajectories.discarded-{stamp}.h5"))
    path = plan.run_dir / rundir.RESOLVED_CONFIG
    text = yaml.safe_dump(plan.cfg.resolved(), sort_keys=False)
    if plan.overrides:
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, path)
    script = plan.run_dir / rundir.JOB_SCRIPT
    if launcher == "slurm" and (plan.overrides or not script.is_file()):
        manifest = rundir.read_manifest(plan.run_dir)
        script.write_text(render_script(plan.cfg, plan.run_dir, manifest.get("config_source") or "(defaults)"))

    def record(manifest: dict) -> None:
        manifest["config_digest"] = plan.cfg.digest()
        manifest.setdefault("resumes", []).append(
            {
                "at": rundir.now_utc(),
                "launcher": launcher,
                "from_step": plan.step,
                "checkpoint": plan.checkpoint.name if plan.checkpoint else None,
                "overrides": plan.overrides,
                "forced_changes": plan.config_changes if plan.force else [],
                "damaged": plan.damaged,
            }
        )

    rundir.update_manifest(plan.run_dir, record)
