"""The HDF5 trajectory log on real files: round trip, SWMR reading while another process writes,
a SIGKILLed writer, reconciliation on reopen, and clear errors for files that are not logs."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import h5py
import numpy as np
import pytest
from synthetic_trajectories import synthetic_batch

from rollout_hpc.store.h5recover import consistency_flags
from rollout_hpc.store.trajlog import TrajectoryLog, TrajectoryLogError, TrajectoryReader, read_metrics
from rollout_hpc.trajectory import TrajectoryBatch

META = {"run_name": "t", "group_size": 4, "max_new_tokens": 16}


def _batches(seed: int, steps: int, per_step: int) -> list[TrajectoryBatch]:
    rng = np.random.default_rng(seed)
    return [synthetic_batch(rng, per_step, s, multi_turn=True) for s in range(steps)]


def _write_steps(path, batches: list[TrajectoryBatch]) -> None:
    """A cleanly closed log holding one step per batch."""
    with TrajectoryLog.open_for_append(path, META) as log:
        for step, b in enumerate(batches):
            log.append(b, step)
            log.append_metrics(step, {})


def _assert_batches_equal(a: TrajectoryBatch, b: TrajectoryBatch) -> None:
    for name in ("fixed", "prompt_ids", "response_ids", "logprobs", "loss_mask", "turn_starts"):
        assert getattr(a, name).tobytes() == getattr(b, name).tobytes(), name


def test_round_trip_and_metrics(tmp_path):
    batches = _batches(0, 6, 10)
    with TrajectoryLog.open_for_append(tmp_path, META) as log:
        for step, batch in enumerate(batches):
            log.append(batch, step, policy_version=step + 1)
            extra = {"kl": 0.5 * step} if step < 4 else {"kl": 0.5 * step, "grad_norm": 2.0}
            log.append_metrics(step, extra)
        rows = read_metrics(tmp_path)  # the writing process can read its own log
        assert (
            [r["step"] for r in rows] == list(range(6)) and "grad_norm" not in rows[0] and rows[5]["grad_norm"] == 2.0
        )
    with TrajectoryReader(tmp_path) as r:
        everything = TrajectoryBatch.concat(batches)
        assert r.rows == 60 and r.closed_cleanly and r.cut_rows == 0
        assert r.n_tokens == everything.n_tokens
        _assert_batches_equal(r.batch(slice(None)), everything)
        _assert_batches_equal(r.batch([3, 17, 59]), everything.select([3, 17, 59]))
        assert np.array_equal(r.column("step"), np.repeat(np.arange(6), 10))
        assert np.array_equal(r.column("staleness"), np.ones(60))
        chunks = list(r.iter_chunks(rows=25, columns=["reward"]))
        assert [len(c["reward"]) for c in chunks] == [25, 25, 10]
        assert np.array_equal(np.concatenate([c["reward"] for c in chunks]), everything.fixed["reward"])
        m = r.metrics()
        assert np.array_equal(m["step"], np.arange(6)) and np.array_equal(m["kl"], 0.5 * np.arange(6))
        assert np.isnan(m["grad_norm"][:4]).all() and (m["grad_norm"][4:] == 2.0).all()
        expect = [b.fixed["reward"].astype(np.float64).mean() for b in batches]
        assert np.allclose(m["reward_mean"], expect) and np.array_equal(m["samples"], np.full(6, 10))
        assert r.meta["group_size"] == 4 and r.meta["max_new_tokens"] == 16


_WRITER = (
    f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})  # synthetic_trajectories\n"
    + textwrap.dedent("""
    import sys, numpy as np
    from synthetic_trajectories import synthetic_batch
    from rollout_hpc.store.trajlog import TrajectoryLog
    path, mode, steps, per_step = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    rng = np.random.default_rng(0)
    log = TrajectoryLog.open_for_append(path, {"run_name": "t", "group_size": 4, "max_new_tokens": 16})
    for step in range(steps):
        log.append(synthetic_batch(rng, per_step, step, multi_turn=True), step)
        log.append_metrics(step, {"kl": step})
        print(step, flush=True)
        if mode == "lockstep":
            sys.stdin.readline()
    if mode == "die":  # appended and partly written to the file, never flushed
        log.buffer_rows = 1
        for step in range(steps, steps + 3):
            log.append(synthetic_batch(rng, per_step, step, multi_turn=True), step)
        print("unflushed", flush=True)
        sys.stdin.readline()
    log.close()
