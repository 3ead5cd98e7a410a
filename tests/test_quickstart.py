"""The quickstart learns a real task (configs/quickstart.yaml: SFT warm-up, then GRPO, on two-digit sums with
multi-token answers): held-out accuracy rises during RL, from the eval just before the first RL update to the last
one, by at least 10 points. And the smoke config (configs/smoke.yaml: GRPO on one-token arithmetic) learns locally
and as a Slurm het job, with the analysis tools agreeing with an independent read of its log.

Thresholds come from measured runs of seed 0 (deterministic on the CPU), with wide margins: quickstart held-out
accuracy 0.62 before RL -> 0.86-0.93 after 200 RL steps (colocated, as shipped); smoke mean reward 0.02 (steps 0-19) -> ~0.5 (130-149)."""

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
SMOKE = REPO / "configs" / "smoke.yaml"
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
    assert last > 0.3 and last > first + 0.25, f"mean reward {first:.3f} -> {last:.3f}: the smoke config did not learn"
    return first, last


def test_quickstart_rl_raises_held_out_accuracy(tmp_path):
    """The quickstart exactly as shipped (run from the repository root, where its data paths start)."""
    done = cli("submit", str(QUICKSTART), "--run-dir", str(tmp_path / "qs"), cwd=REPO, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(cli("analyze", str(tmp_path / "qs"), "--json", cwd=tmp_path).stdout)
    ev = summary["eval"]
    warmup = 90
    assert warmup in ev["step"] and ev["step"][-1] == warmup + 200  # the policy RL starts from, and the last one
    before, after = ev["accuracy"][ev["step"].index(warmup)], ev["accuracy"][-1]
    assert 0.2 < before < 0.8, f"the warm-up should leave room for RL: {before:.3f}"
    assert after >= before + 0.10, f"held-out accuracy {before:.3f} -> {after:.3f}: RL did not raise it by 10 points"
    sft = [l for l in done.stdout.splitlines() if l.startswith("sft step ")]
    assert len(sft) == warmup


def test_smoke_config_learns_locally(tmp_path):
    done = cli(
        "submit",
        str(SMOKE),
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
    """The analysis tools on the smoke run's own log agree with an independent read of its parquet export."""
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
def test_smoke_config_learns_as_a_slurm_het_job(slurm_cluster, tmp_path):
    done = cli("submit", str(SMOKE), "--set", "launcher=slurm", "--set", f"algorithm.steps={STEPS}", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    job_id = next(l for l in done.stdout.splitlines() if l.startswith("submitted job")).split(":", 1)[1].split()[0]
    state = slurm_cluster.wait_job(int(job_id), timeout=600)
    run_dir = tmp_path / "runs" / "smoke"
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob(f"slurm-{job_id}.*"))
    assert state == "COMPLETED", logs[-4000:]
    # Two het components: the generator node and the trainer node.
    assert len(slurm_cluster.job_records(int(job_id))) == 2
    assert_learned(run_dir)
