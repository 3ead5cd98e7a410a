"""Single-process semantics of the shared-memory ring: API, wrap-around, errors, damaged segments."""

from __future__ import annotations

import os
import stat
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_hpc.exchange.ring import (
    RecordTooLarge,
    Ring,
    RingClosed,
    RingError,
    RingTimeout,
    ring_path,
)

DATA_OFFSET = 4096


@pytest.fixture
def path(tmp_path):
    return ring_path(str(tmp_path), "test-run", 42, "node0", "exp")


def test_ring_path_is_per_run_job_node_and_sanitised(tmp_path):
    a = ring_path(str(tmp_path), "run/1", 7, "n0", "exp")
    assert os.path.dirname(a) == str(tmp_path)
    assert "/" not in os.path.basename(a)[len("rollout-hpc") :]
    assert (
        len(
            {
                a,
                ring_path(str(tmp_path), "run/1", 8, "n0", "exp"),
                ring_path(str(tmp_path), "run/1", 7, "n1", "exp"),
                ring_path(str(tmp_path), "run2", 7, "n0", "exp"),
            }
        )
        == 4
    )
    assert ring_path(None, "r", 1, "n", "p").startswith("/dev/shm/")


def test_create_is_owner_only_and_exclusive(path):
    r = Ring.create(path, 1 << 16)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert os.path.getsize(path) == DATA_OFFSET + r.capacity
    with pytest.raises(RingError, match="already exists"):
        Ring.create(path, 1 << 16)
    assert Ring.open_or_create(path, 1 << 20).capacity == r.capacity  # existing one is opened
    assert not [f for f in os.listdir(os.path.dirname(path)) if f.endswith(".tmp")]


def test_open_missing_names_the_file(path):
    with pytest.raises(RingError, match=path):
        Ring.open(path)


def test_buffer_types_fifo_and_ids(path):
    r = Ring.create(path, 1 << 16)
    arr = np.arange(17, dtype=np.float64)
    items = [b"bytes", bytearray(b"bytearray"), memoryview(b"memoryview"), arr, b""]
    ids = [r.push(x) for x in items]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert r.pop() == b"bytes"
    assert r.pop() == b"bytearray"
    assert r.pop() == b"memoryview"
    assert np.array_equal(np.frombuffer(r.pop(), np.float64), arr)
    assert r.pop() == b""
    assert r.try_pop() is None
    with pytest.raises(TypeError, match="C-contiguous"):
        r.push(arr[::2])
    with pytest.raises(TypeError, match="bytes"):
        r.push("a str is not a buffer")


def test_record_too_large_and_timeouts(path):
    r = Ring.create(path, 4096)
    assert r.max_record_len == 4096 - 32
    with pytest.raises(RecordTooLarge, match="4097 bytes"):
        r.push(b"x" * 4097)
    r.push(b"y" * r.max_record_len)  # the largest record fills the ring exactly
    assert not r.try_push(b"z")
    with pytest.raises(RingTimeout, match="push.*timed out"):
        r.push(b"z", timeout=0.01)
    assert len(r.pop()) == r.max_record_len
    with pytest.raises(RingTimeout, match=path):
        r.pop(timeout=0.01)
    with pytest.raises(ValueError, match="timeout"):
        r.pop(timeout=-1)


def test_wraparound_with_mixed_sizes_keeps_content(path):
    r = Ring.create(path, 8192)
    rng = np.random.default_rng(0)
    pending = []
    for _ in range(3000):
        data = rng.integers(0, 256, int(rng.integers(0, 3000)), dtype=np.uint8).tobytes()
        while not r.try_push(data):
            assert r.pop() == pending.pop(0)
        pending.append(data)
    while pending:
        assert r.pop() == pending.pop(0)
    s = r.stats()
    assert s["records_in"] == s["records_out"] == 3000
    assert s["fill_bytes"] == 0 and 0 < s["high_water_bytes"] <= 8192


