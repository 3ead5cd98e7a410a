"""Shared-memory slots for weights that stay on one node: the sending trainer writes a version's tensors into a
slot, the generators of its node copy them out, no MPI broadcast in between.

One file in the ring directory (tmpfs: /dev/shm), owner-only, holding `SLOTS` slots of one sync's bytes each (the
tensors laid end to end, in the header's order). The writer uses the slots in turn and never writes a slot again
before every reader has acknowledged the version last written there (weights.py sends and counts the acks), so
with two slots a trainer only waits when a generator is still copying the version before the previous one.

Ownership and failure: the trainer creates the file and unlinks it once every reader mapped it (the mappings live
on; the memory goes with the last process), so a segment is left behind only when the trainer dies in that short
window, like a ring. A reader that dies mid-copy never acknowledges: the writer's next write to that slot waits
(the watchdog's hang rule ends the job, as it does for a receiver that stops taking part in a broadcast). A
writer that dies mid-write never sends the header: readers never read a half-written slot.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

SLOTS = 2


class SlotWriter:
    """The sending trainer's side: a file of SLOTS slots of `slot_bytes` each, created at `path`."""

    def __init__(self, path: str, slot_bytes: int):
        self.path = path
        self.slot_bytes = slot_bytes
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, max(1, slot_bytes * SLOTS))
            self._mm = mmap.mmap(fd, max(1, slot_bytes * SLOTS))
        finally:
            os.close(fd)
        self._mem = np.frombuffer(self._mm, np.uint8)
        self.unlinked = False

    def write(self, slot: int, arrays: list[np.ndarray]) -> None:
        """Lay `arrays` end to end into `slot` (one copy each, straight from their memory)."""
        pos = slot * self.slot_bytes
        for a in arrays:
            flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
            self._mem[pos : pos + flat.nbytes] = flat
            pos += flat.nbytes

    def unlink(self) -> None:
        """Remove the file (every reader mapped it; the mappings stay valid)."""
        if not self.unlinked:
            self.unlinked = True
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self.unlink()
        del self._mem
        self._mm.close()


class SlotReader:
    """A generator's side: the writer's file, mapped read-only."""

    def __init__(self, path: str):
        self.path = path
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            self._mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self._mem = np.frombuffer(self._mm, np.uint8)

    def read(self, slot: int, slot_bytes: int, out: np.ndarray) -> None:
        """Copy the first out.nbytes bytes of `slot` into `out` (a flat uint8 buffer)."""
        start = slot * slot_bytes
        np.copyto(out, self._mem[start : start + out.nbytes])

    def close(self) -> None:
        del self._mem
        self._mm.close()
