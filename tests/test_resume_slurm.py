"""Resuming on the real local Slurm cluster: the time-limit warning (--signal=B:USR1@N) -> checkpoint -> exit 75 ->
`scontrol requeue` -> the requeued job continues; and `scancel` followed by `rollout-hpc resume`. Each run ends with
every prompt sample trained on and logged exactly once."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from test_resume_local import assert_exactly_once, cli, write_run_config
from test_submit_slurm import submitted_job

from rollout_hpc.store.checkpoint import list_checkpoints

pytestmark = pytest.mark.slurm


def warned_once_checkpointed(slurm_cluster, run_dir: Path, job_id: str) -> str:
    """USR1 to the batch shell once the run has a checkpoint (-> checkpoint, exit 75, requeue); waits for the job to
    complete and returns its log, having checked that it requeued itself and resumed."""
    deadline = time.monotonic() + 240
    while not list_checkpoints(run_dir):  # the step runs (a periodic checkpoint every 3 steps exists)
        assert time.monotonic() < deadline, job_log(run_dir, job_id)[-4000:]
        time.sleep(0.5)
    slurm_cluster.run("scancel", "--signal=USR1", "--batch", job_id)
    state = slurm_cluster.wait_job(int(job_id), timeout=400)
    log = job_log(run_dir, job_id)
    assert state == "COMPLETED", log[-4000:]
    assert "job step exited with code 75" in log and f"requeueing job {job_id}" in log
    assert "rollout-hpc: resumed from" in log
    return log


def job_log(run_dir: Path, job_id: str) -> str:
    logs = run_dir / "logs"
    return "".join(
        (logs / f"slurm-{job_id}.{ext}").read_text()
        for ext in ("out", "err")
        if (logs / f"slurm-{job_id}.{ext}").exists()
    )


@pytest.mark.soak  # ~3 min: the warning -> requeue path is in test_slurm_cluster.py, the USR1 -> checkpoint -> exit 75
# -> requeue -> resume path in test_reward_models_run.py (scancel --signal=USR1 --batch); this one waits for slurmctld
def test_time_limit_warning_requeues_and_the_run_finishes(slurm_cluster, tmp_path):
    # A 2-minute limit, warned 60 s before. slurmctld checks limits every 30 s and sends the warning once the
    # limit is within warning + 30 s, so USR1 comes 30-60 s into each allocation (a lead near the whole limit
    # would signal the job as it starts). 90 steps of ~1 s (a slow reward) are ~90 s of work, so the run cannot finish
    # before the first allocation's warning, whenever in that window it comes (50 steps raced it on a fast machine).
    steps = 90
    config = write_run_config(
        tmp_path,
        "warned",
        steps=steps,
        sleep=0.25,
        launcher="slurm",
        extra='slurm: {time: "00:02:00", signal_lead_seconds: 60, max_requeues: 6}',
    )
    job_id = submitted_job(cli("submit", config, "--run-dir", tmp_path / "warned", cwd=tmp_path))
    run_dir = tmp_path / "warned"
    state = slurm_cluster.wait_job(int(job_id), timeout=600)
    log = job_log(run_dir, job_id)
    assert state == "COMPLETED", log[-4000:]
    restarts = int(slurm_cluster.job_records(int(job_id))[0]["Restarts"])
    assert restarts >= 1, log[-4000:]  # SLURM_RESTART_COUNT advanced
    assert log.count("SIGUSR1") >= restarts and log.count(f"requeueing job {job_id}") == restarts
    assert log.count("job step exited with code 75") == restarts and "job step exited with code 0" in log
    assert log.count("rollout-hpc: resumed from") == restarts  # each requeued allocation continued, none restarted
    assert list_checkpoints(run_dir)[-1].step == steps
    assert_exactly_once(run_dir, steps)


def test_scancel_then_resume_continues_to_the_end(slurm_cluster, tmp_path):
    steps = 16
    config = write_run_config(tmp_path, "cancelled", steps=steps, sleep=0.25, launcher="slurm")
    run_dir = tmp_path / "cancelled"
    first = submitted_job(cli("submit", config, "--run-dir", run_dir, cwd=tmp_path))
    deadline = time.monotonic() + 240
    while not list_checkpoints(run_dir):  # a periodic checkpoint (every 3 steps) exists
        assert time.monotonic() < deadline, job_log(run_dir, first)[-4000:]
        time.sleep(0.5)
    cancel = cli("cancel", run_dir, cwd=tmp_path)
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    assert slurm_cluster.wait_job(int(first), timeout=120) == "CANCELLED"
    saved = list_checkpoints(run_dir)[-1].step
    assert saved < steps

    done = cli("resume", run_dir, cwd=tmp_path)
    second = submitted_job(done)
    assert f"resuming from step-{saved:08d}.h5: step {saved} of {steps}" in done.stdout, done.stdout
    assert json.loads((run_dir / "manifest.json").read_text())["job_ids"] == [first, second]
    state = slurm_cluster.wait_job(int(second), timeout=300)
    assert state == "COMPLETED", job_log(run_dir, second)[-4000:]
    assert f"(after step {saved})" in job_log(run_dir, second)
    assert list_checkpoints(run_dir)[-1].step == steps
    assert_exactly_once(run_dir, steps)
