"""Worker processes a rank starts for user code that may crash, hang or print: reward functions (rewards/pool.py)
and environments (envs/workers.py). This module is their shared plumbing, both sides.

Workers are plain subprocesses (`python -m <module> PARENT_PID`), not multiprocessing children: they are started
inside MPI ranks (`python -m rollout_hpc.runtime.entry`); multiprocessing's spawn/forkserver would re-import that
main module (initialising MPI in the child) and fork after MPI_Init is unsafe. subprocess uses vfork+exec, and a
worker never imports mpi4py.

Protocol: stdin/stdout, each message a 4-byte little-endian length and a pickle. On the worker's side
`protocol_stdio()` moves the protocol to duplicates of fds 0 and 1, so user code printing to stdout cannot corrupt
it (fd 1 goes to stderr, fd 0 to /dev/null); `die_with_parent` ends the worker within 0.5 s of its parent's death,
even while a call of user code hangs. INT, TERM, USR1 and USR2 are ignored: the parent owns the worker's life (batch
shells forward signals to whole process groups, and slurmstepd signals every process of a job step; the rank decides,
and closing the worker's stdin or the rank's death ends it). From its first instruction: `spawn` starts the worker with
those signals blocked (a signal mask survives fork and exec), and the worker unblocks them only once it ignores them,
so a time-limit warning that arrives while a worker's interpreter starts stays pending and is then dropped. Before,
it killed the worker (the default action of USR1) and the rank ended the job instead of checkpointing: seen in the
Slurm fault-injection suite, a storm of warnings right after a requeued job started its reward workers.
"""

from __future__ import annotations

import io
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import BinaryIO, cast

HEADER = struct.Struct("<I")
JOB_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)  # the job's: the rank's to act on
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])


# --- the parent's side -------------------------------------------------------------------------------------------


def frame(obj) -> bytes:
    """One message as bytes on the wire."""
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(payload)) + payload


def spawn(module: str) -> subprocess.Popen:
    """Start `python -m module PARENT_PID` with pipes on stdin and stdout (stderr: the rank's)."""
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if _PACKAGE_ROOT not in paths:  # so `-m rollout_hpc...` resolves to this very package
        env["PYTHONPATH"] = os.pathsep.join([*paths, _PACKAGE_ROOT])
    # Blocked in this thread only while it starts the worker, which inherits the mask (the module docstring);
    # a signal for the rank meanwhile goes to one of its other threads, and Python runs the handler as usual.
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, JOB_SIGNALS)
    try:
        return subprocess.Popen(
            [sys.executable, "-m", module, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            bufsize=0,
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def send(proc: subprocess.Popen, data: bytes) -> bool:
    """Write a framed message to the worker; False when it is gone."""
    view = memoryview(data)
    assert proc.stdin is not None  # started with stdin=PIPE
    fd = proc.stdin.fileno()
    try:
        while view:
            n = os.write(fd, view)
            view = view[n:]
    except (BrokenPipeError, ConnectionResetError, OSError):
        return False
    return True


def split_messages(buf: bytearray) -> list:
    """The complete messages at the start of `buf` (removed from it); a partial one stays."""
    pos, out = 0, []
    while len(buf) - pos >= 4:
        (n,) = HEADER.unpack_from(buf, pos)
        if len(buf) - pos - 4 < n:
            break
        out.append(pickle.loads(memoryview(buf)[pos + 4 : pos + 4 + n]))
        pos += 4 + n
    del buf[:pos]
    return out


def exit_text(code: int | None) -> str:
    """How a worker ended, in words: 'worker died (exit code -9, SIGKILL)'."""
    if code is None:
        return "worker died"
    if code < 0:
        try:
            return f"worker died (exit code {code}, {signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"worker died (exit code {code})"


def reap(proc: subprocess.Popen) -> int | None:
    """Ends a worker for good: SIGKILL unless it already exited, then wait (no zombie)."""
    for stream in (proc.stdin, proc.stdout):
        try:
            if stream is not None:
                stream.close()
        except OSError:
            pass
    if proc.poll() is None:
        try:
            proc.kill()
        except OSError:
            pass
    try:
        return proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # unkillable (D state): leave it, never block the rank
        return None


def shutdown(procs: list[subprocess.Popen], owner: int) -> None:
    """Close every worker: end of input first (idle workers exit at once), SIGKILL what is left after 0.2 s.
    Only in the process that started them (a fork of the rank exiting must not kill the rank's workers)."""
    if os.getpid() != owner:
        return
    for proc in procs:
        assert proc.stdin is not None  # started with stdin=PIPE
        try:
            proc.stdin.close()
        except OSError:
            pass
    deadline = time.monotonic() + 0.2
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        reap(proc)
    procs.clear()


# --- the worker's side -------------------------------------------------------------------------------------------


def write_message(fd: int, obj) -> None:
    data = memoryview(frame(obj))
    while data:
        n = os.write(fd, data)
        data = data[n:]


def read_message(stream: BinaryIO):
    """The next message, or None at end of input (the parent closed it or died)."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (n,) = HEADER.unpack(header)
    payload = stream.read(n)
    if len(payload) < n:
        return None
    return pickle.loads(payload)


def one_line(exc: BaseException, limit: int = 500) -> str:
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def die_with_parent(parent: int, period: float = 0.5) -> None:
    """Exit when the parent process is gone, even while a job hangs: a daemon thread watches getppid().
    (Not prctl(PR_SET_PDEATHSIG): that fires when the parent *thread* that started us exits, and a rank may
    start its pool in a helper thread.)"""
    if not parent:
        return
    if os.getppid() != parent:
        os._exit(0)

    def watch() -> None:
        while True:
            time.sleep(period)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def start_worker(argv: list[str]) -> tuple[BinaryIO, int, tuple] | None:
    """A worker's start: protocol_stdio, then the parent's ("init", *args, parent_sys_path) message (the parent's
    sys.path is appended to ours: plugins import as in the rank). Returns (stream, out fd, args), or None when the
    parent closed the pipe first."""
    stream, out = protocol_stdio(argv)
    init = read_message(stream)
    if init is None:
        return None
    for entry in init[-1]:
        if entry not in sys.path:
            sys.path.append(entry)
    return stream, out, tuple(init[1:-1])


def protocol_stdio(argv: list[str]) -> tuple[BinaryIO, int]:
    """Set a worker up (argv[1] is its parent's pid): die with the parent, ignore the job's signals, move the
    protocol off fds 0 and 1. Returns (the stream to read messages from, the fd to write them to)."""
    die_with_parent(int(argv[1]) if len(argv) > 1 else 0)
    for sig in JOB_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, JOB_SIGNALS)  # blocked since spawn(): what came meanwhile is dropped
    proto_in, proto_out = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    try:
        cast(io.TextIOWrapper, sys.stdout).reconfigure(line_buffering=True)  # typeshed: sys.stdout is a TextIO
    except Exception:
        pass
    return os.fdopen(proto_in, "rb", buffering=1 << 16), proto_out
