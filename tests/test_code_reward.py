"""The sandboxed `code` reward (rollout_hpc/rewards/code_sandbox.py + code_runner.py): the program is the response's
last fenced block, the reward the share of the row's tests passed, in every test format datasets use (asserts,
stdin/stdout pairs, call-based; also as JSON strings). Hostile programs run for real in the sandbox and each costs
its sample 0 and a counted reward error, never the run or the machine: after each, no process of the sandbox uid
and no sandbox directory is left, and a server listening on 127.0.0.1 saw no connection. A SandboxFusion service is
stood in for by a small HTTP server on 127.0.0.1 that runs the code; a tiny model trains a few steps on a code
dataset under the local launcher."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_resume_local import cli
from tiny_hf import make_tiny_qwen

from rollout_hpc.envs.registry import load_task
from rollout_hpc.errors import RewardFatal, RewardSpecError, UserError
from rollout_hpc.rewards import REWARD_ERROR, REWARD_OK, REWARD_TIMEOUT, RewardPool, builtin_reward
from rollout_hpc.rewards.code_runner import TMPFS_DIRS
from rollout_hpc.rewards.code_sandbox import (
    CodeLimits,
    CodeSandboxError,
    CodeTestsError,
    LocalSandbox,
    SandboxFusion,
    code_limits,
    code_reward,
    extract_program,
    parse_tests,
)
from rollout_hpc.store.trajlog import TrajectoryReader

ADD = "def add(a, b):\n    return a + b\n"
DOUBLE = "n = int(input())\nprint(n * 2)   \n"  # trailing spaces: compared per line without them


def fenced(program: str, lang: str = "python") -> str:
    return f"Here is my solution.\n```{lang}\n{program}```\nDone."


# ---------------------------------------------------------------------------------------------- the machine


def sandbox_uid() -> int:
    return pwd.getpwnam("nobody").pw_uid


def processes_of(uid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    found.append(int(entry))
            except OSError:
                pass
    return found


def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def sandbox_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("rollout-code-*")}


class Listener:
    """A TCP server on 127.0.0.1 that counts the connections it accepts (none may come from a sandbox)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


@pytest.fixture(scope="module")
def sandbox() -> LocalSandbox:
    return LocalSandbox(CodeLimits(timeout_s=1.5, memory_mb=256, max_procs=16, file_mb=2))


@pytest.fixture(scope="module")
def listener():
    server = Listener()
    yield server
    server.close()


@pytest.fixture(scope="module")
def run_dir():
    """A stand-in for a run directory: root-owned, 0700, outside /tmp (which the sandbox replaces by its own)."""
    # Not under a directory the sandbox hides (a checkout cloned into /tmp would put it there): the program must
    # meet the run directory's permissions, not an empty tmpfs.
    hidden = [Path(d) for d in TMPFS_DIRS]
    bases = [Path(__file__).resolve().parents[2], Path.home(), Path("/var/lib")]
    base = next(b for b in bases if os.access(b, os.W_OK) and not any(b == h or h in b.parents for h in hidden))
    path = Path(tempfile.mkdtemp(prefix="rollout-code-test-run-", dir=base))
    (path / "config.resolved.yaml").write_text("secret: 1\n")
    path.chmod(0o700)
    yield path
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


# ------------------------------------------------------------------------------------------ program and tests


def test_the_program_is_the_last_fenced_python_block():
    text = "```python\nprint(1)\n```\nbetter:\n```py\nprint(2)\n```\n```bash\nls\n```"
    assert extract_program(text) == "print(2)\n"
    assert extract_program("```\nx = 1\n```") == "x = 1\n"
    assert extract_program("```Python3 title\nx = 2\n```") == "x = 2\n"
    for none in ("print(1)", "```python\nprint(1)", "```bash\nls\n```", "```python\n\n```", "", None):
        assert extract_program(none) is None


