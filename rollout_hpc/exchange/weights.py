"""Weight sync: new policy weights flow from the trainers to every generator after a train step.

Trainers call `publish(version, {name: array})` together (trainer group rank 0
holds the weights and sends). The sender first sends each generator a small
header (version, names, dtypes, shapes) point to point, then broadcasts the
tensors' bytes, laid end to end, over the intercommunicator (`Bcast`,
root=MPI.ROOT on the sender, PROC_NULL on the other trainers) in broadcasts
of at most `exchange.weight_chunk_bytes` into one receive buffer per version,
never pickled: a large tensor straight from its memory, small ones packed
together into one broadcast (`_transfers`).

On each generator a receiver thread waits for headers (a probe with a short
sleep, so an idle generator does not spin a core; paced probes while the
generator is blocked in `receive()`, because then the trainer's broadcast waits
on that sleep; a sender on the same host rings the thread's doorbell, which ends
the sleep: exchange/pacing.py, exchange/doorbell.py), takes part in the broadcast
and keeps the newest version (receive buffers are reused once nothing handed
out views them any more). So the trainer's publish never waits for a
generator to finish its current batch, and generators pick weights up between
batches: `poll()` (non-blocking) or `receive(min_version)` (blocking). The
trainers' `close()` sends a stop header: generators then see `SyncClosed` once
no newer version can come.

`check_staleness` is the trainer-side rule for `exchange.max_staleness`.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np

from rollout_hpc.exchange import doorbell
from rollout_hpc.exchange.faults import fault_point
from rollout_hpc.exchange.pacing import ArrivalPacer
from rollout_hpc.trajectory import TrajectoryBatch

_TAG_HEADER = 21
_MAX_MPI_COUNT = (1 << 31) - 1


class SyncClosed(RuntimeError):
    """The trainers closed the weight stream; no newer version will come."""


@dataclass
class _Header:
    version: int
    stop: bool
    names: list[str]
    dtypes: list[str]
    shapes: list[tuple[int, ...]]
    chunk_bytes: int
    meta: dict | None = None  # small JSON data that goes with this version (the prompt sampler's state)

    def to_json(self) -> bytes:
        """The wire form: JSON (never pickle: a header is data, and unpickling executes whatever a peer sent)."""
        return json.dumps(
            {
                "version": self.version,
                "stop": self.stop,
                "names": self.names,
                "dtypes": self.dtypes,
                "shapes": [list(s) for s in self.shapes],
                "chunk_bytes": self.chunk_bytes,
                "meta": self.meta,
            }
        ).encode()

    @classmethod
    def from_json(cls, blob: bytes | bytearray) -> _Header:
        d = json.loads(bytes(blob))
        for dtype in d["dtypes"]:  # numpy dtype strings of plain numbers only (no object dtype)
            if np.dtype(dtype).kind not in "biuf":
                raise ValueError(f"weight header names dtype {dtype!r}: not a numeric tensor")
        return cls(
            int(d["version"]),
            bool(d["stop"]),
            [str(n) for n in d["names"]],
            list(d["dtypes"]),
            [tuple(int(x) for x in s) for s in d["shapes"]],
            int(d["chunk_bytes"]),
            d.get("meta"),
        )

    @property
    def sizes(self) -> list[int]:
        return [int(np.prod(s, dtype=np.int64)) * np.dtype(d).itemsize for s, d in zip(self.shapes, self.dtypes)]


def _chunks(nbytes: int, chunk: int):
    for start in range(0, nbytes, chunk):
        yield start, min(nbytes, start + chunk)


def _transfers(sizes: list[int], chunk: int) -> list[list[tuple[int, int, int]]]:
    """The broadcasts of one sync, in order: each one contiguous range of the tensors laid end to end, at most
    `chunk` bytes, as its pieces [(tensor index, lo, hi)]. Tensors smaller than a chunk share a broadcast (the
    sender packs them into a staging buffer): each broadcast costs a round of latency at every tree stage, and
    one per tensor made a sync of a few MB over TCP take 25-150 ms. A tensor of a chunk or more is sent from its
    own memory, in chunks. Sender and receivers derive the same list from the header."""
    out: list[list[tuple[int, int, int]]] = []
    group: list[tuple[int, int, int]] = []
    filled = 0
    for i, size in enumerate(sizes):
        if size >= chunk:
            if group:
                out.append(group)
                group, filled = [], 0
            out.extend([(i, lo, hi)] for lo, hi in _chunks(size, chunk))
            continue
        if group and filled + size > chunk:
            out.append(group)
            group, filled = [], 0
        group.append((i, 0, size))
        filled += size
    if group:
        out.append(group)
    return out


class WeightSync:
    """Collective constructor over the whole world (it duplicates the intercommunicator)."""

    WAITING_POLL_S = 50e-6  # fine header probe interval while a generator waits in receive() (exchange/pacing.py)

    def __init__(self, world, cfg, poll_interval: float = 0.002):
        from mpi4py import MPI

        self._MPI = MPI
        self.world = world
        # Each generator's receiver sleeps on a doorbell that trainer group rank 0 rings as it sends a header (a
        # sender on the same host wakes it at once; exchange/doorbell.py). Bound before the collective Dup below,
        # so no ring can come before it.
        self._bell = (
            doorbell.Doorbell(doorbell.bell_name(world.job_id, "weights", world.rank)) if world.is_generator else None
        )
        self.comm = world.inter_comm.Dup()  # private matching context: no clash with other intercomm traffic
        self._ringer = (
            doorbell.Ringer(
                [doorbell.bell_name(world.job_id, "weights", r.rank) for r in world.ranks if r.role == "generator"]
            )
            if world.is_trainer and world.group_rank == 0
            else None
        )
        self.chunk_bytes = min(cfg.exchange.weight_chunk_bytes, _MAX_MPI_COUNT)
        self.history: list[dict] = []  # one stats dict per version sent or received
        self._poll_interval = poll_interval
        self._cond = threading.Condition()
        self._latest: tuple[int, dict] | None = None
        self._latest_meta: dict | None = None
        self.meta: dict | None = None  # the `meta` published with the version poll()/receive() last handed out
        self._taken = -1  # newest version handed out by poll()/receive()
        self._waiting = 0  # generator threads blocked in receive()
        self._closed = False
        self._error: BaseException | None = None
        self._stop_thread = False
        self._thread = None
        self._buffers: list[np.ndarray] = []  # receive buffers, reused once no tensors view them
        self.buffers_reused = 0
        self.rings = 0  # sleeps of the receiver thread a trainer's doorbell ring ended (exchange/doorbell.py)
        self._staging = np.empty(0, np.uint8)  # the sender packs small tensors here (one broadcast for many)
        if world.is_generator:
            self._thread = threading.Thread(target=self._receive_loop, name="weight-sync", daemon=True)
            self._thread.start()

    # --- trainer side --------------------------------------------------------
    def publish(self, version: int, tensors: dict | None, *, meta: dict | None = None, _stop: bool = False) -> dict:
        """Send `tensors` as policy `version` to every generator. Collective over the trainer group; only
        group rank 0's `tensors` and `meta` are used (others may pass None). `meta`: JSON-able data the generators
        read as `meta` with this version. Returns the stats of this sync."""
        MPI = self._MPI
        if not self.world.is_trainer:
            raise RuntimeError("publish() is for trainer ranks; generators call receive() or poll()")
        t0 = time.perf_counter()
        if self.world.group_rank != 0:
            n = self.world.group_comm.bcast(None, root=0)
            for _ in range(n):
                self.comm.Bcast([np.empty(0, np.uint8), MPI.BYTE], root=MPI.PROC_NULL)
            return {"version": version, "bytes": 0, "seconds": time.perf_counter() - t0, "role": "trainer"}
        arrays = [np.asarray(a, order="C") for a in (tensors or {}).values()]  # keeps 0-d shapes
        header = _Header(
            version=int(version),
            stop=_stop,
            names=list((tensors or {}).keys()),
            dtypes=[a.dtype.str for a in arrays],
            shapes=[tuple(a.shape) for a in arrays],
            chunk_bytes=self.chunk_bytes,
            meta=meta,
        )
        blob = header.to_json()
        if self._ringer is not None:  # before the send: a ring that comes after the header misleads the pacer
            self._ringer.ring()
        reqs = [self.comm.Isend([blob, MPI.BYTE], dest=g, tag=_TAG_HEADER) for g in range(self.comm.Get_remote_size())]
        flat = [a.reshape(-1).view(np.uint8) for a in arrays]
        transfers = _transfers([a.nbytes for a in arrays], self.chunk_bytes)
        self.world.group_comm.bcast(len(transfers), root=0)
        for pieces in transfers:
            if len(pieces) == 1:
                i, lo, hi = pieces[0]
                self.comm.Bcast([flat[i][lo:hi], MPI.BYTE], root=MPI.ROOT)
                continue
            total = sum(hi - lo for _, lo, hi in pieces)
            if self._staging.nbytes < total:  # kept across syncs: fresh memory costs a page fault per 4 KiB
                self._staging = np.empty(total, np.uint8)
            np.concatenate([flat[i][lo:hi] for i, lo, hi in pieces], out=self._staging[:total])
            self.comm.Bcast([self._staging[:total], MPI.BYTE], root=MPI.ROOT)
        MPI.Request.Waitall(reqs)
        seconds = time.perf_counter() - t0
        nbytes = sum(a.nbytes for a in arrays)
        stats = {
            "version": int(version),
            "bytes": nbytes,
            "seconds": seconds,
            "gb_per_s": nbytes / max(seconds, 1e-9) / 1e9,
            "chunks": len(transfers),
            "role": "trainer",
        }
        self.history.append(stats)
        return stats

    def close(self) -> None:
        """Trainers: tell generators no more versions come (collective over trainers). Generators: stop the thread."""
        if self.world.is_trainer:
            if not self._closed:
                self._closed = True
                self.publish(-1, {}, _stop=True)
        else:
            self._stop_thread = True
            assert self._bell is not None
            self._bell.set()
            if self._thread is not None:
                self._thread.join()
            self._bell.close()
        if self._ringer is not None:
            self._ringer.close()
        self.comm.Free()

    # --- generator side ------------------------------------------------------
    def _receive_loop(self) -> None:
        MPI = self._MPI
        status = MPI.Status()
        # While a generator waits in receive(): probes paced by how long the last wait took (exchange/pacing.py)
        pacer = ArrivalPacer(fine=self.WAITING_POLL_S)
        bell = self._bell
        assert bell is not None
        try:
            while not self._stop_thread:
                if not self.comm.Iprobe(source=0, tag=_TAG_HEADER, status=status):
                    if self._waiting:
                        pacer.start()
                        delay = pacer.next()
                    else:  # a slow probe may be long: receive() and a trainer's ring cut it short
                        pacer.cancel()
                        delay = pacer.idle(self._poll_interval)
                    if bell.wait(delay)[1]:
                        self.rings += 1
                        pacer.rung()
                    continue
                pacer.arrived()
                blob = bytearray(status.Get_count(MPI.BYTE))
                self.comm.Recv([blob, MPI.BYTE], source=0, tag=_TAG_HEADER)
                header = _Header.from_json(blob)
                if not header.stop:
                    fault_point("weight-sync")
                t0 = time.perf_counter()
                sizes = header.sizes
                flat = self._buffer(sum(sizes))
                pos = 0
                for pieces in _transfers(sizes, header.chunk_bytes):  # contiguous in `flat`, in order
                    total = sum(hi - lo for _, lo, hi in pieces)
                    self.comm.Bcast([flat[pos : pos + total], MPI.BYTE], root=0)
                    pos += total
                tensors, pos = {}, 0
                for name, dtype, shape, size in zip(header.names, header.dtypes, header.shapes, sizes):
                    tensors[name] = flat[pos : pos + size].view(np.dtype(dtype)).reshape(shape)
                    pos += size
                seconds = time.perf_counter() - t0
                with self._cond:
                    if header.stop:
                        self._closed = True
                    else:
                        self._latest, self._latest_meta = (header.version, tensors), header.meta
                        self.history.append(
                            {
                                "version": header.version,
                                "bytes": int(flat.nbytes),
                                "seconds": seconds,
                                "gb_per_s": flat.nbytes / max(seconds, 1e-9) / 1e9,
                                "role": "generator",
                            }
                        )
                    self._cond.notify_all()
                if header.stop:
                    return
        except BaseException as exc:  # surfaced to the caller of receive()/poll()
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _buffer(self, nbytes: int) -> np.ndarray:
        """A receive buffer: one of ours that no tensors handed out still view, else a new one. Reuse
        matters: fresh memory costs a page fault per 4 KiB, which made a sync several times slower."""
        for i in range(len(self._buffers)):
            if self._buffers[i].nbytes == nbytes and sys.getrefcount(self._buffers[i]) == 2:  # the list + the call
                self.buffers_reused += 1
                return self._buffers[i]
        in_use = [sys.getrefcount(self._buffers[i]) > 2 for i in range(len(self._buffers))]
        buf = np.empty(nbytes, np.uint8)
        self._buffers = [b for b, used in zip(self._buffers, in_use) if used] + [buf]  # unused sizes go
        return buf

    def _take(self, min_version: int):
        if self._error is not None:
            raise RuntimeError(f"weight sync receiver failed: {self._error!r}") from self._error
        if self._latest is not None and self._latest[0] >= min_version:
            self._taken = max(self._taken, self._latest[0])
            self.meta = self._latest_meta
            return self._latest
        if self._closed:
            raise SyncClosed(f"the trainers closed the weight stream (newest version {self._taken})")
        return None

    def poll(self):
        """Newest weights not handed out yet, as (version, tensors), or None."""
        with self._cond:
            return self._take(self._taken + 1)

    def receive(self, min_version: int = 0, timeout: float | None = None):
        """The newest weights once their version is >= min_version (blocks until then)."""
        if not self.world.is_generator:
            raise RuntimeError("receive() is for generator ranks; trainers call publish()")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._waiting += 1
            assert self._bell is not None
            self._bell.set()
            try:
                while True:
                    got = self._take(min_version)
                    if got is not None:
                        return got
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"no weights of version >= {min_version} within {timeout}s")
                    self._cond.wait(left)
            finally:
                self._waiting -= 1


def check_staleness(batch: TrajectoryBatch, current_version: int, max_staleness: int) -> tuple[TrajectoryBatch, int]:
    """Keep the records generated by a policy at most `max_staleness` versions behind `current_version`
    (0 = only the current policy: strictly on-policy). Returns (kept, n_rejected); records claiming a
    version newer than the trainer's are rejected too (they cannot be trusted)."""
    lag = np.int64(current_version) - batch.fixed["policy_version"].astype(np.int64)
    keep = (lag >= 0) & (lag <= max_staleness)
    n_rejected = int(len(batch) - keep.sum())
    return (batch if n_rejected == 0 else batch.select(keep)), n_rejected
