"""Experience exchange: trajectories flow from generator nodes to trainer nodes.

    generator ranks --put--> generator node ring --forwarder thread--MPI Isend--> trainer node leader
    trainer node leader --receiver thread--> trainer node ring --get--> trainer ranks

Every rank of a node reaches the node's ring (rollout_hpc.exchange.ring, shared
memory); so can processes that are not MPI ranks (engine workers). The node
leader (local rank 0) of each generator node runs the forwarder; the leader of
each trainer node runs the receiver. Both are threads (MPI_THREAD_MULTIPLE)
because the leader rank is busy generating or training: progress driven only by
put()/get() calls would stall the other ranks' data whenever the leader is in a
long generate or backward call.

Wire protocol on a private duplicate of the intercommunicator (remote ranks are
group ranks of the other role):
  DATA  forwarder -> trainer leader: one packed TrajectoryBatch (the bytes of one
        ring record, sent with a buffer-based Isend, never pickled)
  ACK   trainer leader -> forwarder: int64 byte count, sent once the batch is in
        the trainer ring
  END   forwarder -> every trainer leader: this generator node has sent
        everything and every DATA was acknowledged
  ABORT forwarder -> every trainer leader, or receiver -> every forwarder: this node failed
        (utf-8 reason), so the other side stops instead of waiting

Markers in the generator ring (FIFO) carry control without collectives:
close() on each generator rank pushes a DONE marker; once the forwarder has the
DONE of every rank of the node and no unacknowledged bytes, it sends END. So a
generator rank that fails never leaves a partner blocked in a barrier.
flush() pushes a FLUSH marker after a node barrier: when the forwarder pops it
and has no unacknowledged bytes, everything put before is in a trainer ring.

Flow control: a forwarder keeps at most max_inflight_bytes / generator.nodes
bytes sent but not acknowledged (one batch may exceed it alone, else it could
never go). When the trainers are slow their ring fills, the receiver stops
acknowledging, the forwarder stops popping, the generator ring fills and
put() blocks: backpressure reaches the generators and memory stays bounded.

Balancing: each forwarder sends the next batch to the trainer node that has had
the fewest tokens from it so far, so trainer nodes get equal work (within one
batch per generator node) whatever the producers' speeds.

Errors: a batch that is not a valid trajectory batch (unknown layout version,
truncated, inconsistent lengths) stops the run with a LayoutError that names
where it came from; nothing is skipped silently, because training on partial
data would bias the policy. (Records that are merely too stale are the one
thing skipped, with a count: weights.check_staleness.)
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from rollout_hpc.exchange import doorbell
from rollout_hpc.exchange.faults import fault_point
from rollout_hpc.exchange.pacing import ArrivalPacer
from rollout_hpc.trajectory import LayoutError, TrajectoryBatch

TAG_DATA, TAG_ACK, TAG_END, TAG_ABORT = 31, 32, 33, 34
_POISON = b"RHERR"  # a ring record that carries a fatal error to every trainer rank of the node
_FLUSH = b"RHFLUSH"  # a ring record that asks the forwarder to report when all before it is delivered
_DONE = b"RHDONE"  # a ring record: one rank of the node will put nothing more
# How the threads wait (docs/exchange.md, "Threads, not progress-on-call"): a ring wait is a futex sleep that
# ends the moment a record is pushed; MPI has no such wait (a blocking Probe spins a core), so it is polled.
_RING_WAIT = 0.05  # forwarder with nothing in MPI to watch: sleep on the ring this long between ABORT checks
_MPI_POLL = (50e-6, 1e-3)  # forwarder watching sends/ACKs: first and longest wait between MPI polls
_RECV_POLL_HUNGRY = (50e-6, 1e-3)  # receiver while a trainer rank of this process waits in get(): fine and coarse
# probes of an ArrivalPacer (exchange/pacing.py), fine once most of the last wait has passed
_RECV_POLL_IDLE = (50e-6, 2e-3)  # receiver while the trainers are busy (a batch would only wait in the ring)


class ExchangeError(RuntimeError):
    """The exchange cannot go on (the message names the node and the cause)."""


def _ring_module():
    try:
        from rollout_hpc.exchange import ring  # in here: a missing Rust extension becomes a clear ExchangeError
    except ModuleNotFoundError as exc:  # the ring ships with the Rust extension
        raise ExchangeError(
            f"the node ring is not available ({exc}); rebuild the rollout_hpc._ring extension"
        ) from None
    return ring


def _validate(buf, where: str) -> TrajectoryBatch:
    try:
        return TrajectoryBatch.unpack(buf)
    except LayoutError as exc:
        raise LayoutError(f"{where}: {exc}") from None


def _unlink_quietly(ring) -> None:
    try:
        ring.unlink()
    except Exception:  # already unlinked (after a failure)
        pass


class _Backoff:
    """Wait a little longer each idle round (doubling up to a cap), so polling threads do not spin a shared core."""

    def __init__(self, first: float, cap: float):
        self.first, self.cap, self.delay = first, cap, first

    def next(self) -> float:
        """The wait for this idle round; the next one doubles, up to the cap."""
        delay = self.delay
        self.delay = min(delay * 2, self.cap)
        return delay

    def reset(self):
        self.delay = self.first


class Exchange:
    """One link of the experience stream, from the `source` group's ranks (put) to the `dest` group's (get).

    Collective constructor over both groups (the ranks of other groups do not take part); then the source ranks
    put(), the dest ranks get(). The default link is generators -> trainers; with a reward group the stream has
    two: generators -> reward and reward -> trainers (a reward rank holds one of each)."""

    def __init__(self, world, cfg, keep_ring_file: bool = False, source: str = "generator", dest: str = "trainer"):
        """keep_ring_file: leave the ring's file in ring_dir while the run lasts, for processes that are not
        MPI ranks to attach by path (ring_path). By default it is unlinked once the node's ranks attached,
        so a run killed with SIGKILL leaves no segment behind in /dev/shm."""
        from mpi4py import MPI

        if world.role not in (source, dest):
            raise ExchangeError(f"a {world.role} rank is not on the {source} -> {dest} exchange")
        self.MPI = MPI
        self.world = world
        self.cfg = cfg
        self.source, self.dest = source, dest
        self.producer = world.role == source
        # A dest node leader's receiver sleeps on a doorbell the source leaders ring as they send (a sender on the
        # same host wakes it at once: exchange/doorbell.py); bound before the collective Dup, so before any ring.
        # Elsewhere an Event: get() sets it, nobody waits on it.
        self.bell_link = f"exp-{source}-{dest}"
        self._wake: doorbell.Doorbell | threading.Event = (
            doorbell.Doorbell(doorbell.bell_name(world.job_id, self.bell_link, world.rank))
            if not self.producer and world.is_node_leader
            else threading.Event()
        )
        self.comm = world.link(dest if self.producer else source).Dup()  # private matching context for DATA/ACK/END
        ring = _ring_module()
        self._RingTimeout, self._RingClosed = ring.RingTimeout, ring.RingClosed
        self._RecordTooLarge = ring.RecordTooLarge
        # A rank on two links (the reward group's) has a ring for each.
        purpose = (
            f"exp-{world.role}"
            if world.role in ("generator", "trainer")
            else f"exp-{world.role}-{'out' if self.producer else 'in'}"
        )
        self.ring_path = ring.ring_path(cfg.exchange.ring_dir, cfg.run.name, world.job_id, world.node_name, purpose)
        if world.is_node_leader:
            if os.path.exists(
                self.ring_path
            ):  # a requeued job reuses its job id; unused experiences live in checkpoints
                os.unlink(self.ring_path)
            self.ring = ring.Ring.create(self.ring_path, cfg.exchange.ring_bytes)
        world.node_comm.Barrier()
        if not world.is_node_leader:
            self.ring = ring.Ring.open(self.ring_path)
        world.node_comm.Barrier()  # nobody unlinks before everybody attached
        if world.is_node_leader and not keep_ring_file:
            _unlink_quietly(self.ring)  # the mappings live on; the memory goes when the last rank exits
        # Counters of this rank (the leader's thread adds its own under "forwarder"/"receiver").
        self.counters = {"put_records": 0, "put_bytes": 0, "put_blocked": 0, "got_records": 0}
        self._leftover = TrajectoryBatch.empty()
        self._ended = False
        self._closed = False
        self._worker = None
        # Trainers: set while this process waits in get(); the receiver then polls MPI at its fast cadence.
        self._hungry = threading.Event()
        if world.is_node_leader:
            self._worker = (_Forwarder if self.producer else _Receiver)(self)
            self._worker.start()

    # --- generator side ------------------------------------------------------
    def put(self, batch: TrajectoryBatch, timeout: float | None = None) -> None:
        """Send a batch to the trainers; blocks while the node ring is full (backpressure).
        The batch is packed straight into the shared-memory ring: no intermediate copy."""
        self._push(batch, len(batch), timeout)

    def put_packed(self, buf, timeout: float | None = None) -> None:
        """Send an already packed batch (checked first: a LayoutError here names the problem)."""
        self._push(buf, len(_validate(buf, f"put_packed on rank {self.world.rank}")), timeout)

    def _push(self, data, n_records: int, timeout: float | None) -> None:
        """Push a TrajectoryBatch (packed in place) or packed bytes, counting pushes that had to wait."""
        if not self.producer:
            raise ExchangeError(f"put() is for the {self.source} ranks; {self.dest} ranks call get()")
        self._raise_worker_error()
        size = data.packed_size() if isinstance(data, TrajectoryBatch) else len(data)
        try:
            try:
                self._push_once(data, size, 0)
            except self._RingTimeout:
                self.counters["put_blocked"] += 1  # the ring is full: the trainers are behind
                self._push_once(data, size, timeout)
        except self._RecordTooLarge:
            raise ExchangeError(
                f"a batch of {size} bytes does not fit the node ring (exchange.ring_bytes {self.cfg.exchange.ring_bytes}); "
                "raise exchange.ring_bytes or put smaller batches"
            ) from None
        except self._RingClosed:
            self._raise_worker_error()
            raise ExchangeError(
                f"the forwarder of {self.source} node {self.world.node_name} stopped; see its leader rank's error"
            ) from None
        self.counters["put_records"] += n_records
        self.counters["put_bytes"] += size

    def _push_once(self, data, size: int, timeout: float | None) -> None:
        if isinstance(data, TrajectoryBatch):
            with self.ring.reserve(size, timeout) as view:
                data.pack_into(view)
        else:
            self.ring.push(data, timeout=timeout)

    def flush(self, timeout: float | None = None) -> None:
        """Return once everything put on this node so far is in a trainer ring.
        Collective over the generator ranks of the node."""
        self.world.node_comm.Barrier()
        failure = None
        if self._worker is not None:
            try:
                assert isinstance(self._worker, _Forwarder), "flush() is for generator ranks"
                self._worker.flush(timeout)
            except BaseException as exc:
                failure = exc
        # Not a barrier: the leader's outcome, so every rank of the node returns or raises together.
        text = self.world.node_comm.bcast(None if failure is None else f"{type(failure).__name__}: {failure}", root=0)
        if failure is not None:
            raise failure
        if text is not None:
            raise ExchangeError(f"flush on {self.source} node {self.world.node_name} failed: {text}")

    # --- trainer side --------------------------------------------------------
    def get(self, n_records: int, timeout: float | None = None) -> TrajectoryBatch:
        """Exactly n_records trajectories (fewer only at the end of the stream; empty = all done).
        On timeout raises TimeoutError; what was popped stays for the next call."""
        if self.producer:
            raise ExchangeError(f"get() is for the {self.dest} ranks; {self.source} ranks call put()")
        self._raise_worker_error()
        deadline = None if timeout is None else time.monotonic() + timeout
        parts, have = [self._leftover], len(self._leftover)
        try:
            while have < n_records and not self._ended:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    buf = self.ring.try_pop()
                    if buf is None:  # about to wait: the node's receiver polls MPI fast until a batch comes
                        self._hungry.set()
                        self._wake.set()
                        buf = self.ring.pop(timeout=left)
                except self._RingTimeout:
                    raise TimeoutError(f"{have} of {n_records} trajectories arrived within {timeout}s") from None
                except self._RingClosed:
                    self._ended = True
                    break
                finally:
                    self._hungry.clear()
                batch = self._check_record(buf)
                parts.append(batch)
                have += len(batch)
        finally:
            parts = [p for p in parts if len(p)] or [TrajectoryBatch.empty()]
            merged = TrajectoryBatch.concat(parts) if len(parts) > 1 else parts[0]  # one batch: no copy
            self._leftover = merged
        out, self._leftover = (
            (merged, TrajectoryBatch.empty())
            if have <= n_records
            else (merged.select(slice(0, n_records)), merged.select(slice(n_records, None)))
        )
        self.counters["got_records"] += len(out)
        return out

    def get_available(self, max_records: int, timeout: float | None = None) -> TrajectoryBatch:
        """At least one trajectory (waiting up to `timeout`) plus what else came with it, up to max_records;
        empty on timeout or at the end of the stream. For ranks that share a node ring and so cannot know
        how many records will be theirs (data-parallel trainer ranks)."""
        try:
            first = self.get(1, timeout=timeout)
        except TimeoutError:
            return TrajectoryBatch.empty()
        more = min(len(self._leftover), max_records - len(first))
        return TrajectoryBatch.concat([first, self.get(more)]) if more > 0 else first

    def _check_record(self, buf) -> TrajectoryBatch:
        if bytes(buf[: len(_POISON)]) == _POISON:
            try:
                self.ring.try_push(buf)  # leave it for the node's other trainer ranks
            except Exception:
                pass
            kind, _, text = bytes(buf[len(_POISON) :]).decode(errors="replace").partition(":")
            raise (LayoutError if kind == "LayoutError" else ExchangeError)(text)
        return _validate(buf, f"{self.dest} node {self.world.node_name}")

    @property
    def ended(self) -> bool:
        """True once every source node finished and this rank has seen the end of the ring."""
        return self._ended and not len(self._leftover)

    # --- both ----------------------------------------------------------------
    def close(self, timeout: float | None = None) -> TrajectoryBatch:
        """Orderly end. Generators: everything put is delivered, then END goes to every trainer node.
        Trainers: wait for END from every generator node and return the trajectories not taken by get()
        (keep them, e.g. in a checkpoint). Call on every rank: generators close when done producing,
        trainers when done training (the trainers' call returns once the generators have closed)."""
        rest = TrajectoryBatch.empty()
        if self._closed:
            return rest
        self._closed = True
        if self.producer:
            self._raise_worker_error()
            try:
                self.ring.push(_DONE, timeout=timeout)  # after all of this rank's batches (FIFO)
            except self._RingClosed:
                raise ExchangeError(
                    f"the forwarder of {self.source} node {self.world.node_name} stopped; see its leader rank's error"
                ) from None
        else:
            rest = self.get(1 << 62, timeout=timeout)  # until the end of the stream
        if self._worker is not None:
            self._worker.join(timeout)
            if self._worker.is_alive():
                raise TimeoutError(
                    f"the exchange {self._worker.kind} of node {self.world.node_name} did not finish within {timeout}s"
                )
            self.ring.close()
            _unlink_quietly(self.ring)
            self._raise_worker_error()
        self._close_bells()
        self.comm.Free()
        return rest

    def _close_bells(self) -> None:
        if isinstance(self._wake, doorbell.Doorbell):
            self._wake.close()
        ringer = getattr(self._worker, "ringer", None)
        if ringer is not None:
            ringer.close()

    def _raise_worker_error(self) -> None:
        if self._worker is not None and self._worker.error is not None:
            err = self._worker.error
            raise (
                err if isinstance(err, LayoutError) else ExchangeError(f"{self._worker.name} failed: {err!r}")
            ) from err

    def stats(self) -> dict:
        out = {"role": self.world.role, "rank": self.world.rank, "node": self.world.node_name, **self.counters}
        if self._worker is not None:
            out[self._worker.kind] = self._worker.stats()
        return out


class _Worker(threading.Thread):
    kind = "worker"

    def __init__(self, ex: Exchange):
        super().__init__(name=f"{self.kind}-{ex.world.node_name}", daemon=True)
        self.ex, self.comm, self.MPI = ex, ex.comm, ex.MPI
        self.error: BaseException | None = None
        self.lock = threading.Condition()

    def run(self):
        try:
            self.loop()
        except BaseException as exc:
            self.error = exc
            self.fail(exc)
        finally:
            with self.lock:
                self.lock.notify_all()

    def fail(self, exc):
        pass


class _Claim:
    """A ring record claimed without copying (pop_view held open across loop rounds), released by hand."""

    def __init__(self, ring, timeout: float):
        self._cm = ring.pop_view(timeout=timeout)  # waits without the GIL, woken by the next push
        self.view = self._cm.__enter__()  # RingTimeout when empty, RingClosed when closed and drained

    def release(self):
        self.view = None
        self._cm.__exit__(None, None, None)


class _Forwarder(_Worker):
    """Generator node leader: ring -> MPI, balanced by tokens, bounded in flight."""

    kind = "forwarder"

    def __init__(self, ex: Exchange):
        super().__init__(ex)
        cfg, world = ex.cfg, ex.world
        self.dests = [r.group_rank for r in world.leaders(ex.dest)]
        self.ringer = doorbell.Ringer(
            [doorbell.bell_name(world.job_id, ex.bell_link, r.rank) for r in world.leaders(ex.dest)]
        )
        self.budget = max(1, cfg.exchange.max_inflight_bytes // len(world.leaders(ex.source)))
        self.tokens = np.zeros(len(self.dests), np.int64)  # tokens sent per trainer node
        self.batches = np.zeros(len(self.dests), np.int64)
        self.sending: list[tuple] = []  # (request, buffer) until the send completes locally
        self.inflight = 0  # bytes sent and not yet acknowledged
        self.inflight_peak = 0
        self.sent_bytes = self.sent_records = self.acked_bytes = 0
        self.ack_buf = np.zeros(1, np.int64)
        self.flush_marks: list[bytes] = []
        self.flushed = 0  # flush markers fully delivered
        self.flush_requests = 0
        self.done_ranks, self.local_size = 0, world.local_size
        self.status = self.MPI.Status()

    def loop(self):
        staged, drained, backoff = None, False, _Backoff(*_MPI_POLL)
        while True:
            busy = self._progress()
            waited = False
            if staged is None and not drained:
                # Wait for the next record on the ring itself: a push wakes us at once. While MPI has
                # something to watch (sends to complete, ACKs to take) the wait is the back-off's.
                wait = 0.0 if busy else backoff.next() if self._mpi_pending() else _RING_WAIT
                staged, drained = self._pop(wait)
                busy |= staged is not None
                waited = wait > 0
            if staged is not None and len(staged.view) <= len(_FLUSH):
                head = bytes(staged.view)
                staged.release()
                staged = None
                if head == _FLUSH:
                    self.flush_marks.append(head)
                elif head == _DONE:
                    self.done_ranks += 1
                    drained |= self.done_ranks == self.local_size
                else:
                    raise LayoutError(
                        f"{self.ex.source} node {self.ex.world.node_name}: a {len(head)}-byte record in its ring is not a trajectory batch"
                    )
            if staged is not None and (self.inflight == 0 or self.inflight + len(staged.view) <= self.budget):
                self._send(staged)
                staged, busy = None, True
            if self.flush_marks and staged is None and self.inflight == 0 and not self.sending:
                with self.lock:
                    self.flushed += len(self.flush_marks)
                    self.flush_marks.clear()
                    self.lock.notify_all()
            if drained and staged is None and self.inflight == 0 and not self.sending:
                break
            if busy:
                backoff.reset()
            elif not waited:  # a record is staged (budget full) or the ring is drained: only MPI can move
                time.sleep(backoff.next())
        self._to_all_trainers(TAG_END, b"")

    def _mpi_pending(self) -> bool:
        """Sends not yet complete or bytes not yet acknowledged: MPI must be polled, not only the ring."""
        return bool(self.sending) or self.inflight > 0

    def _pop(self, timeout: float):
        """(claimed record or None, drained): drained once the ring is closed and empty."""
        closed = self.ex.ring.closed
        try:
            return _Claim(self.ex.ring, timeout), False
        except self.ex._RingTimeout:
            return None, closed
        except self.ex._RingClosed:
            return None, True

    def _to_all_trainers(self, tag: int, payload: bytes):
        MPI = self.MPI
        self.ringer.ring()  # before the send: a ring that comes after the message misleads the pacer
        MPI.Request.Waitall([self.comm.Isend([payload, MPI.BYTE], dest=d, tag=tag) for d in self.dests])

    def _send(self, claim: _Claim):
        fault_point("forwarder")
        view = claim.view
        try:  # the header only: routing needs the token count; the receiver checks every length
            n_records, n_tokens = TrajectoryBatch.peek(view)
        except LayoutError as exc:
            raise LayoutError(
                f"{self.ex.source} node {self.ex.world.node_name} (a record in its ring): {exc}"
            ) from None
        j = int(np.argmin(self.tokens))
        # Sent straight from shared memory; the record stays claimed until the send completes.
        self.ringer.ring(j)  # before the send (exchange/pacing.py)
        req = self.comm.Isend([view, self.MPI.BYTE], dest=self.dests[j], tag=TAG_DATA)
        self.sending.append((req, claim))
        self.tokens[j] += n_tokens
        self.batches[j] += 1
        with self.lock:
            self.inflight += len(view)
            self.inflight_peak = max(self.inflight_peak, self.inflight)
        self.sent_bytes += len(view)
        self.sent_records += n_records

    def _progress(self) -> bool:
        """Complete local sends and take acknowledgements; True if anything happened."""
        busy = False
        if self.sending:
            done = self.MPI.Request.Testsome([r for r, _ in self.sending])
            if done:
                finished = set(done)
                for i in done:
                    self.sending[i][1].release()  # acknowledge the ring record: its room is free again
                self.sending = [x for i, x in enumerate(self.sending) if i not in finished]
                busy = True
        if self.comm.Iprobe(source=self.MPI.ANY_SOURCE, tag=TAG_ABORT, status=self.status):
            reason = bytearray(self.status.Get_count(self.MPI.BYTE))
            self.comm.Recv([reason, self.MPI.BYTE], source=self.status.Get_source(), tag=TAG_ABORT)
            kind, _, text = reason.decode(errors="replace").partition(":")
            raise (LayoutError if kind == "LayoutError" else ExchangeError)(text)
        while self.comm.Iprobe(source=self.MPI.ANY_SOURCE, tag=TAG_ACK):
            self.comm.Recv([self.ack_buf, self.MPI.INT64_T], source=self.MPI.ANY_SOURCE, tag=TAG_ACK)
            with self.lock:
                self.inflight -= int(self.ack_buf[0])
                self.acked_bytes += int(self.ack_buf[0])
                self.lock.notify_all()
            busy = True
        return busy

    def flush(self, timeout):
        """Until everything pushed into the ring before this call is acknowledged by a trainer node."""
        self.flush_requests += 1
        target = self.flush_requests
        self.ex.ring.push(_FLUSH, timeout=timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            while self.error is None and self.flushed < target and self.is_alive():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"exchange flush did not finish within {timeout}s")
                self.lock.wait(left)
        self.ex._raise_worker_error()

    def fail(self, exc):
        self.ex.ring.close()  # producers stop with an ExchangeError instead of blocking forever
        _unlink_quietly(self.ex.ring)  # attached ranks keep their mapping; no segment is left behind
        try:  # and the trainers stop instead of waiting for this node's END
            self._to_all_trainers(TAG_ABORT, f"{type(exc).__name__}:{exc}".encode())
        except Exception:
            pass

    def stats(self) -> dict:
        return {
            "trainer_nodes": len(self.dests),
            "budget_bytes": self.budget,
            "inflight_bytes": self.inflight,
            "inflight_peak_bytes": self.inflight_peak,
            "sent_bytes": self.sent_bytes,
            "sent_records": self.sent_records,
            "acked_bytes": self.acked_bytes,
            "tokens_per_trainer_node": self.tokens.tolist(),
            "batches_per_trainer_node": self.batches.tolist(),
        }


class _Receiver(_Worker):
    """Trainer node leader: MPI -> ring, acknowledging each batch once it is in the ring."""

    kind = "receiver"

    def __init__(self, ex: Exchange):
        super().__init__(ex)
        self.n_sources = len(ex.world.leaders(ex.source))
        self.ends = 0
        self.recv_bytes = self.recv_records = self.recv_msgs = 0
        self.rings = 0  # sleeps a source leader's doorbell ring ended (exchange/doorbell.py)
        self.acks: list[tuple] = []
        self.status = self.MPI.Status()

    def loop(self):
        MPI, ring, backoff = self.MPI, self.ex.ring, _Backoff(*_RECV_POLL_IDLE)
        pacer = ArrivalPacer(*_RECV_POLL_HUNGRY)
        hungry, wake = self.ex._hungry, self.ex._wake
        assert isinstance(wake, doorbell.Doorbell)  # a dest node leader's
        while self.ends < self.n_sources:
            self.acks = [(r, b) for r, b in self.acks if not r.Test()]
            msg = self.comm.Improbe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=self.status)
            if msg is None:
                # A trainer waiting in get() wants the batch now: poll fast once it is due (the pacer: the last wait
                # said when). Otherwise back off further (a batch would only sit in the ring), and a get() that
                # starts waiting ends the back-off early.
                if hungry.is_set():
                    pacer.start()
                    delay = pacer.next()
                else:
                    pacer.cancel()
                    delay = pacer.idle(backoff.next())
                woken, rung = wake.wait(delay)  # a get() that starts waiting, or a source leader's ring
                if woken:
                    backoff.reset()
                if rung:
                    self.rings += 1
                    pacer.rung()
                continue
            pacer.arrived()
            backoff.reset()
            source, tag, count = self.status.Get_source(), self.status.Get_tag(), self.status.Get_count(MPI.BYTE)
            if tag == TAG_DATA:
                self._receive_batch(msg, source, count)
                continue
            buf = np.empty(count, np.uint8)
            msg.Recv([buf, MPI.BYTE])
            if tag == TAG_END:
                self.ends += 1
                continue
            if tag == TAG_ABORT:
                kind, _, text = bytes(buf).decode(errors="replace").partition(":")
                raise (LayoutError if kind == "LayoutError" else ExchangeError)(text)
            raise ExchangeError(f"unexpected message tag {tag} from {self.ex.source} group rank {source}")
        MPI.Request.Waitall([r for r, _ in self.acks])
        ring.close()  # every generator node ended: trainers see the end once they drained the ring

    def _receive_batch(self, msg, source: int, count: int) -> None:
        """Receive straight into a ring record (no copy); a damaged batch is abandoned, never committed."""
        MPI = self.MPI
        fault_point("receiver")
        # Reserving blocks while the trainers are behind: that is the backpressure.
        with self.ex.ring.reserve(count) as view:
            msg.Recv([view, MPI.BYTE])
            error = None
            try:
                n_records = len(TrajectoryBatch.unpack(view))  # its arrays view the record and are gone at once
            except LayoutError as exc:
                error = f"batch from {self.ex.source} group rank {source} to {self.ex.dest} node {self.ex.world.node_name}: {exc}"
            if error is not None:  # raised outside the except: no traceback keeps views on the record
                raise LayoutError(error)  # the reservation is abandoned, never committed
        self.recv_msgs += 1
        self.recv_bytes += count
        self.recv_records += n_records
        ack = np.array([count], np.int64)
        self.acks.append((self.comm.Isend([ack, MPI.INT64_T], dest=source, tag=TAG_ACK), ack))

    def fail(self, exc):
        # Every trainer rank of the node must stop, not only this one: leave the error in the ring.
        reason = f"{type(exc).__name__}:{exc}".encode()
        try:
            self.ex.ring.push(_POISON + reason, timeout=5)
        except Exception:
            pass
        _unlink_quietly(self.ex.ring)
        try:  # the generator nodes stop too, instead of waiting for acknowledgements
            sources = [r.group_rank for r in self.ex.world.leaders(self.ex.source)]
            self.MPI.Request.Waitall([self.comm.Isend([reason, self.MPI.BYTE], dest=g, tag=TAG_ABORT) for g in sources])
        except Exception:
            pass

    def stats(self) -> dict:
        return {
            "received_msgs": self.recv_msgs,
            "received_bytes": self.recv_bytes,
            "received_records": self.recv_records,
            "ends": self.ends,
            "generator_nodes": self.n_sources,
            "rings": self.rings,
        }