def test_test_case_formats():
    mbpp = ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]
    assert [t["code"] for t in parse_tests(mbpp)] == mbpp
    assert parse_tests(json.dumps(mbpp)) == parse_tests(mbpp)  # a JSON string of the list
    code = parse_tests("import math\nassert add(1, 2) == 3\nassert math.isclose(add(0.1, 0.2), 0.3)\n")
    assert len(code) == 2 and all(t["code"].startswith("import math\n") for t in code)  # setup before each assert
    humaneval = parse_tests({"test": "def check(candidate):\n    assert candidate(1, 2) == 3\n", "entry_point": "add"})
    assert len(humaneval) == 1 and humaneval[0]["code"].endswith("check(add)")
    mbpp_row = parse_tests({"test_list": mbpp, "test_setup_code": "import os"})
    assert len(mbpp_row) == 2 and mbpp_row[0]["code"].startswith("import os\n")
    io = {"inputs": ["2\n", ["3"]], "outputs": ["4\n", ["6"]]}
    stdio = parse_tests(io)
    assert [(t["kind"], t["input"], t["expected"]) for t in stdio] == [("stdio", "2\n", "4\n"), ("stdio", "3\n", "6\n")]
    assert parse_tests(json.dumps(json.dumps(io))) == stdio  # doubly encoded, as some parquet files hold it
    assert parse_tests([{"input": "2\n", "output": "4\n"}])[0]["expected"] == "4\n"
    assert parse_tests(str(mbpp)) == parse_tests(mbpp)  # str() of a Python list, as some datasets store it
    call = parse_tests({"inputs": [[1, 2], "3\n4"], "outputs": [[3], 7], "fn_name": "add"})
    assert [(t["kind"], t["fn"], t["args"], t["expected"]) for t in call] == [
        ("call", "add", [1, 2], [3]),
        ("call", "add", [3, 4], 7),  # a string input: one JSON argument per line
    ]
    never_called = "def check(candidate):\n    assert candidate(1, 2) == 3\n"  # a HumanEval 'test' column alone
    for bad in ({"inputs": ["1"], "outputs": []}, {"question": "?"}, [], "", 42, None, never_called):
        with pytest.raises(CodeTestsError):
            parse_tests(bad)


def test_share_of_tests_passed_in_every_format(sandbox):
    assert sandbox.run(ADD, parse_tests(["assert add(1, 2) == 3", "assert add(2, 2) == 5", "assert add(0, 0) == 0"]))
    assert sandbox.run(ADD, parse_tests(["assert add(1, 2) == 3", "assert add(2, 2) == 5"])) == [True, False]
    io = json.dumps({"inputs": ["2\n", "5\n", "x\n"], "outputs": ["4\n\n", "11", "0"]})
    assert sandbox.run(DOUBLE, parse_tests(io)) == [True, False, False]  # wrong answer; ValueError on "x"
    call = {"inputs": [[1, 2], [[1], [2]], [3, 4]], "outputs": [[3], [[1, 2]], 8], "fn_name": "add"}
    assert sandbox.run(ADD, parse_tests(call)) == [True, True, False]
    leetcode = "class Solution:\n    def add(self, a, b):\n        return a + b\n"
    assert sandbox.run(leetcode, parse_tests(call)) == [True, True, False]
    stop_early = "import sys\nprint(int(input()) * 2)\nsys.exit(0)\nprint('never')\n"  # normal in stdin/stdout
    assert sandbox.run(stop_early, parse_tests(io)) == [True, False, False]
    assert sandbox.run("def add(a, b)\n    return 1\n", parse_tests(call)) == [False] * 3  # a syntax error fails
    demo = ADD + "if __name__ == '__main__':\n    print(add(int(input()), 1))\n"  # not run under assert tests
    assert sandbox.run(demo, parse_tests(["assert add(1, 2) == 3"])) == [True]
    # Files inside its own directory, subprocesses that end, and reading the standard library are all fine.
    tidy = "import subprocess, json\nopen('scratch.txt', 'w').write('x')\nsubprocess.run(['true'])\n" + ADD
    assert sandbox.run(tidy, parse_tests(["assert add(1, 1) == 2"])) == [True]


