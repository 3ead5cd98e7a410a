"""A run's measured step times, from its trajectory log (what `rollout-hpc plan --check` compares with a prediction,
and what `rollout-hpc profile`'s calibration run splits into a generator and a trainer overhead)."""

from __future__ import annotations

from pathlib import Path

from rollout_hpc.errors import UserError
from rollout_hpc.store.trajlog import TrajectoryReader, log_path

# The trainer's timing of each step (runtime/trainer_loop.py): the whole period, the wait for the step's
# experience, the update, the weight broadcast.
PHASES = ("step_time", "idle_time", "train_time", "sync_time")


def mean_phase_times(run_dir: str | Path, first_rl_step: int, skip: int = 1) -> tuple[dict[str, float], int]:
    """({phase: mean seconds}, steps averaged) over a run's RL steps, the first `skip` (a warm-up: first calls,
    caches) left out. `first_rl_step` is warmup.sft_steps: the SFT steps before it are not RL steps."""
    log = log_path(run_dir)
    if not log.is_file():
        raise UserError(f"{run_dir} has no trajectory log ({log}); a step time needs a run that trained")
    with TrajectoryReader(log) as reader:
        m = reader.metrics()
    missing = [p for p in PHASES if p not in m]
    if missing:
        raise UserError(f"{log} has no {', '.join(missing)} metric; it was written by an older rollout-hpc")
    rl = m["step"] >= first_rl_step + skip
    n = int(rl.sum())
    if n < 2:
        raise UserError(f"{log} has {n} RL step(s) after the first {skip}; a mean step time needs 2 or more")
    return {p: float(m[p][rl].mean()) for p in PHASES}, n


def mean_step_time(run_dir: str | Path, first_rl_step: int) -> tuple[float, int]:
    phases, n = mean_phase_times(run_dir, first_rl_step)
    return phases["step_time"], n