def test_batches(path):
    r = Ring.create(path, 1 << 12)
    items = [bytes([i]) * i for i in range(100)]
    # More than fits at once: push_many blocks until a consumer makes room, so drain in a thread.
    import threading

    got = []

    def drain():
        while len(got) < len(items):
            got.extend(r.pop_many(16, timeout=5))

    t = threading.Thread(target=drain)
    t.start()
    assert r.push_many(items, timeout=5) == len(items)
    t.join()
    assert got == items


def test_close_drains_then_raises(path):
    r = Ring.create(path, 1 << 12)
    r.push(b"a")
    r.push(b"b")
    r.close()
    assert r.closed and Ring.open(path).closed
    with pytest.raises(RingClosed):
        r.push(b"c")
    assert r.pop() == b"a"
    assert r.pop_many(5) == [b"b"]
    with pytest.raises(RingClosed):
        r.pop()
    with pytest.raises(RingClosed):
        r.pop(timeout=0)


def test_pop_view_is_zero_copy_and_acked_on_exit(path):
    r = Ring.create(path, 1 << 16)
    r.push(np.arange(1000, dtype=np.int32))
    with r.pop_view() as view:
        assert view.readonly
        arr = np.frombuffer(view, np.int32)
        assert arr[999] == 999
        assert not arr.flags.owndata and arr.base is not None
        s = r.stats()
        assert s["records_out"] == 0 and s["fill_bytes"] > 0  # still claimed
        total = int(arr.sum())
        del arr
    assert total == sum(range(1000))
    assert r.stats()["records_out"] == 1 and r.stats()["fill_bytes"] == 0


def test_pop_view_refuses_to_ack_while_a_numpy_array_lives(path):
    r = Ring.create(path, 1 << 16)
    r.push(b"12345678")
    kept = []
    with pytest.raises(RingError, match="still alive"):
        with r.pop_view() as view:
            kept.append(np.frombuffer(view, np.uint8))
    assert bytes(kept[0]) == b"12345678"  # memory stays valid while referenced
    kept.clear()  # last reference gone: the record is acknowledged by the garbage collector
    import gc

    gc.collect()
    assert r.stats()["records_out"] == 1


def test_pop_view_acks_when_its_block_raises_and_the_error_goes_on(path):
    r = Ring.create(path, 1 << 16)
    r.push(b"first")
    r.push(b"second")
    with pytest.raises(KeyError, match="boom"):
        with r.pop_view() as view:
            assert bytes(view) == b"first" and view.obj.id >= 0
            raise KeyError("boom")
    assert r.stats()["records_out"] == 1
    with pytest.raises(ValueError):  # the memoryview was released on exit
        bytes(view)
    assert r.pop(timeout=1) == b"second"


def test_reserve_writes_in_place_and_abandon_is_skipped(path):
    r = Ring.create(path, 1 << 16)
    with pytest.raises(ZeroDivisionError):
        with r.reserve(16) as buf:
            buf[:8] = b"partial!"
            raise ZeroDivisionError("the block fails after writing part of the record")
    with r.reserve(8) as buf:
        np.frombuffer(buf, np.int64)[0] = 123456789
    assert struct.unpack("<q", r.pop())[0] == 123456789
    assert r.try_pop() is None


def test_stats_counts_roles(path):
    r = Ring.create(path, 1 << 16)
    r.push(b"abc")
    r.pop()
    s = r.stats()
    assert (s["producers"], s["consumers"], s["attached"]) == (1, 1, 1)
    assert (s["records_in"], s["bytes_in"], s["records_out"], s["bytes_out"]) == (1, 3, 1, 3)


# ---- damaged segments ------------------------------------------------------------------


