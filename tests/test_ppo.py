"""PPO through the whole RL loop (real mpirun ranks, exchange, weight sync, HDF5 checkpoints):
the critic learns beside the policy, and it is checkpointed and resumed bitwise, on the torch
backend and on DeepSpeed ZeRO (a second engine for the critic, one checkpoint shard per rank)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys

import numpy as np
import torch
from mpi_progs.launch import mpirun, node_blocks, write_config
from test_loop import ENTRY, TINY, _wait_for_steps, final_digest, run_loop, start_loop

from rollout_hpc.store.checkpoint import list_checkpoints, load_checkpoint, load_latest_valid, weights_digest
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


def _shards(info, n):
    return [load_checkpoint(info, shard)[1] for shard in range(n)]


def _optimizer_lr(state) -> float:
    """The learning rate a DeepSpeed shard's engine ran with."""
    return float(state["optimizer"]["lr"])


def _same_optimizer_share(got, ref) -> bool:
    """Two DeepSpeed shards hold bitwise-equal optimizer entries (fp32 master values, AdamW moments, step)."""
    a, b = got["optimizer"], ref["optimizer"]
    return (
        torch.equal(a["step"], b["step"])
        and sorted(a["params"]) == sorted(b["params"])
        and all(torch.equal(a["params"][n][k], v) for n, e in b["params"].items() for k, v in e.items())
    )


def test_ppo_on_deepspeed_zero3_trains_the_critic_and_resumes_it_exactly(tmp_path):
    # Two trainer ranks, ZeRO-3: policy and critic are two engines with partitioned parameters and optimizer states.
    run = [
        *PPO,
        "trainer.backend=deepspeed",
        "trainer.zero_stage=3",
        "trainer.tasks_per_node=2",
        "algorithm.steps=4",
        "checkpoint.every_steps=2",
        "algorithm.lr=0.01",
        "algorithm.critic_lr=0.005",
        "algorithm.value_clip=0.5",
        # 128 samples a step: the critic learns only from rewards that are not all 0 (a random model answers right
        # about once in 90 samples)
        "algorithm.prompts_per_step=16",
        "algorithm.group_size=8",
    ]
    whole = tmp_path / "whole"
    _, res = run_loop(whole, run, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    infos = list_checkpoints(whole)
    assert [(i.step, i.sharded) for i in infos] == [(2, True), (4, True)]
    mid, end = _shards(infos[0], 2), _shards(infos[1], 2)

    # Each rank's shard holds its own critic shard next to its policy shard.
    for rank, shard in enumerate(end):
        for part in (shard, shard["critic"]):
            assert int(part["n_ranks"]) == 2 and int(part["zero_stage"]) == 3 and int(part["steps_done"]) == 4
        assert ("weights" in shard["critic"]) == (rank == 0)  # full weights once, in shard 0
        assert _optimizer_lr(shard) == 0.01 and _optimizer_lr(shard["critic"]) == 0.005  # critic_lr reached its engine
    assert set(end[0]["critic"]["optimizer"]["params"]).isdisjoint(end[1]["critic"]["optimizer"]["params"])  # spread

    # The critic trained: its zero-initialised head moved, its weights changed between checkpoints, its values too.
    critic_mid, critic_end = mid[0]["critic"]["weights"], end[0]["critic"]["weights"]
    assert np.abs(critic_end["head.weight"]).max() > 0
    assert weights_digest(critic_mid) != weights_digest(critic_end)
    assert set(end[0]["weights"]).isdisjoint({"head.weight", "head.bias"})  # the policy alone is the synced model
    metrics = read_metrics(whole / "trajectories.h5")
    assert metrics[0]["critic_value_mean"] == 0.0 and any(m["critic_value_mean"] != 0.0 for m in metrics[1:])

    # A crash after step 2's checkpoint: the run resumes from it and ends exactly where the uninterrupted one did.
    cut = tmp_path / "cut"
    shutil.copytree(whole, cut)
    shutil.rmtree(cut / infos[1].path.relative_to(whole))
    res = mpirun(node_blocks(write_config(cut, [*TINY, *run]), [*ENTRY, str(cut)]), timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert "after step 2" in res.stderr
    resumed = _shards(list_checkpoints(cut)[-1], 2)
    assert weights_digest(resumed[0]) == weights_digest(end[0])  # policy
    for name, w in critic_end.items():
        assert np.array_equal(resumed[0]["critic"]["weights"][name], w), name
    for got, ref in zip(resumed, end):  # every rank's optimizer share, policy's and critic's
        assert _same_optimizer_share(got, ref) and _same_optimizer_share(got["critic"], ref["critic"])
    got_m = read_metrics(cut / "trajectories.h5")
    assert [m["critic_loss"] for m in got_m] == [m["critic_loss"] for m in metrics]


def test_ppo_with_megatron_is_refused_by_validate(tmp_path):
    # Megatron's GPT model has no value head here: the config says so before anything is submitted.
    write_config(tmp_path, [*PPO])
    config = tmp_path / "config.resolved.yaml"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollout_hpc",
            "validate",
            config,
            "--set",
            "algorithm.name=ppo",
            "--set",
            "trainer.backend=megatron",
            "--set",
            "trainer.gpus_per_task=1",
            "--set",
            "slurm.gpus_per_node=1",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "algorithm.name 'ppo' needs a critic, which trainer.backend 'megatron' does not have" in done.stderr
    assert "Traceback" not in done.stderr
