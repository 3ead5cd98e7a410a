"""`rollout-hpc plan --check` against real runs (the accuracy checks are marked `scalecheck`: `pytest -m scalecheck`): one profile predicts the mean step time of runs of other layouts
within 25 %, under the local launcher (disaggregated and colocated, on-policy and async) and as het jobs on the
real local Slurm cluster (generator and trainer groups of different sizes, on-policy and async).

The prediction comes from the profile alone: its calibration run is a run of its own (1 + 1 nodes), never one
of the runs checked here. This 2-core machine is shared and noisy (identical 40-step runs measured 0.127 to
0.189 s a step): a layout whose run misses the bound is run once more, and that run decides."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_hpc.scale.profile import Profile

REPO = Path(__file__).resolve().parents[1]
STEPS = 30
TOLERANCE = 0.25


def write_config(directory: Path, launcher: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "scale.yaml"
    path.write_text(f"""
run: {{name: scale-{launcher}, seed: 0}}
launcher: {launcher}
model: {{hidden_size: 128, num_layers: 2, num_heads: 4, max_seq_len: 32}}
task:
  name: dataset
  reward: exact
  params: {{train: {REPO / "configs" / "data" / "sums-train.jsonl"}, chat_template: none}}
algorithm: {{name: grpo, steps: {STEPS}, prompts_per_step: 16, group_size: 8, max_new_tokens: 4, lr: 3.0e-4}}
checkpoint: {{every_steps: 15, keep_last: 1}}
""")
    return path


def rollout(*args, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "rollout_hpc", *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def check(run_dir: Path, profile: Path, cwd: Path) -> dict:
    return json.loads(rollout("plan", "--check", run_dir, "--profile", profile, "--json", cwd=cwd).stdout)


def assert_within(results: dict[str, dict]) -> None:
    table = "\n".join(
        f"{name:>28}: predicted {r['predicted_step_s']:.4f} s, measured {r['measured_step_s']:.4f} s, "
        f"error {r['relative_error']:+.0%}"
        for name, r in results.items()
    )
    print(table)
    assert all(abs(r["relative_error"]) <= TOLERANCE for r in results.values()), table


def test_profile_plan_and_check_end_to_end(tmp_path):
    """The commands as a user chains them, on the local launcher: profile, plan from it, a run, --check of it."""
    config = write_config(tmp_path, "local")
    profile = tmp_path / "p.json"
    done = rollout(
        "profile", config, "--out", profile, "--calibration-steps", 6, "--run-dir", tmp_path / "prof", cwd=tmp_path
    )
    for phase in ("generation:", "training:", "rewards", "checkpoint write", "overhead (calibration run)"):
        assert phase in done.stdout, done.stdout
    p = Profile.load(profile)
    c, w = p.costs, p.workload
    assert c.gen_token_s + c.gen_token_row_s > 0 and c.train_token_s > 0 and c.startup_s > 0
    assert c.mpi_gb_per_s > 0 and c.bcast_gb_per_s > 0 and c.ring_gb_per_s > 0 and c.fs_write_gb_per_s > 0
    assert w.weight_bytes > 0 and w.checkpoint_bytes > w.weight_bytes  # weights plus optimizer state
    assert 1 <= min(w.response_lengths) and max(w.response_lengths) <= 4  # max_new_tokens 4
    assert p.config_digest and p.versions["h5py"] and p.machine.cores_per_node >= 1
    assert {"generation_points", "train_points", "bcast_points", "calibration"} <= set(p.measurements)
    planned = json.loads(rollout("plan", config, "--nodes", 3, "--profile", profile, "--json", cwd=tmp_path).stdout)
    layouts = {
        (x["placement"], x["generator_nodes"], x["trainer_nodes"], x["max_staleness"]) for x in planned["layouts"]
    }
    assert ("colocated", 3, 3, 0) in layouts and ("disaggregated", 2, 1, 1) in layouts
    assert planned["recommended"]["samples_per_s"] == max(x["samples_per_s"] for x in planned["layouts"][:1])
    run_dir = tmp_path / "run"
    rollout("submit", config, "--set", "algorithm.steps=6", "--run-dir", run_dir, cwd=tmp_path)
    checked = check(run_dir, profile, tmp_path)
    assert checked["steps_measured"] == 5 and checked["predicted_step_s"] > 0 and checked["measured_step_s"] > 0
    assert checked["relative_error"] == pytest.approx(
        (checked["predicted_step_s"] - checked["measured_step_s"]) / checked["measured_step_s"]
    )


def predicted_runs(layouts: dict[str, list[str]], run, profile: Path, cwd: Path) -> dict[str, dict]:
    """`plan --check` of a run of each layout (run(name, index, attempt, overrides) -> run directory); a layout
    whose run misses the bound is run once more, and that run decides (see the module doc)."""
    results = {}
    for i, (name, sets) in enumerate(layouts.items()):
        for attempt in range(2):
            results[name] = check(run(i, attempt, [a for s in sets for a in ("--set", s)]), profile, cwd)
            assert results[name]["steps_measured"] == STEPS - 1
            if abs(results[name]["relative_error"]) <= TOLERANCE:
                break
    return results


@pytest.mark.scalecheck  # ~1.5 min of runs; the command chain itself is in the default run (the test above)
def test_local_layouts_are_predicted_from_one_profile(tmp_path):
    config = write_config(tmp_path, "local")
    profile = tmp_path / "local.profile.json"
    done = rollout("profile", config, "--out", profile, "--run-dir", tmp_path / "profiling", cwd=tmp_path)
    assert "calibration" in done.stdout and "overhead (calibration run)" in done.stdout
    p = Profile.load(profile)
    assert p.source == "measured" and p.machine.shared_host and p.workload.response_lengths
    assert p.measurements["calibration"]["steps"] == 17  # 20 steps, the first 3 left out

    def run(i: int, attempt: int, sets: list[str]) -> Path:
        run_dir = tmp_path / f"run{i}-{attempt}"
        rollout("submit", config, *sets, "--run-dir", run_dir, cwd=tmp_path)
        return run_dir

    layouts = {
        "disaggregated 1+1 on-policy": [],
        "disaggregated 1+1 staleness 1": ["exchange.max_staleness=1"],
        "disaggregated 2+1 on-policy": ["generator.nodes=2"],
        "colocated 1 node on-policy": ["placement=colocated"],
    }
    assert_within(predicted_runs(layouts, run, profile, tmp_path))


@pytest.mark.slurm
@pytest.mark.scalecheck
def test_slurm_het_jobs_are_predicted_from_one_profile(slurm_cluster, tmp_path):
    config = write_config(tmp_path, "slurm")
    profile = tmp_path / "slurm.profile.json"
    done = rollout("profile", config, "--out", profile, "--run-dir", tmp_path / "profiling", cwd=tmp_path)
    assert "COMPLETED" in done.stdout

    def run(i: int, attempt: int, sets: list[str]) -> Path:
        run_dir = tmp_path / f"run{i}-{attempt}"
        name = ["--set", f"run.name=scale-{i}-{attempt}"]
        sub = rollout("submit", config, *sets, *name, "--run-dir", run_dir, cwd=tmp_path)
        job = next(line for line in sub.stdout.splitlines() if line.startswith("submitted job"))
        assert slurm_cluster.wait_job(int(job.split(":")[1].split()[0]), timeout=600) == "COMPLETED"
        return run_dir

    layouts = {
        "2 generator + 1 trainer nodes, on-policy": ["generator.nodes=2"],
        "1 generator + 2 trainer nodes, on-policy": ["trainer.nodes=2"],
        "1 generator + 1 trainer node, staleness 1": ["exchange.max_staleness=1"],
    }
    assert_within(predicted_runs(layouts, run, profile, tmp_path))