""")
)


def _writer(tmp_path, mode, steps, per_step):
    return subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path), mode, str(steps), str(per_step)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def test_reader_in_another_process_follows_the_writer(tmp_path):
    expected = _batches(0, 5, 40)
    proc = _writer(tmp_path, "lockstep", 5, 40)
    try:
        assert proc.stdout.readline().strip() == "0"
        reader = TrajectoryReader(tmp_path)  # opened while the writer holds the file in SWMR mode
        for step in range(5):
            if step:
                assert proc.stdout.readline().strip() == str(step)
            reader.refresh()
            assert reader.rows == 40 * (step + 1) and reader.metric_rows == step + 1
            assert not reader.closed_cleanly
            _assert_batches_equal(reader.batch(slice(None)), TrajectoryBatch.concat(expected[: step + 1]))
            assert np.array_equal(reader.metrics()["kl"], np.arange(step + 1))
            proc.stdin.write("\n")
            proc.stdin.flush()
        assert proc.wait(timeout=60) == 0
        reader.refresh()
        assert reader.closed_cleanly and reader.rows == 200
        reader.close()
    finally:
        proc.kill()


def test_killed_writer_loses_at_most_the_unflushed_part(tmp_path):
    expected = _batches(0, 4, 300)
    proc = _writer(tmp_path, "die", 4, 300)
    for step in range(4):
        assert proc.stdout.readline().strip() == str(step)
    assert proc.stdout.readline().strip() == "unflushed"
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    path = tmp_path / "trajectories.h5"
    assert consistency_flags(path) != 0  # HDF5 still believes a writer has it open

    with TrajectoryReader(tmp_path) as r:
        assert r.rows == 1200 and r.metric_rows == 4
        assert "killed" in r.status_line()  # rows the killed writer never committed are not counted
        _assert_batches_equal(r.batch(slice(None)), TrajectoryBatch.concat(expected))

    with TrajectoryLog.open_for_append(tmp_path) as log:  # reconciles, then continues
        assert log.reconciled["writer_killed"] and log.reconciled["rows_kept"] == 1200
        assert log.reconciled["rows_dropped"] == r.cut_rows  # whatever reached the file uncommitted
        extra = synthetic_batch(np.random.default_rng(7), 5, 4)
        log.append(extra, 4)
        log.append_metrics(4, {})
    with TrajectoryReader(tmp_path) as r:
        assert r.rows == 1205 and r.closed_cleanly and r.cut_rows == 0
        _assert_batches_equal(r.batch(slice(None)), TrajectoryBatch.concat(expected + [extra]))


def test_reopen_truncates_unequal_datasets_and_replayed_steps(tmp_path):
    batches = _batches(1, 5, 8)
    _write_steps(tmp_path, batches)
    with h5py.File(tmp_path / "trajectories.h5", "r+", libver="latest") as f:  # a crash mid-append
        for name in ("reward", "response_ids", "response_offsets"):
            f["traj"][name].resize((f["traj"][name].shape[0] + 3,))
    with TrajectoryReader(tmp_path) as r:
        assert r.rows == 40 and r.cut_rows == 3
    with TrajectoryLog.open_for_append(tmp_path, resume_step=2) as log:
        assert log.reconciled["rows_dropped"] == 3 and log.reconciled["rows_after_resume_step"] == 16
    with TrajectoryReader(tmp_path) as r:
        assert r.rows == 24 and r.metric_rows == 3 and r.cut_rows == 0
        _assert_batches_equal(r.batch(slice(None)), TrajectoryBatch.concat(batches[:3]))
    with h5py.File(tmp_path / "trajectories.h5", "r") as f:  # every dataset truncated, not just hidden
        assert {f["traj"][n].shape[0] for n in ("reward", "step", "prompt_len")} == {24}
        assert f["traj"]["response_ids"].shape[0] == int(f["traj"]["response_offsets"][-1])


def test_flat_array_cut_mid_row_drops_that_row(tmp_path):
    batches = _batches(2, 5, 8)
    _write_steps(tmp_path, batches)
    with h5py.File(tmp_path / "trajectories.h5", "r+", libver="latest") as f:  # lost tail of a flat array
        cut = int(f["traj"]["response_offsets"][30]) + 1
        f["traj"]["logprobs"].resize((cut,))
    with TrajectoryReader(tmp_path) as r:
        assert r.rows == 30
        _assert_batches_equal(r.batch(slice(None)), TrajectoryBatch.concat(batches).select(np.arange(30)))
    with TrajectoryLog.open_for_append(tmp_path) as log:
        assert log.reconciled["rows_kept"] == 30 and log.rows == 30


def test_one_writer_at_a_time(tmp_path):
    with TrajectoryLog.open_for_append(tmp_path, META):
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                f"from rollout_hpc.store.trajlog import TrajectoryLog; TrajectoryLog.open_for_append({str(tmp_path)!r})",
            ],
            capture_output=True,
            text=True,
        )
        assert proc.returncode != 0 and "being written by another process" in proc.stderr


def test_not_a_log_errors_say_why(tmp_path):
    text = tmp_path / "notes.h5"
    text.write_text("hello")
    with pytest.raises(TrajectoryLogError, match="not an HDF5 file"):
        TrajectoryReader(text)
    other = tmp_path / "other.h5"
    with h5py.File(other, "w", libver="latest") as f:
        f["x"] = 1
    with pytest.raises(TrajectoryLogError, match="not a rollout-hpc trajectory log"):
        TrajectoryReader(other)
    with pytest.raises(TrajectoryLogError, match="no trajectory log here"):
        TrajectoryReader(tmp_path / "missing")
    with TrajectoryLog.open_for_append(tmp_path / "future.h5", META):
        pass
    with h5py.File(tmp_path / "future.h5", "r+") as f:
        f.attrs["layout_version"] = 99
    with pytest.raises(TrajectoryLogError, match="layout version 99.*reads version 1"):
        TrajectoryReader(tmp_path / "future.h5")


_MONITOR = textwrap.dedent("""
    import sys
    from rollout_hpc.store.trajlog import TrajectoryReader
    r = TrajectoryReader(sys.argv[1])
    print(r.rows, flush=True)
    sys.stdin.readline()
    r.refresh()
    print(r.rows, flush=True)
