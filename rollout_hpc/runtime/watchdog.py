"""No silent hangs: one watchdog per rank ends a job that stopped making progress, and a failing thread ends the job.

Three rules, on every rank of a run (docs/resume.md, "Hangs and failing threads"):

- A thread that dies of an exception ends the whole job at once (threading.excepthook: the error, then
  MPI_Abort), instead of leaving the main thread waiting for something that thread would have done.
- Waits on other ranks are slices (`waiting()` between them): a waiting rank is not hung (its peer is the one to
  judge), and the trainers' wait for a step's experience ends on a stop signal or a hang report
  (`interruption()`), so they checkpoint what they have instead of waiting forever.
- A rank that makes no progress (`beat()`: a step done, or a slice of a wait) for `run.hang_timeout` seconds is
  hung: it writes its Python stacks to RUN_DIR/logs/stacks-rank<R>.txt, asks every other rank to do the same
  (a message to each rank's watchdog thread on a communicator of its own), lets trainers that wait at a step
  boundary checkpoint, and ends the job with a message naming the rank, its last step and where the stacks are.
  A rank whose watchdog thread cannot run at all (a C call holding the GIL) is ended by faulthandler's own
  timer (no GIL needed), with its stacks in the rank's log.

The clock starts at the first beat (after start-up: model load, first weights), so slow start-ups do not count.
"""

from __future__ import annotations

import faulthandler
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from rollout_hpc.errors import UserError
from rollout_hpc.rundir_layout import LOGS
from rollout_hpc.runtime import checkpointing
from rollout_hpc.runtime.world import abort_world

_TAG_HANG, _TAG_ACK = 41, 42
WAIT_SLICE_S = 0.25  # how often a wait on another rank looks at stop signals and hang reports
# A wait gives up on a stop signal this long after it came: MPI_Abort elsewhere also sends SIGTERM (then SIGKILL
# within a second), and a checkpoint begun in that second would be cut off, leaving a partial file.
STOP_WAIT_S = 2.0
ACK_WAIT_S = 5.0  # how long the rank that found a hang waits for the others' stacks
EXIT_HANG = 3  # the exit code of a job ended by the watchdog