def test_reward_is_the_share_and_no_program_scores_zero():
    reward = builtin_reward("code", format_weight=0.1, params={"code_timeout_s": 2})
    tests = ["assert add(1, 2) == 3", "assert add(2, 2) == 5"]
    assert reward(tests, fenced(ADD)) == pytest.approx(0.5 + 0.1)
    assert reward(tests, "def add(a, b): return a + b") == 0.0  # no fenced block: a format miss, not an error
    assert reward(json.dumps({"inputs": ["3"], "outputs": ["6"]}), fenced(DOUBLE, "")) == pytest.approx(1.1)


# ------------------------------------------------------------------------------------------- hostile programs


def hostile_programs(listener_port: int, run_dir: Path) -> dict[str, tuple[str, tuple[str, ...]]]:
    """name: (program, what the error may say: one of these)."""
    rundir_file = str(run_dir / "config.resolved.yaml")
    return {
        "infinite loop": ("while True:\n    pass\n", ("time limit",)),
        "sleeps forever": ("import time\ntime.sleep(3600)\n", ("time limit",)),
        "fork bomb": ("import os\nwhile True:\n    os.fork()\n", ("process limit", "left processes")),
        "quiet fork bomb": (
            "import os, time\nfor _ in range(200):\n    try:\n        os.fork()\n    except OSError:\n"
            "        pass\ntime.sleep(3600)\n",
            ("time limit",),
        ),
        "daemon": ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(3600)\n", ("left processes",)),
        "huge allocation": ("block = bytearray(1 << 40)\n", ("out of memory",)),
        "unbounded allocation": (
            "blocks = []\nwhile True:\n    blocks.append(bytearray(1 << 24))\n",
            ("out of memory", "time limit"),  # whichever comes first on a busy machine
        ),
        "fills the disk": (
            "with open('big', 'wb') as f:\n    while True:\n        f.write(b'x' * (1 << 20))\n",
            ("file-size limit", "disk space"),
        ),
        "floods stdout": ("while True:\n    print('x' * 100000)\n", ("file-size limit",)),
        "writes outside": ("open('/var/tmp/planted.txt', 'w').write('x')\n", ("wrote outside",)),
        "connects to loopback": (
            f"import socket\nsocket.create_connection(('127.0.0.1', {listener_port}), timeout=1)\n",
            ("used the network",),
        ),
        "connects outside": (  # TEST-NET-1: never routed
            "import socket\nsocket.create_connection(('192.0.2.1', 80), timeout=1)\n",
            ("used the network",),
        ),
        "reads the run directory": (f"print(open({rundir_file!r}).read())\n", ("may not read",)),
        "lists the run directory": (f"import os\nprint(os.listdir({str(run_dir)!r}))\n", ("may not read",)),
        "sys.exit": ("import sys\nsys.exit(0)\n", ("sys.exit",)),
        "os._exit": ("import os\nos._exit(0)\n", ("ended its process",)),
        "kills its parent": ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n", ("signal",)),
        "kills everything": ("import os, signal\nos.kill(-1, signal.SIGKILL)\n", ("signal",)),
    }


def test_hostile_programs_cost_the_sample_not_the_machine(sandbox, listener, run_dir):
    uid = sandbox.uid
    tests = parse_tests(["assert add(1, 2) == 3", "assert add(2, 2) == 4"])
    before = sandbox_dirs()
    for name, (program, reasons) in hostile_programs(listener.port, run_dir).items():
        with pytest.raises(CodeSandboxError) as caught:
            sandbox.run(program + ADD, tests)
        message = str(caught.value)
        assert message.startswith("test 1 of 2: the program "), (name, message)
        assert any(reason in message for reason in reasons), (name, message)
        assert processes_of(uid) == [], name  # nothing of the sandbox uid survives its test
        assert children_of(os.getpid()) == [], name  # nor any process this one started
        assert sandbox_dirs() == before, name  # the throwaway directory is gone
    assert listener.accepted == 0
    assert not Path("/var/tmp/planted.txt").exists()
    assert (run_dir / "config.resolved.yaml").read_text() == "secret: 1\n"