""")


def test_open_reader_does_not_block_a_restarted_writer(tmp_path):
    first, second = _batches(3, 2, 10)
    with TrajectoryLog.open_for_append(tmp_path, META) as log:
        log.append(first, 0)
        log.append_metrics(0, {})
    monitor = subprocess.Popen(
        [sys.executable, "-c", _MONITOR, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert monitor.stdout.readline().strip() == "10"
        with TrajectoryLog.open_for_append(tmp_path) as log:  # the next allocation's writer
            log.append(second, 1)
            log.append_metrics(1, {})
            monitor.stdin.write("\n")
            monitor.stdin.flush()
            assert monitor.stdout.readline().strip() == "20"
    finally:
        monitor.kill()


def test_old_log_without_turn_rewards_or_episode_fields(tmp_path):
    """A log written before layout 3 (no /traj/turn_rewards, no episode columns) reads them as zeros, and a writer
    appending to it creates them (zeros for the rows before)."""
    path = tmp_path / "trajectories.h5"
    rng = np.random.default_rng(0)
    with TrajectoryLog.open_for_append(path, {"run_name": "old"}) as log:
        for step in range(2):
            log.append(synthetic_batch(rng, 8, step, multi_turn=True), step)
    with h5py.File(path, "r+") as f:
        for name in ("turn_rewards", "episode_status", "success"):
            del f[f"traj/{name}"]
    with TrajectoryReader(path) as r:
        old = r.batch(slice(0, r.rows))
        assert len(old.turn_rewards) == old.fixed["n_turns"].sum() and not old.turn_rewards.any()
        offsets, values = r.ragged_chunk("turn_rewards", 0, 8)
        assert offsets[-1] == len(values) and not values.any()
    new = synthetic_batch(rng, 8, 2, multi_turn=True)
    with TrajectoryLog.open_for_append(path) as log:
        assert set(log.reconciled["upgraded"]) >= {"/traj/turn_rewards", "/traj/episode_status", "/traj/success"}
        log.append(new, 2)
    with TrajectoryReader(path) as r:
        assert r.rows == 24
        both = r.batch(slice(0, 24))
        assert np.array_equal(both.select(np.arange(16, 24)).turn_rewards, new.turn_rewards)
        assert not both.select(np.arange(16)).turn_rewards.any()
