"""HDF5 checkpoints on real files: bitwise round trips, crash-safe saves, damaged-file fallback, config checks."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from synthetic_trajectories import synthetic_batch

from rollout_hpc.config import load_config
from rollout_hpc.store.checkpoint import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointPolicy,
    ConfigMismatch,
    check_compatible,
    commit_shards,
    config_meta,
    list_checkpoints,
    load_latest_valid,
    read_checkpoint_meta,
    save_checkpoint,
    save_shard,
    weights_digest,
)
from rollout_hpc.store.h5tree import StateTypeError
from rollout_hpc.store.rng import capture_rng_state, restore_rng_state
from rollout_hpc.trajectory import TrajectoryBatch


def _trained_state(seed: int, dtype=torch.float32) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    for _ in range(3):
        model(torch.randn(5, 8, dtype=dtype)).square().mean().backward()
        opt.step()
        sched.step()
    pending = synthetic_batch(np.random.default_rng(seed), 6, 3).pack()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": {0: capture_rng_state()},
        "step": 3,
        "data_cursor": {"epoch": 1, "index": 2**70, "order": np.arange(5, dtype=np.int64)},
        "pending": bytes(pending),
        "config_yaml": "model:\n  hidden_size: 8\n",
        "tags": ["a", ("b", 1.5), None, True],
        "odd/key": {"": 1, ".": 2, "%": np.float16(0.5)},
    }


def _assert_same(a, b, path="state"):
    """Equal structure, types and bytes (an OrderedDict state_dict comes back as a plain dict)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}/{k}")
        return
    assert type(a) is type(b), f"{path}: {type(a)} vs {type(b)}"
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}/{i}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), path
    elif isinstance(a, (np.ndarray, np.generic)):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), path
    else:
        assert a == b, path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bitwise(tmp_path, dtype):
    state = _trained_state(0, dtype)
    state["fp8"] = torch.randn(7).to(torch.float8_e4m3fn)
    save_checkpoint(tmp_path, 3, state, {"policy_version": 3})
    path, loaded, meta = load_latest_valid(tmp_path)
    _assert_same(state, loaded)
    assert meta["policy_version"] == 3 and meta["step"] == 3 and "torch" in meta["libraries"]
    assert weights_digest(loaded) == weights_digest(state)
    assert read_checkpoint_meta(path)["content_checksum"] == meta["content_checksum"]
    # what a resumed trainer does with it
    TrajectoryBatch.unpack(loaded["pending"])
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(dtype)
    model.load_state_dict(loaded["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.load_state_dict(loaded["optimizer"])


def test_weights_digest_tells_runs_apart(tmp_path):
    assert weights_digest(_trained_state(0)) == weights_digest(_trained_state(0))
    assert weights_digest(_trained_state(0)) != weights_digest(_trained_state(1))


def test_rng_state_round_trip_reproduces_draws(tmp_path):
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    save_checkpoint(tmp_path, 1, {"rng": capture_rng_state()})
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    restore_rng_state(load_latest_valid(tmp_path)[1]["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_unsupported_value_names_its_path(tmp_path):
    with pytest.raises(StateTypeError, match=r"/optimizer/hook: a function"):
        save_checkpoint(tmp_path, 1, {"optimizer": {"hook": lambda: 0}})
    assert list_checkpoints(tmp_path) == []
    assert not any(tmp_path.joinpath("checkpoints").iterdir())  # no temp file left behind


def test_unstorable_tensor_and_bad_meta_are_named(tmp_path):
    q = torch.empty(4, device="meta")  # e.g. a lazily initialised model that was never materialised
    with pytest.raises(StateTypeError, match=r"/model/q: a torch.float32 tensor on meta cannot be saved"):
        save_checkpoint(tmp_path, 1, {"model": {"q": q}})
    with pytest.raises(CheckpointError, match="JSON-serializable.*object"):
        save_checkpoint(tmp_path, 1, {"x": 1}, {"policy_version": object()})
    save_checkpoint(tmp_path, 2, {"x": 1}, {"policy_version": np.int64(2)})  # numpy scalars are fine
    assert load_latest_valid(tmp_path)[2]["policy_version"] == 2


def test_keep_last_k(tmp_path):
    for step in range(0, 60, 10):
        save_checkpoint(tmp_path, step, {"x": np.full(3, step)}, keep_last=3)
    assert [c.step for c in list_checkpoints(tmp_path)] == [30, 40, 50]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step-00000030.h5",
        "step-00000040.h5",
        "step-00000050.h5",
    ]


def _data_offset(path: Path, dataset: str) -> int:
    with h5py.File(path, "r") as f:
        return f[dataset].id.get_offset()


def test_truncated_newest_falls_back_with_one_line(tmp_path, caplog):
    save_checkpoint(tmp_path, 10, _trained_state(0))
    newest = save_checkpoint(tmp_path, 20, _trained_state(1))
    os.truncate(newest, newest.stat().st_size // 2)
    with caplog.at_level(logging.WARNING, logger="rollout_hpc.store.checkpoint"):
        path, state, meta = load_latest_valid(tmp_path)
    assert path.name == "step-00000010.h5" and meta["step"] == 10
    assert weights_digest(state) == weights_digest(_trained_state(0))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "step-00000020.h5" in lines[0] and "step-00000010.h5" in lines[0]


@pytest.mark.parametrize("dataset", ["model/0.weight", "big"])  # read through h5py / with preadv
def test_bit_flip_in_weights_is_caught(tmp_path, caplog, dataset):
    save_checkpoint(tmp_path, 10, _trained_state(0))
    newest = save_checkpoint(tmp_path, 20, {**_trained_state(1), "big": torch.randn(1 << 19)})
    offset = _data_offset(newest, f"state/tree/{dataset}") + 37
    with open(newest, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))
    with caplog.at_level(logging.WARNING, logger="rollout_hpc.store.checkpoint"):
        path, _, _ = load_latest_valid(tmp_path)
    assert path.name == "step-00000010.h5"
    assert len(caplog.records) == 1 and "checksum mismatch" in caplog.records[0].getMessage()


def test_all_damaged_is_a_clear_error_and_none_is_none(tmp_path):
    assert load_latest_valid(tmp_path) is None
    newest = save_checkpoint(tmp_path, 1, {"x": np.arange(1000)})
    newest.write_bytes(b"not hdf5 at all")
    with pytest.raises(CheckpointCorrupt, match="every checkpoint .* is damaged"):
        load_latest_valid(tmp_path)


_SAVER = textwrap.dedent("""
    import sys, numpy as np
    from rollout_hpc.store.checkpoint import save_checkpoint
    state = {"weights": {f"w{i}": np.full(4 << 20, i, np.float32) for i in range(48)}}  # 768 MB
    print("saving", flush=True)
    save_checkpoint(sys.argv[1], 20, state)
    print("finished", flush=True)
""")


def test_crash_mid_save_leaves_previous_checkpoint(tmp_path):
    save_checkpoint(tmp_path, 10, {"weights": {"w0": np.ones(4, np.float32)}})
    proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "saving"
    tmp_files: list[Path] = []
    while proc.poll() is None:  # kill once the temp file holds some data, i.e. mid-save
        tmp_files = list((tmp_path / "checkpoints").glob("*.tmp-*"))
        if tmp_files and tmp_files[0].stat().st_size > (64 << 20):
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the saver finished before it could be killed"
    assert tmp_files, "no temp file seen"
    assert [c.step for c in list_checkpoints(tmp_path)] == [10]
    path, state, _ = load_latest_valid(tmp_path)
    assert path.name == "step-00000010.h5"
    save_checkpoint(tmp_path, 30, state)  # the next save clears the crashed one's leftovers
    assert not list((tmp_path / "checkpoints").glob("*.tmp-*"))


def test_config_mismatch_refused_unless_forced():
    saved = config_meta(load_config(None))
    assert check_compatible(saved, load_config(None)) == []
    with pytest.raises(ConfigMismatch, match=r"algorithm\.lr: 0\.001 -> 0\.01.*model\.hidden_size: 64 -> 32.*--force"):
        check_compatible(saved, load_config(None, ["algorithm.lr=0.01", "model.hidden_size=32"]))
    diffs = check_compatible(saved, load_config(None, ["algorithm.lr=0.01"]), force=True)
    assert diffs == ["algorithm.lr: 0.001 -> 0.01"]
    # allocation-level changes and a longer run are fine
    assert check_compatible(saved, load_config(None, ["slurm.time=01:00:00", "algorithm.steps=100"])) == [
        "algorithm.steps: 30 -> 100",
        "slurm.time: '00:30:00' -> '01:00:00'",
    ]
    # digest-only comparison: refused without naming keys it cannot know
    with pytest.raises(ConfigMismatch, match="digest"):
        check_compatible({"config_digest": saved["config_digest"]}, load_config(None, ["run.seed=1"]).digest())
    # resolved config stored as YAML text also works
    text_meta = {"config": "model: {hidden_size: 64}\nalgorithm: {lr: 0.001}\n"}
    with pytest.raises(ConfigMismatch, match="algorithm.lr"):
        check_compatible(text_meta, {"model": {"hidden_size": 64}, "algorithm": {"lr": 0.5}})


def test_sharded_checkpoint_requires_every_shard(tmp_path, caplog):
    for step in (10, 20):
        entries = [
            save_shard(tmp_path, step, r, 3, {"weights": {"w": torch.full((4,), float(step + r))}}) for r in range(3)
        ]
        assert [c.step for c in list_checkpoints(tmp_path)] == ([10] if step == 20 else [])
        commit_shards(tmp_path, step, entries, {"policy_version": step})
    path, state, meta = load_latest_valid(tmp_path, shard=1)
    assert meta["step"] == 20 and meta["shard"] == 1 and state["weights"]["w"][0].item() == 21.0
    with pytest.raises(CheckpointError, match="shard="):
        load_latest_valid(tmp_path)
    (tmp_path / "checkpoints" / "step-00000020" / "shard-00002-of-00003.h5").unlink()
    with caplog.at_level(logging.WARNING):
        path, state, meta = load_latest_valid(tmp_path, shard=1)
    assert meta["step"] == 10 and "shard-00002-of-00003.h5 is missing" in caplog.records[0].getMessage()
    # a step whose manifest was never written (crash between shards and manifest) is invisible
    save_shard(tmp_path, 30, 0, 3, {"weights": {"w": torch.zeros(4)}})
    assert [c.step for c in list_checkpoints(tmp_path)] == [10, 20]


def test_policy_due_by_steps_and_minutes():
    policy = CheckpointPolicy(every_steps=10, every_minutes=0, last_saved=0.0)
    assert [s for s in range(0, 35) if policy.due(s, now=1.0)] == [10, 20, 30]
    timed = CheckpointPolicy(every_steps=0, every_minutes=2, last_saved=100.0)
    assert not timed.due(7, now=219.0) and timed.due(7, now=220.0)
    timed.mark_saved(now=220.0)
    assert not timed.due(8, now=300.0)
    assert not CheckpointPolicy(0, 0).due(10, now=1e9)