class Interrupted(Exception):
    """A wait was given up: a stop signal (`stop`) or another rank's hang report (`hang`)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind

    @property
    def stop(self) -> bool:
        return self.kind == "stop"


_current: Watchdog | None = None
_stop_seen: float | None = None  # when a wait first saw the stop signal


def beat(step: int | None = None) -> None:
    """Progress on this rank (`step`: steps done so far, for the message). No-op without a watchdog."""
    if _current is not None:
        _current.beat(step)


def waiting() -> None:
    """Between slices of a wait on another rank: that is not a hang of this rank."""
    if _current is not None:
        _current.beat(None, waiting=True)


def interruption() -> Interrupted | None:
    """Why a wait should end now: a stop signal, or a hang reported by any rank; None to go on waiting."""
    if _current is not None and _current.hang_report is not None:
        return Interrupted("hang", _current.hang_report)
    global _stop_seen
    if checkpointing.stop_signalled():
        _stop_seen = _stop_seen or time.monotonic()
        if time.monotonic() - _stop_seen >= STOP_WAIT_S:
            return Interrupted("stop", "a stop signal (SIGUSR1/SIGTERM) arrived")
    return None


def record_stacks(why: str) -> None:
    """This rank's stacks into its stacks file unless they are there already: for a rank that heard of a hang from
    a peer (the trainers' allgather) before its watchdog thread served the report, and is about to end the job."""
    if _current is not None:
        _current.dump_once(why)


def _thread_failed(args: threading.ExceptHookArgs) -> None:
    """Any thread of a rank dying of an exception ends the job: the main thread may be waiting for it."""
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    if isinstance(args.exc_value, UserError):
        abort_world(f"thread '{name}': {args.exc_value}", 2)
        return
    traceback.print_exception(args.exc_type, args.exc_value, args.exc_traceback, file=sys.stderr)
    abort_world(f"thread '{name}' failed: {args.exc_type.__name__}: {args.exc_value}", 1)


def _where(thread_id: int | None) -> str:
    """'file:line in function' of a thread's innermost frame."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


class Watchdog:
    """Collective constructor over the whole world (it duplicates COMM_WORLD); `close()` on every rank."""

    def __init__(self, world, cfg, run_dir: Path):
        global _current
        self.world, self.timeout = world, float(cfg.run.hang_timeout)
        self.comm = world.comm.Dup()
        self.logs = Path(run_dir) / LOGS
        self.stacks_path = self.logs / f"stacks-rank{world.rank}.txt"
        self.last_beat: float | None = None  # None until the first beat: start-up is not timed
        self.last_step: int | None = None
        self.in_wait = False
        self.hang_report: str | None = None
        self._stacks_file = None
        self._dump_lock = threading.Lock()  # the watchdog thread and the main thread (record_stacks) both dump
        self._dumped = False
        self._stop = threading.Event()
        self._tick = min(1.0, max(0.05, self.timeout / 10)) if self.timeout > 0 else 0.25
        self._previous_hook, threading.excepthook = threading.excepthook, _thread_failed
        self._thread = threading.Thread(target=self._run, name="hang-watchdog", daemon=True)
        _current = self
        self._thread.start()

    def beat(self, step: int | None = None, waiting: bool = False) -> None:
        self.last_beat = time.monotonic()
        self.in_wait = waiting
        if step is not None:
            self.last_step = step

    def close(self) -> None:
        global _current
        self._stop.set()
        self._thread.join()
        faulthandler.cancel_dump_traceback_later()
        threading.excepthook = self._previous_hook
        if _current is self:
            _current = None

    # --- the watchdog thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self._tick):
            self._serve()
            if self.timeout <= 0 or self.last_beat is None:
                continue
            # Backstop for a main thread that holds the GIL forever (this thread then never runs again).
            faulthandler.dump_traceback_later(self.timeout + 60, exit=True, file=sys.stderr)  # the rank's log
            idle = time.monotonic() - self.last_beat
            if idle > self.timeout and self.hang_report is None:
                self._hung(idle)
                return

    def _stacks(self):
        if self._stacks_file is None:
            self.logs.mkdir(parents=True, exist_ok=True)
            self._stacks_file = open(self.stacks_path, "a")
        return self._stacks_file

    def dump_once(self, why: str) -> None:
        with self._dump_lock:  # checked and written under one lock: two threads never both write
            if not self._dumped:
                self._write_stacks(why)

    def _dump(self, why: str) -> None:
        """This rank's Python stacks (every thread) into its stacks file; py-spy's view too where installed."""
        with self._dump_lock:
            self._write_stacks(why)

    def _write_stacks(self, why: str) -> None:
        self._dumped = True
        f = self._stacks()
        w = self.world
        f.write(f"=== rank {w.rank} ({w.role}, node {w.node_name}, pid {os.getpid()}) {time.ctime()}: {why}\n")
        f.flush()
        faulthandler.dump_traceback(f, all_threads=True)
        spy = shutil.which("py-spy")
        if spy:
            try:
                subprocess.run([spy, "dump", "--pid", str(os.getpid())], stdout=f, stderr=f, timeout=30)
            except (OSError, subprocess.TimeoutExpired) as exc:
                f.write(f"py-spy dump failed: {exc}\n")
        f.flush()

    def _serve(self) -> None:
        """Answer other ranks' hang reports: dump this rank's stacks, say whether it will checkpoint."""
        MPI = _mpi()
        status = MPI.Status()
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=_TAG_HANG, status=status):
            report = json.loads(self.comm.recv(source=status.Get_source(), tag=_TAG_HANG))
            self._dump(f"stacks asked for by rank {status.Get_source()}: {report}")
            self.hang_report = self.hang_report or report
            # A trainer waiting at a step boundary checkpoints what it has, then ends the job itself.
            saves = self.world.is_trainer and self.in_wait
            self.comm.send(saves, dest=status.Get_source(), tag=_TAG_ACK)

    def _hung(self, idle: float) -> None:
        faulthandler.cancel_dump_traceback_later()  # this thread ends the job from here
        w = self.world
        step = "before its first step" if not self.last_step else f"after step {self.last_step}"
        where = _where(threading.main_thread().ident)
        report = f"rank {w.rank} ({w.role}, node {w.node_name}) made no progress for {idle:.0f}s {step}"
        self.hang_report = report
        self._dump(f"{report}; main thread in {where}")
        # Said before the others hear of it: a trainer that checkpoints may end the job (MPI_Abort) at once.
        message = (
            f"{report} (run.hang_timeout {self.timeout:g}s); its main thread is in {where}. Every rank's Python "
            f"stacks are in {self.logs}/stacks-rank*.txt. Ending the job; if a step can take this long, "
            "raise run.hang_timeout"
        )
        print(f"rollout-hpc: hang: {message}", file=sys.stderr, flush=True)
        others = [r for r in range(w.size) if r != w.rank]
        for r in others:
            self.comm.send(json.dumps(report), dest=r, tag=_TAG_HANG)
        acks, saving, deadline = 0, False, time.monotonic() + ACK_WAIT_S
        MPI = _mpi()
        while acks < len(others) and time.monotonic() < deadline:
            self._serve()
            if self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=_TAG_ACK):
                saving |= bool(self.comm.recv(source=MPI.ANY_SOURCE, tag=_TAG_ACK))
                acks += 1
            else:
                time.sleep(0.01)
        if acks < len(others):
            print(
                f"rollout-hpc: hang: {len(others) - acks} rank(s) did not answer: no stacks from them",
                file=sys.stderr,
                flush=True,
            )
        if saving:  # the trainers checkpoint and end the job; end it here only if they cannot
            time.sleep(max(self.timeout, 60.0))
        abort_world(f"hang: {report}; ending the job", EXIT_HANG)


def _mpi():
    from mpi4py import MPI  # initialised by runtime.world before any watchdog exists

    return MPI
