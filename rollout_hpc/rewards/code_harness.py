"""The test harness inside the code reward's sandbox (docs/rewards.md, "Code"): `python -I harness.py`, one process
per test, as the sandbox's unprivileged user (code_runner.py starts it; code_sandbox.py judges what it reports).

It imports nothing but os and sys: every test starts an interpreter, and json alone would cost more than a small
test. Its descriptors: 0 the test's stdin, 1 and 2 its stdout and stderr, 3 the job (the repr of the test: kind,
code / fn and args; never the expected output), 4 its records, one repr(dict) per line (read with ast.literal_eval):
{"pid", "status": "pass" | "fail" | "ran", "detail", "value": repr of a call's result} when the test finished, or
{"pid", "violation": what} when the program broke a rule. An audit hook (PEP 578: it cannot be removed) reports
network use, writes outside the working directory, reads the uid may not make and signals to other processes.
"""

from __future__ import annotations

import os
import sys

JOB_FD, RESULT_FD = 3, 4
_VIOLATION_ERRNOS = {  # uncaught OSErrors that mean a limit was hit
    11: "hit the process limit (a fork bomb?)",  # EAGAIN from fork
    27: "wrote more than the file-size limit",  # EFBIG
    28: "filled its disk space",  # ENOSPC
}


class _Report:
    """Writes the harness's records to fd 4; the bytes of a memory violation are ready before memory runs out."""

    memory = b""

    def __init__(self) -> None:
        _Report.memory = self.line({"violation": "ran out of memory (the memory limit)"})

    def line(self, record: dict) -> bytes:
        return (repr({"pid": os.getpid(), **record}) + "\n").encode()  # read back with ast.literal_eval

    def write(self, data: bytes) -> None:
        try:
            os.write(RESULT_FD, data)
        except OSError:
            pass

    def violation(self, what: str) -> None:
        self.write(self.line({"violation": what}))

    def done(self, status: str, detail: str = "", value: str | None = None) -> None:
        self.write(self.line({"status": status, "detail": detail[:500], "value": value}))


def _audit_hook(report: _Report, workdir: str):
    net = (2, 10)  # AF_INET, AF_INET6 (importing socket would cost every test a few ms)
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    parent = os.getppid()

    def inside(path: str) -> bool:
        path = os.path.normpath(os.path.join(workdir, path))
        return path == workdir or path.startswith(workdir + os.sep) or path in ("/dev/null", "/dev/stdout")

    def may_read(path: str) -> bool:
        try:
            os.stat(path)
        except PermissionError:
            return False
        except (OSError, ValueError):
            return True  # a missing file: open's own error, not a violation
        return os.access(path, os.R_OK)

    def deny(what: str):
        report.violation(what)
        raise PermissionError(f"sandbox: {what}")

    def hook(event: str, args: tuple) -> None:
        if event in ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"):
            if getattr(args[0], "family", None) in net:
                deny(f"used the network ({event.split('.')[1]} {args[1]!r})")
        elif event == "open":
            path, mode, flags = args
            if not isinstance(path, (str, bytes)):
                return
            path = os.fsdecode(path)
            writes = (flags or 0) & write_flags or any(c in (mode or "") for c in "wax+")
            if writes and not inside(path):
                deny(f"wrote outside its directory ({path})")
            if not writes and not may_read(path):
                deny(f"read a file it may not read ({path})")
        elif event in ("os.listdir", "os.scandir"):
            path = args[0]
            if isinstance(path, (str, bytes)) and not may_read(os.fsdecode(path)):
                deny(f"listed a directory it may not read ({os.fsdecode(path)})")
        elif event == "os.kill":
            pid = args[0]
            if pid <= 1 or pid == parent:
                deny(f"sent a signal to process {pid}")
        elif event == "os.killpg":
            deny("sent a signal to a process group")

    return hook


def _run_program(report: _Report, source: str, kind: str) -> tuple[dict | None, str | None]:
    """Runs the program: (its globals, None) or (None, why the test failed). A violation ends the
    harness (reported)."""
    # A stdin/stdout program is the main program; under assert and call tests it is a module, so its
    # `if __name__ == "__main__":` demo (often reading input()) does not run.
    name = "__main__" if kind == "stdio" else "solution"
    scope: dict = {"__name__": name, "__builtins__": __builtins__}
    try:
        exec(compile(source, "program.py", "exec"), scope)
    except SystemExit as exc:
        if kind == "stdio":
            return (scope, None) if exc.code in (None, 0) else (None, f"exit status {exc.code}")
        report.violation("called sys.exit before its tests ran")
        os._exit(0)
    except BaseException as exc:  # noqa: BLE001
        return None, _failure(report, exc)
    return scope, None


def _failure(report: _Report, exc: BaseException) -> str:
    """Why a test failed, or a reported violation (memory, file size) that ends the harness."""
    if isinstance(exc, MemoryError):
        report.write(_Report.memory)
        os._exit(0)
    if isinstance(exc, OSError) and exc.errno in _VIOLATION_ERRNOS:
        report.violation(_VIOLATION_ERRNOS[exc.errno])
        os._exit(0)
    if isinstance(exc, SystemExit):
        report.violation("called sys.exit during its tests")
        os._exit(0)
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return " ".join(text.split())


def _call_function(scope: dict, name: str):
    fn = scope.get(name)
    if fn is None and isinstance(scope.get("Solution"), type):  # LeetCode style: class Solution with the method
        fn = getattr(scope["Solution"](), name, None)
    if not callable(fn):
        raise NameError(f"the program defines no function {name!r}")
    return fn


def _read_job() -> dict:
    chunks = []
    while chunk := os.read(JOB_FD, 1 << 20):
        chunks.append(chunk)
    os.close(JOB_FD)
    # init wrote the repr of plain data (str, numbers, lists, dicts) before the program could run
    return eval(b"".join(chunks).decode(), {"__builtins__": {}, "nan": float("nan"), "inf": float("inf")})


def main() -> int:
    report = _Report()
    job = _read_job()
    sys.addaudithook(_audit_hook(report, os.getcwd()))
    with open("program.py", encoding="utf-8") as f:
        source = f.read()
    kind = job["kind"]
    scope, why = _run_program(report, source, kind)
    if scope is None:
        report.done("fail", why or "")
        return 0
    value = None
    try:
        if kind == "assert":
            exec(compile(job["code"], "test.py", "exec"), scope)
        elif kind == "call":
            value = repr(_call_function(scope, job["fn"])(*job["args"]))
        sys.stdout.flush()
    except BaseException as exc:  # noqa: BLE001
        report.done("fail", _failure(report, exc))
        return 0
    report.done("pass" if kind == "assert" else "ran", value=value)
    return 0


if __name__ == "__main__":
    sys.exit(main())