def _damage(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize(
    "offset,data,message",
    [
        (0, b"NOTARING", "bad magic"),
        (8, struct.pack("<I", 99), "layout version 99"),
        (16, struct.pack("<Q", 1 << 20), "checksum"),
        (32, b"\xff", "checksum"),
    ],
)
def test_damaged_header_is_a_clear_error(path, offset, data, message):
    Ring.create(path, 1 << 16)
    _damage(path, offset, data)
    with pytest.raises(RingError, match=message) as e:
        Ring.open(path)
    assert path in str(e.value)


def test_truncated_and_foreign_files_are_refused(path, tmp_path):
    Ring.create(path, 1 << 16)
    os.truncate(path, DATA_OFFSET + 100)
    with pytest.raises(RingError, match="truncated"):
        Ring.open(path)
    os.truncate(path, 10)
    with pytest.raises(RingError, match="shorter than"):
        Ring.open(path)
    other = tmp_path / "foreign"
    other.write_bytes(os.urandom(8192))
    with pytest.raises(RingError, match="bad magic"):
        Ring.open(other)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lens=st.lists(st.integers(min_value=0, max_value=10_000), min_size=1, max_size=20))
def test_fuzzed_record_lengths(tmp_path, lens):
    p = tmp_path / f"fuzz-{os.getpid()}-{len(lens)}-{sum(lens)}.ring"
    if p.exists():
        p.unlink()
    r = Ring.create(p, 4096)
    for n in lens:
        if n > r.max_record_len:
            with pytest.raises(RecordTooLarge):
                r.push(b"\0" * n)
        else:
            data = os.urandom(n)
            r.push(data)
            assert r.pop() == data
    r.unlink()


def _use_damaged(p, pops: int, push_len: int, pushed: list[bytes], payload_damaged: bool = False) -> None:
    """Opens, pops, pushes and reads stats on a damaged segment: a clean error is fine, a crash is not, and a record
    that comes out is one that went in: byte for byte, or (damage that landed inside a payload, which the ring does
    not checksum: the exchange's layout check catches that) at least one of the pushed lengths, never a record cut
    or stretched by a damaged header."""
    ours = b"x" * push_len
    try:
        r2 = Ring.open(p)
        for _ in range(pops):
            record = r2.try_pop()
            if record is None:
                continue
            if payload_damaged:
                assert len(record) in {len(b) for b in pushed} | {push_len}, len(record)
            else:
                assert record in pushed or record == ours, record[:16]
        r2.try_push(ours)
        r2.stats()
    except (RingError, RingTimeout):
        pass


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    where=st.sampled_from(["head", "read", "tail", "rec_pos", "rec_len", "rec_state"]),
    value=st.integers(min_value=0, max_value=2**64 - 1),
)
def test_corrupted_shared_state_gives_errors_not_crashes(tmp_path, where, value):
    p = tmp_path / "corrupt.ring"
    if p.exists():
        p.unlink()
    r = Ring.create(p, 4096)
    pushed = [bytes([i]) * 300 for i in range(5)]
    for record in pushed:
        r.push(record)
    r.pop()
    offsets = {"head": 64 + 64, "read": 64 + 128, "tail": 64 + 192}
    rec = DATA_OFFSET + 352  # second record header (records are 352 bytes here)
    if where in offsets:
        _damage(p, offsets[where], struct.pack("<Q", value))
    elif where == "rec_pos":
        _damage(p, rec, struct.pack("<Q", value))
    elif where == "rec_len":
        _damage(p, rec + 16, struct.pack("<I", value & 0xFFFFFFFF))
    else:
        _damage(p, rec + 24, struct.pack("<Q", value))
    _use_damaged(p, pops=6, push_len=100, pushed=pushed)
    r.unlink()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(offset=st.integers(min_value=0, max_value=DATA_OFFSET + 4096 - 8), junk=st.binary(min_size=1, max_size=64))
def test_random_damage_anywhere_gives_errors_not_crashes(tmp_path, offset, junk):
    p = tmp_path / "splat.ring"
    if p.exists():
        p.unlink()
    r = Ring.create(p, 4096)
    pushed = [bytes([i]) * (100 + 150 * i) for i in range(6)]
    for record in pushed:
        r.push(record)
    r.pop()
    junk = junk[: DATA_OFFSET + 4096 - offset]
    _damage(p, offset, junk)
    _use_damaged(p, pops=8, push_len=700, pushed=pushed, payload_damaged=offset + len(junk) > DATA_OFFSET)
    r.unlink()
