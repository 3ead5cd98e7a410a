"""Resuming a DeepSpeed ZeRO run on a different number of trainer ranks or another ZeRO stage (real
mpirun ranks, the whole RL loop, HDF5 checkpoints). A checkpoint written by ZeRO-2 over 2 ranks is
resumed over 1 and 3 ranks and under ZeRO-1/ZeRO-3: right after the load, the trainer's optimizer
state (fp32 master values, AdamW moments and step) and weights are exactly the saved ones, and the run
goes on to its last step with every sample trained once. The run is PPO, so the critic (a second
DeepSpeed engine, nested under "critic" in every shard) is resharded by the same rule."""

from __future__ import annotations

import shutil

import h5py
import numpy as np
import pytest
import torch
from mpi_progs.launch import PROGS, mpirun, node_blocks, write_config
from test_loop import TINY, columns, run_loop

from rollout_hpc.store.checkpoint import list_checkpoints, load_checkpoint

STEPS, P, G = 3, 8, 4
RUN = [
    "algorithm.name=ppo",
    "trainer.backend=deepspeed",
    f"algorithm.steps={STEPS}",
    "checkpoint.every_steps=2",
    "algorithm.lr=0.01",
    "run.seed=0",
]


@pytest.fixture(scope="module")
def zero2_over_2(tmp_path_factory):
    """A ZeRO-2 run over 2 trainer ranks with checkpoints after steps 2 and 3."""
    run_dir = tmp_path_factory.mktemp("zero2x2")
    _, res = run_loop(run_dir, [*RUN, "trainer.zero_stage=2", "trainer.tasks_per_node=2"], timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert [(i.step, i.sharded) for i in list_checkpoints(run_dir)] == [(2, True), (3, True)]
    return run_dir


def consolidated(info, part=None) -> dict:
    """A sharded DeepSpeed checkpoint as one layout-free state: weights, per-parameter optimizer entries, step
    (of the policy, or of the engine under `part`: "critic")."""
    n = load_checkpoint(info, 0)[2]["n_shards"]
    shards = [load_checkpoint(info, s)[1] for s in range(n)]
    shards = [s[part] for s in shards] if part else shards
    params = {}
    for shard in shards:
        assert not set(params) & set(shard["optimizer"]["params"]), "a parameter in two shards"
        params.update(shard["optimizer"]["params"])
    steps = {float(s["optimizer"]["step"]) for s in shards}
    assert len(steps) == 1
    return {
        "weights": shards[0]["weights"],
        "params": params,
        "adam_step": steps.pop(),
        "steps_done": {int(s["steps_done"]) for s in shards},
        "n_shards": len(shards),
    }


def assert_same(got: dict, ref: dict) -> None:
    assert got["adam_step"] == ref["adam_step"] and got["steps_done"] == ref["steps_done"]
    assert sorted(got["weights"]) == sorted(ref["weights"])
    for name, w in ref["weights"].items():
        assert np.array_equal(got["weights"][name], w), name
    assert sorted(got["params"]) == sorted(ref["params"])
    for name, entry in ref["params"].items():
        assert sorted(entry) == ["exp_avg", "exp_avg_sq", "fp32"]
        for key, value in entry.items():
            assert torch.equal(got["params"][name][key], value), (name, key)


def assert_each_sample_once(run_dir) -> None:
    step, prompt, sample = columns(run_dir, "step", "prompt_id", "sample_idx")
    rows = list(zip(step.tolist(), prompt.tolist(), sample.tolist()))
    assert len(rows) == len(set(rows)), "a sample is logged twice"
    assert sorted(rows) == [(p // P, p, k) for p in range(STEPS * P) for k in range(G)]


def flip_a_byte(shard_file) -> None:
    with h5py.File(shard_file, "r") as f:
        offset = f["state/tree/optimizer/params"].visititems(
            lambda _, obj: obj.id.get_offset() if isinstance(obj, h5py.Dataset) and obj.size > 8 else None
        )
    with open(shard_file, "r+b") as f:
        f.seek(offset + 5)
        byte = f.read(1)[0]
        f.seek(offset + 5)
        f.write(bytes([byte ^ 0x10]))


# ZeRO-1 over 3 ranks also meets a damaged newest checkpoint: its shard 1 (read by rank 1 only) fails
# verification, so every rank falls back to step 2 together.
@pytest.mark.parametrize(
    "stage, ranks", [(2, 1), (1, 3), (3, 2)], ids=["zero2-1rank", "zero1-3ranks-damaged", "zero3-2ranks"]
)
def test_resume_a_zero2_checkpoint_on_another_layout(tmp_path, zero2_over_2, stage, ranks):
    run_dir = tmp_path / "run"
    shutil.copytree(zero2_over_2, run_dir)
    saved = list_checkpoints(run_dir)
    damaged = stage == 1
    if damaged:
        flip_a_byte(saved[-1].path / "shard-00001-of-00002.h5")
    else:
        shutil.rmtree(saved[-1].path)  # as if the first allocation ended after step 2's checkpoint
    cfg = write_config(run_dir, [*TINY, *RUN, f"trainer.zero_stage={stage}", f"trainer.tasks_per_node={ranks}"])
    record = tmp_path / "after-load"
    res = mpirun(node_blocks(cfg, [str(PROGS / "resume_and_record.py"), str(run_dir), str(record)]), timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert "after step 2" in res.stderr
    warnings = [line for line in res.stderr.splitlines() if "skipping damaged checkpoint" in line]
    assert len(warnings) == damaged
    if damaged:
        assert "shard-00001-of-00002.h5: content checksum mismatch" in warnings[0] and "step-00000002" in warnings[0]
    assert f"resharded the DeepSpeed state: ZeRO-2 over 2 rank(s) -> ZeRO-{stage} over {ranks} rank(s)" in res.stderr

    # Right after the load the trainer held exactly the saved state (saved again in the new layout).
    for part in (None, "critic"):
        loaded = consolidated(list_checkpoints(record)[-1], part)
        assert loaded["n_shards"] == ranks
        assert_same(loaded, consolidated(saved[0], part))

    # ... and the run went on to its last step, every sample of the stream trained exactly once.
    assert [i.step for i in list_checkpoints(run_dir)] == [2, 3]
    assert consolidated(list_checkpoints(run_dir)[-1])["n_shards"] == ranks
    assert_each_sample_once(run_dir)