def test_the_namespace_blocks_what_the_audit_hook_does_not_see(sandbox, listener):
    """A program that connects through libc directly (no Python audit event) reaches nothing: its network
    namespace has no route. It is just a failed test (reward 0, not an error). A subprocess's writes land in the
    sandbox's private tmpfs."""
    if not sandbox.isolation.get("network"):
        pytest.skip(f"no network namespace here: {sandbox.isolation.get('why')}")
    program = (
        "import ctypes, socket, struct\nlibc = ctypes.CDLL(None)\nfd = libc.socket(2, 1, 0)\n"
        f"addr = struct.pack('<H', 2) + struct.pack('!H', {listener.port}) + socket.inet_aton('127.0.0.1') + bytes(8)\n"
        "print(libc.connect(fd, addr, 16))\n"
    )
    assert sandbox.run(program, parse_tests({"inputs": [""], "outputs": ["0"]})) == [False]
    assert listener.accepted == 0
    # A shell writes where the hook cannot see it: into the sandbox's own tmpfs, not the host's directories.
    shell = "import subprocess\nsubprocess.run(['sh', '-c', 'echo x > /run/lock/planted; echo x > /var/tmp/planted'])\n"
    assert sandbox.run(shell, parse_tests({"inputs": [""], "outputs": [""]})) == [True]
    assert not Path("/run/lock/planted").exists() and not Path("/var/tmp/planted").exists()


