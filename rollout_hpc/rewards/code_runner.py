"""The process side of the code reward's sandbox (docs/rewards.md, "Code"). Standard library only: it runs as a
script (`python -I -S code_runner.py`, the spec as JSON on stdin) outside the package's import path. The reward side
(parsing tests, comparing outputs) is code_sandbox.py; the harness that runs inside the sandbox is code_harness.py.

Two roles, and the harness they start:
- runner: enters new network, PID and mount namespaces (not as root: inside a new user namespace) where the kernel
  allows, else notes why not; forks the sandbox's init and relays init's JSON lines (one per test) to stdout.
- init (PID 1 of the new PID namespace): private tmpfs mounts (nosuid, nodev, noexec) over the usual world-writable
  directories (/tmp, /var/tmp, /dev/shm, /run/lock); per test, forks a child that takes the resource limits and (as root) an unprivileged uid, then execs the harness; after each test
  it kills whatever the test left running (in the PID namespace: every other process in it).
- harness (code_harness.py, copied in as harness.py, run by the sandbox's python as that uid): runs the program and
  one test and reports through fd 4, its audit hook any violation (the sample is then an error).
Runner and init die with their parent (PR_SET_PDEATHSIG), and init's death ends every process of its namespace.
"""

from __future__ import annotations

import ast
import ctypes
import json
import os
import select
import signal
import sys
import time

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x4000, 0x40000
PR_SET_PDEATHSIG = 1
TMPFS_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/var/lock")  # the usual world-writable directories
WORKDIR_IN_NS = "/tmp/work"


# ------------------------------------------------------------------------------------------------ libc calls


LIBC = ctypes.CDLL(None, use_errno=True)


def _call(name: str, *args) -> str | None:
    """A libc call; None when it worked, else the error text."""
    if getattr(LIBC, name)(*args) == 0:
        return None
    return f"{name}: {os.strerror(ctypes.get_errno())}"


