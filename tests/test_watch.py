"""`rollout-hpc watch RUN_DIR`: a live view of a real local run (mpirun, 2 ranks) under a pseudo-terminal (`script`)
shows the step advancing and exits when the job ends; `--once` on the finished run shows its last step. The same
finished run, exported (`export-model`), is traced back by `rollout-hpc analyze MODEL_DIR`."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_resume_local import cli, write_run_config

from rollout_hpc.commands.analysis import export_provenance

STEPS = 10
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture(scope="module")
def watched(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A run, and `watch` following it under a pseudo-terminal from its start to its end."""
    tmp_path = tmp_path_factory.mktemp("watch")
    run_dir = tmp_path / "watched"
    config = write_run_config(tmp_path, "watched", steps=STEPS, sleep=0.1, extra="checkpoint: {every_steps: 2}")
    run = subprocess.Popen(
        [sys.executable, "-m", "rollout_hpc", "submit", config, "--local", "--run-dir", run_dir],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "manifest.json").is_file():  # submit makes the run directory, then starts mpirun
            assert time.monotonic() < deadline and run.poll() is None, run.stdout.read() if run.stdout else ""
            time.sleep(0.1)
        watch = f"{sys.executable} -m rollout_hpc watch {run_dir} --interval 0.3"
        view = subprocess.run(
            ["script", "-qfec", watch, "/dev/null"],
            capture_output=True,
            text=True,
            timeout=240,
            env={**os.environ, "COLUMNS": "120", "LINES": "40"},
        )
        assert run.wait(timeout=60) == 0
    finally:
        run.kill()
        run.communicate()
    return run_dir, view


def test_watch_follows_a_running_job_until_it_ends(watched):
    _, view = watched
    shown = ANSI.sub("", view.stdout)
    assert view.returncode == 0, shown[-3000:]
    steps = [int(s) for s in re.findall(rf"step (\d+)/{STEPS}\b", shown)]
    assert len(set(steps)) >= 3 and steps == sorted(steps), steps  # frames of the running job, step advancing
    assert "the job has ended" in shown


def test_watch_once_shows_the_finished_run(watched, tmp_path):
    run_dir, _ = watched
    once = cli("watch", run_dir, "--once", cwd=tmp_path)
    assert once.returncode == 0, once.stderr
    assert f"step {STEPS}/{STEPS}" in once.stdout and "local run ENDED (exit 0)" in once.stdout
    assert "eval accuracy" not in once.stdout and "reward" in once.stdout  # this run has no eval section

    missing = cli("watch", tmp_path / "nothing", "--once", cwd=tmp_path)
    assert missing.returncode == 2 and "manifest.json" in missing.stderr and "Traceback" not in missing.stderr


def test_analyze_an_exported_model_names_the_run_it_came_from(watched, tmp_path):
    run_dir, _ = watched
    model = tmp_path / "model"
    assert cli("export-model", run_dir, "--out", model, "--quiet", cwd=tmp_path).returncode == 0
    record = export_provenance(model)  # what `analyze MODEL_DIR --json` prints
    assert record["run_dir"] == str(run_dir) and record["step"] == STEPS and record["checks"]["checkpoint_exists"]
    assert record["checks"]["run_config_changed_since"] == [] and "files match" in record["checks"]["files"]

    with open(model / "config.json", "a") as f:  # edited after the export
        f.write(" ")
    shown = cli("analyze", model, cwd=tmp_path)
    assert shown.returncode == 1 and "CHANGED" in shown.stdout and "config.json" in shown.stdout, shown.stderr
    assert (
        str(run_dir) in shown.stdout
        and f"{STEPS} / {STEPS}" in shown.stdout
        and record["config_digest"] in shown.stdout
    )


@pytest.mark.slurm
def test_watch_shows_the_time_left_of_a_slurm_job_and_its_end(slurm_cluster, watched, tmp_path):
    """The run's newest job on the real local Slurm cluster (a sleep job standing in for the run's job: a real
    het-job run would cost minutes here): `squeue`'s time left while it runs, its Slurm state after `scancel`."""
    run_dir = tmp_path / "on-slurm"
    shutil.copytree(watched[0], run_dir)
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\nsleep 300\n")
    job = slurm_cluster.sbatch(script, "--time=5", cwd=tmp_path)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest.update(launcher="slurm", job_ids=[str(job)], local_runs=[])
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    watch = [sys.executable, "-m", "rollout_hpc", "watch", str(run_dir), "--once"]
    try:
        slurm_cluster.wait_state(job, {"RUNNING"})
        shown = subprocess.run(watch, env=slurm_cluster.env, capture_output=True, text=True, timeout=60).stdout
        assert re.search(r"allocation ends in\s+[0-4]:\d\d", shown) and f"job {job} RUNNING" in shown, shown
    finally:
        slurm_cluster.run("scancel", str(job))
    slurm_cluster.wait_state(job, {"CANCELLED"})
    shown = subprocess.run(watch, env=slurm_cluster.env, capture_output=True, text=True, timeout=60).stdout
    assert f"job {job} CANCELLED" in shown and "allocation ends in" not in shown, shown
