"""The node-local shared-memory ring (Rust, `rollout_hpc._ring`) behind a small Python face.

A `Ring` is a file in /dev/shm (owner-only) holding a crash-tolerant multi-producer
multi-consumer queue of variable-length records. Any number of processes open it by path.

    ring = Ring.create(ring_path("/dev/shm", "run1", job_id, node, "exp"), 256 << 20)
    ring.push(batch_bytes)                 # bytes, bytearray, memoryview, numpy: no extra copy
    data = ring.pop(timeout=1.0)           # bytes (copied out, acknowledged at once)
    with ring.pop_view() as view:          # zero-copy memoryview into shared memory
        arr = np.frombuffer(view, np.int32).copy()
    with ring.reserve(n) as buf:           # write a record in place, committed on exit
        batch.pack_into(buf)

Delivery is at-least-once: a record claimed by `pop_view` whose process dies before the
block ends is handed to another consumer. `pop`/`pop_many` acknowledge before returning,
so each of their records is delivered once unless the process dies inside the call.
Design and measurements: docs/ring.md.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING

from rollout_hpc import _ring
from rollout_hpc._ring import RecordTooLarge, RingClosed, RingError, RingTimeout

if TYPE_CHECKING:
    from rollout_hpc._ring import _Stats

__all__ = ["Ring", "ring_path", "RingError", "RingTimeout", "RingClosed", "RecordTooLarge", "DEFAULT_RING_DIR"]

DEFAULT_RING_DIR = "/dev/shm"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def ring_path(ring_dir: str | None, run_name: str, job_id: str | int, node: str, purpose: str) -> str:
    """Segment path for one run, job and node: `<dir>/rollout-hpc.<run>.<job>.<node>.<purpose>.ring`."""
    parts = [_UNSAFE.sub("_", str(p)) or "_" for p in (run_name, job_id, node, purpose)]
    return os.path.join(ring_dir or DEFAULT_RING_DIR, "rollout-hpc." + ".".join(parts) + ".ring")


class Ring:
    """A handle on a ring segment. Thread-safe; open one handle per process (not inherited by fork)."""

    def __init__(self, native: _ring.Ring):
        self._r = native

    # ---- lifecycle -------------------------------------------------------------------
    @classmethod
    def create(cls, path: str | os.PathLike, capacity: int) -> Ring:
        """Creates an owner-only (0600) segment with `capacity` bytes of record space; fails if it exists."""
        return cls(_ring.Ring.create(os.fspath(path), int(capacity)))

    @classmethod
    def open(cls, path: str | os.PathLike) -> Ring:
        """Attaches to an existing segment; RingError names the file and what is wrong with it."""
        return cls(_ring.Ring.open(os.fspath(path)))

    @classmethod
    def open_or_create(cls, path: str | os.PathLike, capacity: int) -> Ring:
        return cls(_ring.Ring.open_or_create(os.fspath(path), int(capacity)))

    @property
    def path(self) -> str:
        return self._r.path

    @property
    def capacity(self) -> int:
        return self._r.capacity

    @property
    def max_record_len(self) -> int:
        """Largest record this ring accepts (capacity minus one 32-byte record header)."""
        return self._r.max_record_len

    @property
    def closed(self) -> bool:
        return self._r.closed

    def close(self) -> None:
        """End of stream: pushes fail with RingClosed; pops drain what is left, then raise RingClosed."""
        self._r.close()

    def unlink(self) -> None:
        """Removes the segment file (processes that have it open keep working)."""
        self._r.unlink()

    def stats(self) -> _Stats:
        """Counters shared by every process on this segment (records/bytes in and out, fill,
        high-water mark, seconds blocked in push and pop, live producers/consumers, recoveries)."""
        return self._r.stats()

    # ---- producing ---------------------------------------------------------------------
    def push(self, data, timeout: float | None = None) -> int:
        """Pushes one record (any C-contiguous buffer); returns its id. Waits for room up to
        `timeout` seconds (None: forever) and raises RingTimeout, RingClosed or RecordTooLarge."""
        return self._r.push(data, timeout)

    def try_push(self, data) -> bool:
        """Pushes if there is room right now."""
        return self._r.try_push(data)

    def push_many(self, items: Iterable, timeout: float | None = None) -> int:
        """Pushes all items in order with batched reservations; returns how many were pushed."""
        return self._r.push_many(items, timeout)

    @contextmanager
    def reserve(self, nbytes: int, timeout: float | None = None) -> Iterator[memoryview]:
        """Reserves a record of `nbytes` and yields a writable memoryview on it in shared memory;
        the record is committed when the block ends normally and skipped by consumers if it raises."""
        writer = self._r.reserve(int(nbytes), timeout)
        view = memoryview(writer)
        try:
            yield view
        except BaseException:
            view.release()
            writer.abandon()
            raise
        _finish(view, writer.commit, "reserve")

    # ---- consuming ---------------------------------------------------------------------
    def pop(self, timeout: float | None = None) -> bytes:
        """Pops the oldest record as bytes. Raises RingTimeout, or RingClosed once closed and drained."""
        return self._r.pop(timeout)

    def try_pop(self) -> bytes | None:
        return self._r.try_pop()

    def pop_many(self, max_n: int, timeout: float | None = None) -> list[bytes]:
        """Waits up to `timeout` for one record, then returns it with up to max_n - 1 more that are ready, while they
        total at most 64 KiB beyond the first (docs/ring.md: larger batches page-fault on every call)."""
        return self._r.pop_many(int(max_n), timeout)

    def pop_view(self, timeout: float | None = None) -> AbstractContextManager[memoryview]:
        """Claims the oldest record; `with ring.pop_view() as view` gives a read-only memoryview on it in shared
        memory (zero copy). The record is acknowledged when the block ends (RingError if a view or numpy array on
        it is still alive then); do not keep views beyond it. The record id is `view.obj.id`. (The native record is
        its own context manager: no Python generator per record.)"""
        return self._r.pop_view(timeout)


def _finish(view: memoryview, done, where: str) -> None:
    """Releases our memoryview, then commits/acknowledges; refuses while the buffer is still exported."""
    try:
        view.release()
        done()
    except BufferError:
        raise RingError(
            f"a numpy array or memoryview made from the {where} buffer is still alive at the end of the "
            "with-block; copy what you keep (bytes(view), np.array(arr)) inside the block"
        ) from None