def test_a_reward_pool_counts_hostile_samples_as_errors_and_goes_on(tmp_path, listener, run_dir):
    """The path of a real run: the generators' pool factory (envs.scoring.task_scorer) over a dataset task with
    reward code, in real worker processes."""
    programs = hostile_programs(listener.port, run_dir)
    rows = [{"prompt": "add", "answer": json.dumps(["assert add(1, 2) == 3", "assert add(2, 2) == 5"])}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    task_cfg = {
        "name": "dataset",
        "reward": "code",
        "reward_timeout": 20,
        "params": {"train": str(tmp_path / "train.parquet"), "code_timeout_s": 3.0, "code_memory_mb": 256},
    }
    texts = [fenced(ADD), "no code at all", *(fenced(p + ADD) for p, _ in programs.values()), fenced(ADD)]
    with RewardPool("rollout_hpc.envs.scoring:task_scorer", (task_cfg, 0, None), n_workers=2, timeout_s=20) as pool:
        results = pool.score([(("train", 0), t) for t in texts])
        stats = pool.stats()
    assert [(r.value, r.status) for r in results[:2]] == [(0.5, REWARD_OK), (0.0, REWARD_OK)]
    assert (results[-1].value, results[-1].status) == (0.5, REWARD_OK)  # the pool goes on after them
    hostile = results[2:-1]
    assert all(r.status == REWARD_ERROR and r.value == 0.0 for r in hostile), [r.error for r in hostile]
    assert all(r.error and r.error.startswith("CodeSandboxError: test 1 of 2") for r in hostile)
    assert all(r.sample_fault for r in hostile) and not any(r.sample_fault for r in results[:2])
    assert stats["errors"] == len(hostile) and stats["worker_deaths"] == 0 and stats["timeouts"] == 0
    assert processes_of(sandbox_uid()) == [] and listener.accepted == 0


def test_violations_do_not_look_like_a_broken_reward(tmp_path):
    """The generators end a run whose reward raises on many samples in a row (it would train on nothing); a policy
    that writes nothing but hostile programs is not that: sandbox violations are the samples' fault. Unreadable
    test cases are the reward's (the data's) and do count."""
    from rollout_hpc.runtime.generator_loop import RewardWorkers  # imports torch: only this test needs it

    rows = [{"prompt": "p", "answer": "assert True"}, {"prompt": "q", "answer": '{"inputs": ["1"], "outputs": []}'}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    task_cfg = {
        "name": "dataset",
        "reward": "code",
        "params": {"train": str(tmp_path / "train.parquet"), "shuffle": False},
    }
    with RewardPool("rollout_hpc.envs.scoring:task_scorer", (task_cfg, 0, None), n_workers=2, timeout_s=20) as pool:
        workers = RewardWorkers(None, pool)
        workers.ERROR_STREAK_FATAL = 3
        try:
            violations = workers.score([(("train", 0), fenced("import sys\nsys.exit(0)\n"))] * 4)
            assert [(r.status, r.sample_fault) for r in violations] == [(REWARD_ERROR, True)] * 4
            with pytest.raises(RewardFatal, match="3 samples in a row.*CodeTestsError"):
                workers.score([(("train", 1), fenced("x = 1\n"))] * 3)
        finally:
            workers.queue.put(None)  # ends its sender thread


def test_a_reward_worker_killed_mid_sample_takes_its_sandbox_with_it(tmp_path):
    """The pool's per-sample timeout SIGKILLs the worker while its program runs: the runner, the sandbox's init and
    the program (asleep: no CPU limit would end it) die with it (parent-death signals, then the PID namespace), and
    the next worker removes the dead worker's directory."""
    rows = [{"prompt": "loop", "answer": "assert True"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    task_cfg = {"name": "dataset", "reward": "code", "params": {"train": str(tmp_path / "train.parquet")}}
    before = sandbox_dirs()
    with RewardPool("rollout_hpc.envs.scoring:task_scorer", (task_cfg, 0, None), n_workers=1, timeout_s=2) as pool:
        pool.warmup()
        (killed,) = pool.score([(("train", 0), fenced("import os, time\nos.fork()\ntime.sleep(3600)\n"))])
        assert killed.status == REWARD_TIMEOUT and pool.stats()["timeouts"] == 1
        deadline = time.monotonic() + 10
        while processes_of(sandbox_uid()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processes_of(sandbox_uid()) == []
        (after,) = pool.score([(("train", 0), fenced("x = 1\n"))])  # a new worker, which cleans up
        assert (after.value, after.status) == (1.0, REWARD_OK)
    assert sandbox_dirs() == before


AS_A_USER = """
import json, sys
sys.path.insert(0, sys.argv[1])
from rollout_hpc.rewards.code_sandbox import CodeLimits, CodeSandboxError, LocalSandbox, parse_tests
sandbox = LocalSandbox(CodeLimits(timeout_s=1.5, python="/usr/bin/python3"))
tests = parse_tests(["assert add(1, 2) == 3", "assert add(2, 2) == 5"])
add = "def add(a, b):\\n    return a + b\\n"
out = {"isolation": sandbox.isolation, "good": sandbox.run(add, tests), "errors": {}}
for name, program in json.loads(sys.argv[2]).items():
    try:
        out["errors"][name] = sandbox.run(program + add, tests)
    except CodeSandboxError as exc:
        out["errors"][name] = str(exc)
print(json.dumps(out))
"""


def test_not_root_the_program_runs_as_the_user_in_a_user_namespace(listener, run_dir):
    """The rank as an ordinary user (nobody here, via setpriv): a user namespace gives the same network and PID
    isolation where the kernel allows one; the limits and the audit hook hold either way."""
    setpriv, python = shutil.which("setpriv"), "/usr/bin/python3"
    if os.geteuid() != 0 or not setpriv or not os.access(python, os.X_OK):
        pytest.skip("needs root (to become another user), setpriv and /usr/bin/python3")
    repo = str(Path(__file__).resolve().parents[1])
    as_user = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", python, "-c"]
    if subprocess.run(
        [*as_user, "import sys; sys.path.insert(0, sys.argv[1]); import rollout_hpc.errors", repo]
    ).returncode:
        pytest.skip(f"{repo} is not readable by uid 65534")
    picked = ("daemon", "fork bomb", "connects to loopback", "writes outside", "huge allocation", "kills its parent")
    programs = {k: p for k, (p, _) in hostile_programs(listener.port, run_dir).items() if k in picked}
    scratch = tempfile.mkdtemp(prefix="rollout-code-test-user-")
    os.chmod(scratch, 0o777)
    try:
        done = subprocess.run(
            [*as_user, AS_A_USER, repo, json.dumps(programs)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=scratch,
            env={**os.environ, "TMPDIR": scratch},
        )
        assert done.returncode == 0, done.stderr[-2000:]
        out = json.loads(done.stdout.splitlines()[-1])
        assert os.listdir(scratch) == []  # each sample's directory was removed
    finally:
        shutil.rmtree(scratch)
    assert out["good"] == [True, False]
    isolated = out["isolation"]["user_ns"]
    for name, (_, reasons) in hostile_programs(listener.port, run_dir).items():
        if name in picked and (isolated or name != "daemon"):  # without a PID namespace a setsid daemon escapes
            assert any(r in out["errors"][name] for r in reasons), (name, out["errors"][name])
    assert processes_of(65534) == [] and listener.accepted == 0
    if not isolated:
        assert "namespace" in done.stderr  # said once, in the rank's log


# ---------------------------------------------------------------------------------------------------- config


def test_limits_are_validated_with_the_field_named(tmp_path):
    assert code_limits({"code_timeout_s": 2, "code_memory_mb": 1024, "prompt_key": "q"}) == CodeLimits(2.0, 1024)
    only_two = code_reward(code_limits({"code_max_tests": 2}))
    assert only_two(fenced("x = 1\n"), ["assert x == 1", "assert x == 1", "assert x == 2"]) == 1.0
    bad = {
        "code_timeout_s": [0, -1, "5", True, float("nan")],
        "code_memory_mb": [1.5, 16],
        "code_max_procs": [0],
        "code_sandbox_url": ["ftp://x", ""],
        "code_timeout": [5],
    }
    for key, values in bad.items():
        for value in values:
            with pytest.raises(RewardSpecError, match=f"task.params.{key}"):
                code_limits({key: value})
    pq.write_table(pa.Table.from_pylist([{"prompt": "p", "answer": "assert True"}]), tmp_path / "t.parquet")
    section = SimpleNamespace(
        name="dataset",
        reward="code",
        format_reward=0.0,
        format_pattern=None,
        params={"train": str(tmp_path / "t.parquet"), "code_timeout_s": 2.5},
    )
    task = load_task(section)  # the code_* entries reach the reward, not DatasetTask
    assert task.reward(task.prompts(0)[0], fenced("x = 1\n")) == 1.0
    section.params["code_timeout_s"] = "slow"
    with pytest.raises(UserError, match="task.params.code_timeout_s must be a number"):
        load_task(section)
    with pytest.raises(RewardSpecError, match="task.params.code_python"):
        code_reward(CodeLimits(python="/nonexistent/python3"))


# ---------------------------------------------------------------------------------------------- SandboxFusion


class FakeSandboxFusion(ThreadingHTTPServer):
    """POST /run_code as SandboxFusion answers it, running the code with this Python (a stand-in for the service;
    the requests are recorded)."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), self.Handler)
        self.requests: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.server.requests.append(body)  # type: ignore[attr-defined]
            if self.path != "/run_code" or body.get("language") != "python":
                reply: dict = {"status": "SandboxError", "message": f"unknown {self.path}", "run_result": None}
            else:
                try:
                    done = subprocess.run(
                        [sys.executable, "-c", body["code"]],
                        input=body.get("stdin", ""),
                        capture_output=True,
                        text=True,
                        timeout=body["run_timeout"],
                    )
                    run = {"status": "Finished", "return_code": done.returncode, "stdout": done.stdout}
                except subprocess.TimeoutExpired:
                    run = {"status": "TimeLimitExceeded", "return_code": None, "stdout": ""}
                run["stderr"] = ""
                ok = run["status"] == "Finished" and run["return_code"] == 0
                reply = {"status": "Success" if ok else "Failed", "message": "", "run_result": run}
            data = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)


def test_sandboxfusion_service():
    server = FakeSandboxFusion()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        fusion = SandboxFusion(code_limits({"code_sandbox_url": url + "/", "code_timeout_s": 1}))
        assert fusion.run(ADD, parse_tests(["assert add(1, 2) == 3", "assert add(1, 1) == 3"])) == [True, False]
        io = {"inputs": ["2\n", "3\n"], "outputs": ["4  \n", "7"]}
        assert fusion.run(DOUBLE, parse_tests(io)) == [True, False]
        call = {"inputs": [[1, 2], [3, 4]], "outputs": [[3], 8], "fn_name": "add"}
        assert fusion.run(ADD, parse_tests(call)) == [True, False]
        first = server.requests[0]
        assert first["language"] == "python" and first["run_timeout"] == 1 and first["memory_limit_MB"] == 512
        assert server.requests[2]["stdin"] == "2\n" and "4" not in server.requests[2]["code"]  # no expected output
        with pytest.raises(CodeSandboxError, match="time limit"):
            fusion.run("while True:\n    pass\n", parse_tests(["assert True"]))
        broken = SandboxFusion(code_limits({"code_sandbox_url": url + "/nowhere"}))
        with pytest.raises(CodeSandboxError, match="SandboxFusion error"):
            broken.run(ADD, parse_tests(["assert True"]))
        reward = builtin_reward("code", params={"code_sandbox_url": url})
        assert reward(["assert add(1, 2) == 3", "assert add(0, 0) == 1"], fenced(ADD)) == 0.5
    finally:
        server.shutdown()
        server.server_close()
    gone = SandboxFusion(code_limits({"code_sandbox_url": url}))
    with pytest.raises(CodeSandboxError, match=f"SandboxFusion at {url}/run_code"):
        gone.run(ADD, parse_tests(["assert True"]))


# ------------------------------------------------------------------------------------------------ end to end


def test_a_code_dataset_run_goes_on_and_logs_rewards(tmp_path):
    """Two GRPO steps of a tiny random model on a code dataset (a test format per row): the tiny model writes no
    fenced program, so every sample is a format miss (reward 0, status OK), logged per sample; the run ends."""
    model = make_tiny_qwen(tmp_path / "model")
    rows = [
        {"question": "Write add(a, b).", "answer": json.dumps(["assert add(1, 2) == 3"])},
        {"question": "Double a number from stdin.", "answer": json.dumps({"inputs": ["2\n"], "outputs": ["4\n"]})},
        {"question": "Write add.", "answer": json.dumps({"inputs": [[1, 2]], "outputs": [3], "fn_name": "add"})},
        {"question": "Write add(a, b) again.", "answer": "assert add(2, 2) == 4"},
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tmp_path / "code.yaml"
    cfg.write_text(f"""
run: {{name: code, seed: 3}}
launcher: local
model: {{path: {model}}}
task:
  name: dataset
  reward: code
  reward_timeout: 20
  params: {{train: {tmp_path / "train.jsonl"}, prompt_key: question, answer_key: answer, code_timeout_s: 2}}
algorithm: {{name: grpo, steps: 2, prompts_per_step: 2, group_size: 2, max_new_tokens: 4, lr: 1.0e-3}}
""")
    done = cli("submit", cfg, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    with TrajectoryReader(tmp_path / "runs" / "code") as log:
        steps, status, reward = (log.column(n).tolist() for n in ("step", "reward_status", "reward"))
    assert sorted(set(steps)) == [0, 1] and len(status) == 2 * 2 * 2
    assert status == [REWARD_OK] * len(status) and reward == [0.0] * len(reward)