def _die_with_parent() -> None:
    _call("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _mount(source: bytes | None, target: str, fstype: bytes | None, flags: int, data: bytes | None) -> str | None:
    return _call("mount", source, target.encode(), fstype, flags, data)


# ---------------------------------------------------------------------------------------------------- runner


def runner_main() -> int:
    spec = json.load(sys.stdin)
    _die_with_parent()
    root = os.geteuid() == 0
    # As root the test drops to spec's uid; otherwise it stays the rank's user, whose every process counts
    # against RLIMIT_NPROC (counted now: inside a user namespace /proc and the ids read differently).
    iso = {"network": False, "pid": False, "mount": False, "user_ns": False, "why": ""}
    iso["uid"] = spec["uid"] if root else os.geteuid()
    spec["drop_to"] = (spec["uid"], spec["gid"]) if root else None
    if not root:
        spec["max_procs"] = _processes_of(os.geteuid()) + int(spec["max_procs"])
    why = _enter_namespaces(root)
    if why is None:
        iso.update(network=True, pid=True, mount=True, user_ns=not root)
    else:
        iso["why"] = why
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # init (PID 1 of the new PID namespace when there is one)
        os.close(read_end)
        code = 0
        try:
            init_main(spec, write_end, iso)
        except BaseException as exc:  # noqa: BLE001 - reported as this sample's sandbox error
            _emit(write_end, {"error": f"sandbox init failed: {type(exc).__name__}: {exc}"})
            code = 1
        os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as lines:
        for line in lines:
            sys.stdout.buffer.write(line)
            sys.stdout.flush()
    _, status = os.waitpid(pid, 0)
    if status:
        print(json.dumps({"error": f"sandbox init ended with wait status {status}"}), flush=True)
    return 0


def _enter_namespaces(root: bool) -> str | None:
    """New mount, PID (for the next child) and network namespaces; not as root, inside a new user namespace where
    this user is root (unprivileged user namespaces: where the kernel allows them). None, or why not."""
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET
    if root:
        return _call("unshare", flags)
    uid, gid = os.geteuid(), os.getegid()
    why = _call("unshare", CLONE_NEWUSER | flags)
    if why:
        return f"not root, and no user namespace ({why})"
    try:
        for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    except OSError as exc:
        return f"user namespace id maps: {exc}"
    return None


def _emit(fd: int, record: dict) -> None:
    data = (json.dumps(record) + "\n").encode()
    while data:
        data = data[os.write(fd, data) :]


# ------------------------------------------------------------------------------------------------------ init


def init_main(spec: dict, out: int, iso: dict) -> None:
    _die_with_parent()
    workdir = spec["workdir"]
    if iso["mount"]:
        why = _private_tmpfs(spec, iso)
        if why is None:
            workdir = WORKDIR_IN_NS
        else:
            iso["mount"], iso["why"] = False, why
    uid, gid = spec["drop_to"] or (None, None)
    os.makedirs(workdir, mode=0o700, exist_ok=True)
    if uid is not None and gid is not None:
        os.chown(workdir, uid, gid)
    for name, text in (("harness.py", spec["harness"]), ("program.py", spec["program"])):
        path = os.path.join(workdir, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(path, 0o444)
    _emit(out, {"isolation": iso})
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "PYTHONHASHSEED": "0"}
    for index, test in enumerate(spec["tests"]):
        result = run_test(spec, test, workdir, uid, gid, env, iso["pid"])
        result["test"] = index
        _emit(out, result)
        if result["outcome"] != "ran":
            break  # a violation or a sandbox failure: the sample is an error, the other tests cannot change that


def _processes_of(uid: int) -> int:
    count = 0
    for entry in os.listdir("/proc"):
        try:
            count += entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == uid
        except OSError:
            pass
    return count


def _private_tmpfs(spec: dict, iso: dict) -> str | None:
    """Mounts of this namespace only: nothing propagates back; fresh size-limited tmpfs over the shared writable
    directories (the working directory is inside /tmp; noexec: no binary or library it writes can run); a /proc
    that shows this PID namespace only."""
    why = _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    if why:
        return why
    size = f"size={int(spec['tmpfs_mb'])}m,mode=1777".encode()
    for target in TMPFS_DIRS:
        if os.path.isdir(target) and not os.path.islink(target):
            why = _mount(b"tmpfs", target, b"tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, size)
            if why:
                return f"{why} ({target})"
    if iso["pid"]:
        _mount(b"proc", "/proc", b"proc", MS_NOSUID | MS_NODEV, None)  # best effort: ps inside sees only its own
    return None


def _memfd(name: str, data: bytes = b"") -> int:
    fd = os.memfd_create(name, 0)
    if data:
        os.write(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _read_all(fd: int, limit: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks, size = [], 0
    while size < limit:
        chunk = os.read(fd, min(1 << 20, limit - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _limits(spec: dict):
    import resource

    cpu = max(1, int(-(-float(spec["timeout_s"]) // 1)))
    mem = int(spec["memory_mb"]) << 20
    fsize = int(spec["file_mb"]) << 20
    return [
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_AS, (mem, mem)),
        (resource.RLIMIT_FSIZE, (fsize, fsize)),
        (resource.RLIMIT_NPROC, (int(spec["max_procs"]), int(spec["max_procs"]))),
        (resource.RLIMIT_NOFILE, (256, 256)),
        (resource.RLIMIT_CORE, (0, 0)),
    ]


def _exec_child(spec, workdir, fds, uid, gid, env) -> None:
    """In the forked child: its own process group, the test's files on fds 0-4, limits, the unprivileged uid, exec."""
    import fcntl
    import resource

    try:
        os.setpgid(0, 0)
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 100) for fd in fds]  # clear of 0-4 while placing them
        for slot, fd in enumerate(high):
            os.dup2(fd, slot)
        os.closerange(len(fds), os.sysconf("SC_OPEN_MAX"))
        os.chdir(workdir)
        for which, value in _limits(spec):
            resource.setrlimit(which, value)
        if uid is not None:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
        _die_with_parent()
        python = spec["python"]
        os.execve(python, [python, "-I", os.path.join(workdir, "harness.py")], env)
    except BaseException as exc:  # noqa: BLE001
        os.write(2, f"sandbox: could not start {spec['python']}: {type(exc).__name__}: {exc}".encode())
    os._exit(127)


def _wait(pid: int, timeout: float) -> tuple[int | None, bool]:
    """(wait status, timed out); the child is SIGKILLed at the deadline."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        pidfd = None
    deadline = time.monotonic() + timeout
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return status, False
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                return os.waitpid(pid, 0)[1], True
            if pidfd is not None:
                select.select([pidfd], [], [], left)
            else:
                time.sleep(min(left, 0.005))
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _clear_leftovers(pid: int, pid_ns: bool) -> bool:
    """Kills what the test left running; True when there was something. In a PID namespace init signals -1
    (every other process of the namespace); without one only the child's process group can be reached."""
    if pid_ns and os.getpid() == 1:  # never kill(-1) outside a namespace of our own
        target = -1
    else:
        target = -pid
    try:
        os.kill(target, 0)
    except (ProcessLookupError, PermissionError):
        return False
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            os.kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            break
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        time.sleep(0.005)
    return True


def run_test(spec, test, workdir, uid, gid, env, pid_ns) -> dict:
    stdin = test.get("input", "") if test["kind"] == "stdio" else ""
    fds = [
        _memfd("stdin", stdin.encode()),
        _memfd("stdout"),
        _memfd("stderr"),
        _memfd("job", repr(test).encode()),  # the harness evals it: it imports nothing it does not need
        _memfd("result"),
    ]
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _exec_child(spec, workdir, fds, uid, gid, env)
    try:
        status, timed_out = _wait(pid, float(spec["timeout_s"]))
        leftovers = _clear_leftovers(pid, pid_ns)
        limit = (int(spec["file_mb"]) << 20) + 1
        out = _read_all(fds[1], limit).decode("utf-8", "replace")
        err = _read_all(fds[2], 4096).decode("utf-8", "replace")
        reports = [_parse(line) for line in _read_all(fds[4], limit).decode("utf-8", "replace").splitlines()]
    finally:
        for fd in fds:
            os.close(fd)
    result = {"seconds": round(time.monotonic() - started, 4), "stdout": out}
    violation = next((r["violation"] for r in reports if r.get("violation")), None)
    done = next((r for r in reports if r.get("pid") == pid and "status" in r), None)  # not a forked copy's
    if timed_out:
        violation = violation or f"ran past the {spec['timeout_s']:g}s time limit"
    elif status is not None and os.WIFSIGNALED(status):
        violation = violation or _signal_text(os.WTERMSIG(status))
    elif done is None and status is not None and os.WEXITSTATUS(status) == 127 and err.startswith("sandbox:"):
        return {**result, "outcome": "error", "detail": err.strip()}
    if violation is None and done is None:
        violation = "ended its process before the test finished (os._exit, exec or closing fd 4)"
    if violation is None and leftovers:
        violation = "left processes running after the test (a fork bomb or a daemon)"
    if violation is not None:
        return {**result, "outcome": "violation", "detail": violation}
    assert done is not None
    value = _jsonable(_literal(done["value"])) if isinstance(done.get("value"), str) else None
    return {**result, "outcome": "ran", "status": done["status"], "detail": str(done.get("detail", "")),
            "value": value}  # fmt: skip


def _literal(text: str):
    """A Python literal written by the sandbox (ast.literal_eval evaluates no code); the text itself otherwise."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return {"__repr__": text}


def _parse(line: str) -> dict:
    record = _literal(line)
    return record if isinstance(record, dict) and "__repr__" not in record else {}


def _signal_text(sig: int) -> str:
    reasons: dict[int, str] = {
        signal.SIGXCPU: "ran past the CPU-time limit",
        signal.SIGXFSZ: "wrote more than the file-size limit",
        signal.SIGKILL: "was killed (SIGKILL: out of memory?)",
        signal.SIGSEGV: "crashed (SIGSEGV: the memory limit?)",
        signal.SIGABRT: "aborted (SIGABRT: the memory limit?)",
    }
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    return reasons.get(sig, f"was killed by {name}")


def _jsonable(value):
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return {"__repr__": repr(value)}


if __name__ == "__main__":
    sys.exit(runner_main())
