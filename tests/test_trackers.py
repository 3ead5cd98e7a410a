"""Experiment trackers (runtime/trackers.py): TensorBoard, MLflow (file store) and W&B (offline) fed from a real local
run (`rollout-hpc submit --local`, mpirun, 2 ranks) that is SIGKILLed after steps past its newest checkpoint reached
the trackers, then resumed: each tracker holds every step and every eval exactly once, read back with its own
reader (TensorBoard's EventAccumulator, MLflow's client, the history records of W&B's offline run files, which W&B
writes every 15 s: the killed allocation's last steps are lost there and must come back from the HDF5 log)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from test_loop import _rank_pid
from test_resume_local import Interruptible, cli, write_run_config

from rollout_hpc.runtime.trackers import offline_history
from rollout_hpc.store.trajlog import read_eval, read_metrics

STEPS = 8
TRACKED = """
logging: {trackers: [tensorboard, mlflow, wandb], wandb: {mode: offline, project: tests}}
eval: {every_steps: 3, max_prompts: 16}
"""


def mlflow_steps(run_dir: Path, key: str) -> list[int]:
    """Steps of `key` in the run's MLflow file store, read with MLflow's client."""
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    from mlflow.tracking import MlflowClient

    state = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(state["tracking_uri"])
    experiment = client.get_experiment_by_name("cut")
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [state["run_id"]]
    return [m.step for m in client.get_metric_history(state["run_id"], key)]


def tensorboard_scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def wait_until_logged(run_dir: Path, step: int, timeout: float = 60) -> None:
    """Until the MLflow file store holds train step `step` (the tracker thread took it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for metric in (run_dir / "mlruns").glob("*/*/metrics/train/reward_mean"):
            if any(int(line.split()[2]) >= step for line in metric.read_text().splitlines() if line.strip()):
                return
        time.sleep(0.05)
    raise AssertionError(f"step {step} never reached MLflow")


def test_trackers_hold_every_step_once_after_a_kill_and_resume(tmp_path):
    run_dir = tmp_path / "cut"
    config = write_run_config(tmp_path, "cut", steps=STEPS, sleep=0.1, extra=TRACKED)
    run = Interruptible("submit", config, "--local", "--run-dir", run_dir, cwd=tmp_path)
    run.wait_for_step(4)  # checkpoints every 3 steps: steps 3 and 4 (0-based) come after the newest, 3
    wait_until_logged(run_dir, 4)
    os.kill(
        _rank_pid(json.loads((run_dir / "manifest.json").read_text())["local_runs"][-1]["pid"], "train0"),
        signal.SIGKILL,
    )
    assert run.finish() not in (0, 75), run.output[-3000:]
    assert "warning: tracker" not in run.output, run.output[-3000:]
    logged_before = mlflow_steps(run_dir, "train/reward_mean")
    assert logged_before[-1] >= 4  # steps the resume replays were already in the trackers

    done = cli("resume", run_dir, "--local", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "resuming from step-00000003.h5" in done.stdout and "warning: tracker" not in done.stdout + done.stderr

    hdf5 = {int(m["step"]): m["reward_mean"] for m in read_metrics(run_dir / "trajectories.h5")}
    evals = sorted(int(e["step"]) for e in read_eval(run_dir / "trajectories.h5"))
    assert sorted(hdf5) == list(range(STEPS)) and evals == [0, 3, 6, STEPS]

    # TensorBoard: the replayed steps' first events are purged; the values are the log's.
    scalars = tensorboard_scalars(run_dir, "train/reward_mean")
    assert [s for s, _ in scalars] == list(range(STEPS))
    assert all(abs(v - hdf5[s]) < 1e-6 for s, v in scalars)
    assert [s for s, _ in tensorboard_scalars(run_dir, "eval/accuracy")] == evals

    # MLflow: one run, continued; the steps it already held were not logged again.
    assert mlflow_steps(run_dir, "train/reward_mean") == list(range(STEPS))
    assert mlflow_steps(run_dir, "eval/accuracy") == evals

    # W&B offline: one directory per allocation, one run id, disjoint steps (what `wandb sync --append` needs).
    state = json.loads((run_dir / "trackers.json").read_text())["wandb"]
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(state["id"]) for r in runs)
    history = [row for r in runs for row in offline_history(r / f"run-{state['id']}.wandb")]
    assert [row["_step"] for row in history] == list(range(STEPS))
    assert all(abs(row["train/reward_mean"] - hdf5[row["_step"]]) < 1e-9 for row in history)
    assert sorted(row["eval/step"] for row in history if "eval/step" in row) == evals


def test_a_tracker_that_cannot_be_imported_warns_once_and_the_run_finishes(tmp_path):
    blocker = tmp_path / "site"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['wandb'] = None  # as if not installed\n")
    config = write_run_config(tmp_path, "nowandb", steps=2, sleep=0, extra="logging: {trackers: [wandb, tensorboard]}")
    env = {**os.environ, "PYTHONPATH": f"{blocker}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [sys.executable, "-m", "rollout_hpc", "submit", config, "--local", "--run-dir", tmp_path / "run"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    warnings = [line for line in output.splitlines() if "tracker wandb" in line]
    assert len(warnings) == 1 and "not installed" in warnings[0] and "rollout-hpc[trackers]" in warnings[0], output
    assert [s for s, _ in tensorboard_scalars(tmp_path / "run", "train/reward_mean")] == [0, 1]
    assert not (tmp_path / "run" / "wandb").exists()
