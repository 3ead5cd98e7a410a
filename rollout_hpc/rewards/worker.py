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
standard library until the factory imports what it needs: start-up is one bare interpreter (tens of ms). Its stdio,
signals and wire format: rollout_hpc/worker_process.py.
"""

from __future__ import annotations

import numbers
import os
import sys

from rollout_hpc.worker_process import one_line, read_message, start_worker, write_message

MSG_OK = 0
MSG_ERROR = 1
MSG_BAD = 3
MSG_SAMPLE_ERROR = 4  # the exception says the sample is at fault (`sample_fault = True`), not the reward


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


def job_answer(job_id, fn, key, text):
    """(job_id, status, payload) of scoring one job with `fn` (the module docstring's protocol)."""
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


def factory_failure(exc: BaseException) -> tuple[str, bool]:
    """(message, is_plugin_error) of a factory that failed. A PluginError (rollout_hpc.plugins) already says which
    plugin and what to fix: its message as is; anything else as "TypeName: message"."""
    plugin_error = any(c.__name__ == "PluginError" for c in type(exc).__mro__)
    return (" ".join(str(exc).split()) if plugin_error else one_line(exc, 2000)), plugin_error


def main(argv: list[str]) -> int:
    started = start_worker(argv)
    if started is None:
        return 0
    stream, proto_out, (factory, args, name) = started
    try:
        fn = load_factory(factory, name)(*args)
        if not callable(fn):
            raise TypeError(f"it returned {type(fn).__name__} {repr(fn)[:100]}, not a function fn(key, text) -> float")
    except BaseException as exc:  # noqa: BLE001
        write_message(proto_out, ("fatal", *factory_failure(exc)))
        return 0
    write_message(proto_out, ("ready", os.getpid()))

    while True:
        msg = read_message(stream)
        if msg is None:
            return 0
        for job_id, key, text in msg[1]:
            write_message(proto_out, job_answer(job_id, fn, key, text))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
