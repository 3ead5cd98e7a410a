"""PPO through the whole RL loop (real mpirun ranks, exchange, weight sync, HDF5 checkpoints):
the critic learns beside the policy, and it is checkpointed and resumed bitwise."""

from __future__ import annotations

import signal

import numpy as np
from mpi_progs.launch import mpirun, node_blocks, write_config
from test_loop import ENTRY, TINY, _wait_for_steps, final_digest, run_loop, start_loop

from rollout_hpc.store.checkpoint import list_checkpoints, load_latest_valid
from rollout_hpc.store.trajlog import read_metrics

PPO = ["algorithm.name=ppo", "run.seed=0"]


def test_ppo_learns_the_arithmetic_task(tmp_path):
    # Measured (seed 0, 2 CPU cores, ~35 s): mean reward per 10 steps 0.02 0.05 0.10 0.17 0.13 0.11 0.17
    # 0.25 0.38 0.47 0.54 0.55 0.56 0.60 0.54.
    steps = ["algorithm.steps=150", "algorithm.lr=0.002", "algorithm.prompts_per_step=16", "algorithm.group_size=8"]
    _, res = run_loop(tmp_path, [*PPO, *steps, "checkpoint.every_steps=150"])
    assert res.returncode == 0, res.stderr[-4000:]
    metrics = read_metrics(tmp_path / "trajectories.h5")
    reward = np.array([m["reward_mean"] for m in metrics])
    first, last = reward[:20].mean(), reward[-20:].mean()
    assert last > 0.35 and last > first + 0.25, f"mean reward {first:.3f} -> {last:.3f}: PPO did not learn"
    # The critic trained too: its values moved off the zero-initialised head towards the rewards.
    assert metrics[0]["critic_value_mean"] == 0.0 and metrics[-1]["critic_value_mean"] > 0.1
    _, state, _ = load_latest_valid(tmp_path)
    assert set(state["critic"]["weights"]) >= {"head.weight", "head.bias"}
    assert set(state["weights"]).isdisjoint({"head.weight", "head.bias"})  # the policy alone is the synced model


def test_ppo_sigusr1_then_resume_matches_an_uninterrupted_run(tmp_path):
    steps = [*PPO, "algorithm.steps=30", "checkpoint.every_steps=5", "algorithm.lr=0.01"]
    whole = tmp_path / "whole"
    _, res = run_loop(whole, steps)
    assert res.returncode == 0, res.stderr[-4000:]

    run_dir = tmp_path / "cut"
    cfg = write_config(run_dir, [*TINY, *steps])
    proc = start_loop(cfg, run_dir)
    try:
        _wait_for_steps(proc, run_dir, 10)
        proc.send_signal(signal.SIGUSR1)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 75, err[-4000:]
    stopped_at = list_checkpoints(run_dir)[-1].step
    assert 10 <= stopped_at < 30

    res = mpirun(node_blocks(cfg, [*ENTRY, str(run_dir)]), timeout=240)
    assert res.returncode == 0, res.stderr[-4000:]
    assert f"after step {stopped_at}" in res.stderr
    assert final_digest(run_dir) == final_digest(whole)
    _, cut, _ = load_latest_valid(run_dir)
    _, ref, _ = load_latest_valid(whole)
    for name, w in ref["critic"]["weights"].items():  # the critic resumed bitwise as well
        assert np.array_equal(cut["critic"]["weights"][name], w), name
    cut_m, ref_m = read_metrics(run_dir / "trajectories.h5"), read_metrics(whole / "trajectories.h5")
    assert [m["critic_loss"] for m in cut_m] == [m["critic_loss"] for m in ref_m]


def test_ppo_with_a_sharded_backend_is_a_clear_error(tmp_path):
    _, res = run_loop(tmp_path, [*PPO, "algorithm.steps=1", "trainer.backend=deepspeed"], timeout=120)
    assert res.returncode == 2, res.stderr[-4000:]
    assert "trainer.backend 'deepspeed' does not support yet" in res.stderr
    assert "Traceback" not in res.stderr
