"""A reward worker process: `python -m rollout_hpc.rewards.worker PARENT_PID` (started by RewardPool, pool.py).

Protocol on stdin/stdout, each message a 4-byte little-endian length and a pickle:
  parent -> worker: ("init", factory, args, name, parent_sys_path) once,
                    then ("jobs", [(job_id, key, text), ...]) per chunk
  worker -> parent: ("ready", pid) or ("fatal", message, is_plugin_error) after init;
                    then one (job_id, status, payload) per job, written as soon as the job is done (the parent
                    times each job from the previous answer): status OK: payload float; ERROR (SAMPLE_ERROR when
                    the exception class has `sample_fault = True`): "TypeName: message";
                    BAD: "TypeName repr" (not a number).
The worker exits on end of input, and within 0.5 s of its parent's death (even in a hung job). It imports only the
standard library until the factory imports what it needs: start-up is one bare interpreter (tens of ms). User code
printing to stdout cannot corrupt the protocol: fd 1 is pointed at stderr and fd 0 at /dev/null; the protocol uses
duplicates. It never imports mpi4py. INT, TERM, USR1 and USR2 are ignored: the parent owns the worker's life (batch
shells forward signals to whole process groups; the rank decides, and close() or its death ends the worker).
"""

from __future__ import annotations

import io
import numbers
import os
import pickle
import signal
import struct
import sys
import threading
import time
from typing import cast

MSG_OK = 0
MSG_ERROR = 1
MSG_BAD = 3
MSG_SAMPLE_ERROR = 4  # the exception says the sample is at fault (`sample_fault = True`), not the reward
_HEADER = struct.Struct("<I")


def _write(fd: int, obj) -> None:
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    data = memoryview(_HEADER.pack(len(payload)) + payload)
    while data:
        n = os.write(fd, data)
        data = data[n:]


def _read(stream):
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (n,) = _HEADER.unpack(header)
    payload = stream.read(n)
    if len(payload) < n:
        return None
    return pickle.loads(payload)


def one_line(exc: BaseException, limit: int = 500) -> str:
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _die_with_parent(parent: int, period: float = 0.5) -> None:
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


def load_factory(spec: str, name: str):
    """The factory 'package.module:attr' or 'path/to/file.py:attr'. The common case imports the module directly;
    anything unusual or failing goes through rollout_hpc.plugins.load_plugin, whose errors say what to fix."""
    source, sep, attr = spec.rpartition(":")
    if sep and source and attr and not (source.endswith(".py") or "/" in source):
        try:
            import importlib

            return getattr(importlib.import_module(source), attr)
        except Exception:
            pass  # load_plugin repeats it and explains
    from rollout_hpc.plugins import load_plugin

    return load_plugin(spec, "reward factory")


def _result(job_id, fn, key, text):
    try:
        value = fn(key, text)
    except BaseException as exc:  # noqa: BLE001 - a reward's failure is the job's result, not the worker's
        return job_id, MSG_SAMPLE_ERROR if getattr(exc, "sample_fault", False) is True else MSG_ERROR, one_line(exc)
    if type(value) is float:
        return job_id, MSG_OK, value
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            return job_id, MSG_OK, float(value)
        except Exception:
            pass
    text = repr(value)
    return job_id, MSG_BAD, f"{type(value).__name__} {text[:200]}"


def main(argv: list[str]) -> int:
    parent = int(argv[1]) if len(argv) > 1 else 0
    _die_with_parent(parent)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    proto_in, proto_out = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    try:
        cast(io.TextIOWrapper, sys.stdout).reconfigure(line_buffering=True)  # typeshed: sys.stdout is a TextIO
    except Exception:
        pass
    stream = os.fdopen(proto_in, "rb", buffering=1 << 16)

    init = _read(stream)
    if init is None:
        return 0
    _, factory, args, name, parent_path = init
    for entry in parent_path:
        if entry not in sys.path:
            sys.path.append(entry)
    try:
        fn = load_factory(factory, name)(*args)
        if not callable(fn):
            raise TypeError(f"it returned {type(fn).__name__} {repr(fn)[:100]}, not a function fn(key, text) -> float")
    except BaseException as exc:  # noqa: BLE001
        # A PluginError (rollout_hpc.plugins) already says which plugin and what to fix: pass its message as is.
        plugin_error = any(c.__name__ == "PluginError" for c in type(exc).__mro__)
        _write(proto_out, ("fatal", " ".join(str(exc).split()) if plugin_error else one_line(exc, 2000), plugin_error))
        return 0
    _write(proto_out, ("ready", os.getpid()))

    while True:
        msg = _read(stream)
        if msg is None:
            return 0
        for job_id, key, text in msg[1]:
            _write(proto_out, _result(job_id, fn, key, text))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
