"""The quickstart learns: `rollout-hpc submit configs/quickstart.yaml` makes the mean reward of the
built-in arithmetic task clearly rise, locally under mpirun and as a Slurm het job.

Thresholds come from measured runs of seed 0 (deterministic on the CPU): mean reward of steps 0-19
is 0.02, of steps 130-149 about 0.5; the assertions leave wide margins."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rollout_hpc.store.trajlog import read_metrics

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "configs" / "quickstart.yaml"
STEPS = 150


def cli(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rollout_hpc", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def assert_learned(run_dir: Path) -> tuple[float, float]:
    metrics = read_metrics(run_dir / "trajectories.h5")
    assert [int(m["step"]) for m in metrics] == list(range(STEPS))
    reward = np.array([m["reward_mean"] for m in metrics])
    first, last = reward[:20].mean(), reward[-20:].mean()
    assert first < 0.15, f"a random model should rarely be right: {first:.3f}"
    assert last > 0.3 and last > first + 0.25, f"mean reward {first:.3f} -> {last:.3f}: the quickstart did not learn"
    return first, last


def test_quickstart_learns_locally(tmp_path):
    done = cli(
        "submit",
        str(QUICKSTART),
        "--local",
        "--run-dir",
        str(tmp_path / "run"),
        "--set",
        f"algorithm.steps={STEPS}",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # The progress line, once per step, from the trainer.
    lines = [l for l in done.stdout.splitlines() if l.startswith("step ")]
    assert len(lines) == STEPS and lines[-1].startswith(f"step {STEPS}/{STEPS}  reward ")
    assert_learned(tmp_path / "run")
    check_analysis_of_a_real_log(tmp_path / "run", tmp_path)


def check_analysis_of_a_real_log(run_dir: Path, tmp_path: Path) -> None:
    """The analysis tools on the quickstart's own log agree with an independent read of its parquet export."""
    import pyarrow.parquet as pq

    summary = cli("analyze", str(run_dir), "--json", cwd=tmp_path)
    assert summary.returncode == 0, summary.stderr
    summary = json.loads(summary.stdout)
    exported = cli("export", str(run_dir), "--format", "parquet", "--out", str(tmp_path / "export"), cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    table = pq.read_table(tmp_path / "export" / "trajectories.parquet").to_pandas()
    assert summary["samples"] == len(table) == STEPS * 16 * 8  # prompts_per_step x group_size, every step once
    assert summary["steps"] == STEPS and summary["restarts"] == 0
    assert summary["reward"]["mean"] == pytest.approx(float(table["reward"].mean()), abs=1e-6)
    # Every trajectory of the data stream exactly once.
    assert not table.duplicated(subset=["prompt_id", "sample_idx"]).any()
    best = cli("samples", str(run_dir), "--best", "2", cwd=tmp_path)
    assert best.returncode == 0 and "prompt:" in best.stdout and "=" in best.stdout, best.stdout + best.stderr


@pytest.mark.slurm
def test_quickstart_learns_as_a_slurm_het_job(slurm_cluster, tmp_path):
    done = cli("submit", str(QUICKSTART), "--set", "launcher=slurm", "--set", f"algorithm.steps={STEPS}", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    job_id = next(l for l in done.stdout.splitlines() if l.startswith("submitted job")).split(":", 1)[1].split()[0]
    state = slurm_cluster.wait_job(int(job_id), timeout=600)
    run_dir = tmp_path / "runs" / "quickstart"
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob(f"slurm-{job_id}.*"))
    assert state == "COMPLETED", logs[-4000:]
    # Two het components: the generator node and the trainer node.
    assert len(slurm_cluster.job_records(int(job_id))) == 2
    assert_learned(run_dir)
