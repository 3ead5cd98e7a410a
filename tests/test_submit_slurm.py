"""Submission to the real local Slurm cluster (tools/slurm_cluster.sh): het jobs, plain sbatch, status, cancel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[1]
HELLO = REPO / "configs" / "hello.yaml"
QUICKSTART = REPO / "configs" / "smoke.yaml"
JOB_TIMEOUT = 300


def cli(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rollout_hpc", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=180
    )


def hello_layout(log: str) -> list[tuple[int, str, str]]:
    """(rank, role, node) of every HELLO line in a job log."""
    rows = []
    for line in log.splitlines():
        if line.startswith("HELLO "):
            fields = dict(kv.split("=", 1) for kv in line.split()[1:])
            rows.append((int(fields["rank"]), fields["role"], fields["node"]))
    return sorted(rows)


def assert_hello_het_layout(log: str) -> None:
    """1 generator node + 2 trainer nodes: rank 0 generates, ranks 1-2 train, each on its own node."""
    layout = hello_layout(log)
    assert [(r, role) for r, role, _ in layout] == [(0, "generator"), (1, "trainer"), (2, "trainer")], log
    nodes = [node for _, _, node in layout]
    assert len(set(nodes)) == 3, f"ranks share a node: {layout}"
    assert log.count("HELLO-EXCHANGE ok") == 2, log


def submitted_job(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(l for l in done.stdout.splitlines() if l.startswith("submitted job"))
    return line.split(":", 1)[1].split()[0]


def test_submit_hello_het_job(slurm_cluster, tmp_path):
    done = cli("submit", str(HELLO), "--set", "launcher=slurm", cwd=tmp_path)
    job_id = submitted_job(done)
    run_dir = tmp_path / "runs" / "hello"
    assert json.loads((run_dir / "manifest.json").read_text())["job_ids"] == [job_id]
    state = slurm_cluster.wait_job(int(job_id), timeout=JOB_TIMEOUT)
    out = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    err = (run_dir / "logs" / f"slurm-{job_id}.err").read_text()
    assert state == "COMPLETED", out + err
    assert_hello_het_layout(out)
    # The het components are where the ranks say they ran.
    layout = hello_layout(out)
    # slurmctld still holds the finished job (MinJobAge=600 on the test cluster): status reports it.
    records = slurm_cluster.job_records(int(job_id))
    assert records[0]["NodeList"] == layout[0][2]
    status = json.loads(cli("status", str(run_dir), "--json", cwd=tmp_path).stdout)
    components = status["jobs"][0]["components"]
    assert [(c["role"], c["state"]) for c in components] == [("generator", "COMPLETED"), ("trainer", "COMPLETED")]
    assert components[0]["nodes"] == layout[0][2]


def test_plain_sbatch_of_the_template(slurm_cluster, tmp_path):
    """slurm/rollout.sbatch works without the CLI; its #SBATCH lines (1 + 2 nodes) decide the layout."""
    env = dict(os.environ, ROLLOUT_CONFIG=str(HELLO), ROLLOUT_PYTHON=sys.executable, ROLLOUT_SET="run.name=plain")
    done = subprocess.run(
        ["sbatch", "--parsable", str(REPO / "slurm" / "rollout.sbatch")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    job_id = int(done.stdout.strip().split(";")[0])
    state = slurm_cluster.wait_job(job_id, timeout=JOB_TIMEOUT)
    out = (tmp_path / f"rollout-{job_id}.out").read_text()
    err = (tmp_path / f"rollout-{job_id}.err").read_text()
    assert state == "COMPLETED", out + err
    assert_hello_het_layout(out)
    manifest = json.loads((tmp_path / "runs" / "plain" / "manifest.json").read_text())
    assert manifest["job_ids"] == [str(job_id)]
    assert "#SBATCH hetjob" in (tmp_path / "runs" / "plain" / "job.sbatch").read_text()


def test_bad_partition_is_refused_and_leaves_nothing(slurm_cluster, tmp_path):
    done = cli(
        "submit", str(HELLO), "--set", "launcher=slurm", "--set", "slurm.partition=nosuchpartition", cwd=tmp_path
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "sbatch refused" in done.stderr and "partition" in done.stderr.lower(), done.stderr
    assert not (tmp_path / "runs" / "hello").exists()


def test_chain_status_and_cancel_pending_jobs(slurm_cluster, tmp_path):
    """--chain queues dependent jobs; status shows each het component; cancel ends them all."""
    done = cli(
        "submit",
        str(HELLO),
        "--set",
        "launcher=slurm",
        "--set",
        "slurm.extra_sbatch=[--begin=now+3600]",
        "--chain",
        "2",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    run_dir = tmp_path / "runs" / "hello"
    job_ids = json.loads((run_dir / "manifest.json").read_text())["job_ids"]
    assert len(job_ids) == 3
    try:
        for previous, job in zip(job_ids, job_ids[1:]):
            assert slurm_cluster.job_records(int(job))[0]["Dependency"].startswith(f"afterany:{previous}")
        status = json.loads(cli("status", str(run_dir), "--json", cwd=tmp_path).stdout)
        rows = [(c["job_id"], c["role"], c["state"]) for j in status["jobs"] for c in j["components"]]
        assert rows == [
            (f"{j}+{k}", role, "PENDING") for j in job_ids for k, role in enumerate(("generator", "trainer"))
        ]
        table = cli("status", str(run_dir), cwd=tmp_path)
        assert table.returncode == 0 and f"{job_ids[0]}+1" in table.stdout
    finally:
        cancel = cli("cancel", str(run_dir), cwd=tmp_path)
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    for job in job_ids:
        assert slurm_cluster.wait_job(int(job), timeout=60) == "CANCELLED"


def submit_long_training(tmp_path: Path) -> tuple[str, Path]:
    done = cli("submit", str(QUICKSTART), "--set", "launcher=slurm", "--set", "algorithm.steps=100000", cwd=tmp_path)
    return submitted_job(done), tmp_path / "runs" / "smoke"


def test_status_and_cancel_of_a_running_job(slurm_cluster, tmp_path):
    """A real training run: status shows it RUNNING on its nodes; cancel ends it."""
    job_id, run_dir = submit_long_training(tmp_path)
    try:
        slurm_cluster.wait_state(int(job_id), {"RUNNING"}, timeout=JOB_TIMEOUT)
        status = json.loads(cli("status", str(run_dir), "--json", cwd=tmp_path).stdout)
        components = status["jobs"][0]["components"]
        assert [c["state"] for c in components] == ["RUNNING", "RUNNING"]
        assert all(c["nodes"] for c in components) and components[0]["restarts"] == "0"
    finally:
        cancel = cli("cancel", str(run_dir), cwd=tmp_path)
    assert cancel.returncode == 0 and "cancelling" in cancel.stdout, cancel.stdout + cancel.stderr
    assert slurm_cluster.wait_job(int(job_id), timeout=120) == "CANCELLED"
    again = cli("cancel", str(run_dir), cwd=tmp_path)
    assert again.returncode == 0 and "already ended" in again.stdout


def test_time_limit_warning_reaches_the_step(slurm_cluster, tmp_path):
    """--signal=B:USR1 goes to the batch shell only; its trap (on_warning) must pass it on to the job step."""
    job_id, run_dir = submit_long_training(tmp_path)
    err_log = run_dir / "logs" / f"slurm-{job_id}.err"
    try:
        slurm_cluster.wait_state(int(job_id), {"RUNNING"}, timeout=JOB_TIMEOUT)
        deadline = time.monotonic() + 60
        while f"{job_id}.0" not in slurm_cluster.run("squeue", "-h", "-s", "-j", job_id, "-o", "%i").stdout:
            assert time.monotonic() < deadline, "the job step never started"
            time.sleep(0.5)
        slurm_cluster.run("scancel", "--signal=USR1", "--batch", job_id)
        deadline = time.monotonic() + 60
        while "SIGUSR1" not in err_log.read_text() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert "SIGUSR1" in err_log.read_text() and "forwarding it to the job step" in err_log.read_text()
    finally:
        cli("cancel", str(run_dir), cwd=tmp_path)
    slurm_cluster.wait_job(int(job_id), timeout=120)
