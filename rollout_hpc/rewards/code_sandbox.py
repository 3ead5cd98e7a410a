"""The `code` reward: run the response's program against the row's test cases in a sandbox; the reward is the share
of tests passed (docs/rewards.md, "Code").

- The program is the last fenced Python block of the response (```python ... ``` or ``` ... ```); without one the
  reward is 0.0 (a format miss, not an error).
- Tests (`parse_tests`): assert statements (a list of them, or a string of test code: MBPP / HumanEval), stdin/stdout
  pairs {"inputs": [...], "outputs": [...]} (APPS / TACO / verl "prime"), or the same with "fn_name" (call-based);
  each also as a JSON string.
- A program that breaks a sandbox rule (time, CPU, memory, file size, processes, network, files outside its
  directory, reading what it may not, signalling other processes, sys.exit / os._exit before its tests finished)
  raises CodeSandboxError: in the reward pool the sample scores 0 with reward_status ERROR and the run goes on.
- Where it runs: `LocalSandbox` (code_runner.py: namespaces, rlimits, an unprivileged uid; code_harness.py inside),
  or an external SandboxFusion service (`SandboxFusion`, task.params.code_sandbox_url).
"""

from __future__ import annotations

import ast
import json
import math
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from rollout_hpc.errors import RewardSpecError

RUNNER = Path(__file__).with_name("code_runner.py")
HARNESS = Path(__file__).with_name("code_harness.py")
# A fenced block: ```lang (anything else on the fence line is ignored) ... ```
CODE_FENCE = re.compile(
    r"(?s)```[ \t]*([\w+.-]*)[^\n]*\n(.*?)```"
)  # (?s) in the text: its .pattern is the format regex
PYTHON_FENCES = ("", "python", "py", "python3", "py3")
_CALL_MARKER = "@@rollout-hpc-call-result@@"


class CodeSandboxError(Exception):
    """The program broke a sandbox rule or the sandbox failed: the sample scores 0 and counts as a reward error.
    The sample's fault, not the reward's: RewardPool marks its result `sample_fault`, so a policy that writes
    nothing but infinite loops does not look like a broken reward to the generators."""

    sample_fault = True


class CodeTestsError(ValueError):
    """The row's test cases are in no format the code reward reads (a reward error of that sample)."""


# ----------------------------------------------------------------------------------------------------- limits


@dataclass(frozen=True)
class CodeLimits:
    """The sandbox's limits, from task.params code_* (see CODE_PARAMS)."""

    timeout_s: float = 5.0  # wall time per test (also its CPU-time limit, rounded up)
    memory_mb: int = 512  # address space per test process
    max_procs: int = 8  # processes of the sandbox uid (memory_mb each at most)
    file_mb: int = 16  # largest file (and stdout) a test may write; private /tmp is 4x this
    max_tests: int | None = None  # run at most the first N tests of a row (None: all)
    python: str | None = None  # the sandbox's interpreter (default: this one if the sandbox uid can run it)
    sandbox_url: str | None = None  # a SandboxFusion service instead of the local sandbox


CODE_PARAMS = {f"code_{f.name}": f.name for f in fields(CodeLimits)}
_NUMBERS: dict[str, tuple[type, float, float]] = {  # field: (type, lowest, highest)
    "timeout_s": (float, 0.01, 3600.0),
    "memory_mb": (int, 64, 1 << 20),
    "max_procs": (int, 1, 1 << 16),
    "file_mb": (int, 1, 1 << 20),
    "max_tests": (int, 1, 1 << 20),
}


def code_limits(params: Mapping[str, Any] | None) -> CodeLimits:
    """CodeLimits from task.params (its code_* entries; others are ignored). RewardSpecError names the field."""
    values: dict[str, Any] = {}
    for key, value in (params or {}).items():
        if not str(key).startswith("code_"):
            continue
        if key not in CODE_PARAMS:
            raise RewardSpecError(f"task.params.{key} is not a code reward setting; known: {', '.join(CODE_PARAMS)}")
        name = CODE_PARAMS[key]
        if value is None:
            continue
        if name in _NUMBERS:
            kind, low, high = _NUMBERS[name]
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if kind is int:
                ok = ok and float(value).is_integer()
            if not ok or not low <= value <= high:
                what = "a whole number" if kind is int else "a number"
                raise RewardSpecError(f"task.params.{key} must be {what} from {low:g} to {high:g}, got {value!r}")
            values[name] = kind(value)
        elif not isinstance(value, str) or not value.strip():
            raise RewardSpecError(f"task.params.{key} must be a non-empty string, got {value!r}")
        elif name == "sandbox_url" and not value.startswith(("http://", "https://")):
            raise RewardSpecError(f"task.params.{key} must be an http:// or https:// URL, got {value!r}")
        else:
            values[name] = value
    return CodeLimits(**values)


# -------------------------------------------------------------------------------------------- program, tests


def extract_program(response: str | None) -> str | None:
    """The last fenced Python (or unlabelled) block of the response; None when there is none."""
    blocks = [body for lang, body in CODE_FENCE.findall(response or "") if lang.lower() in PYTHON_FENCES]
    return blocks[-1] if blocks and blocks[-1].strip() else None


def _assert_tests(code: str) -> list[dict]:
    """A string of test code: one test per top-level assert (the other top-level statements, e.g. imports, run
    before each); code without top-level asserts (a HumanEval `check(candidate)`) is one test."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return [{"kind": "assert", "code": code}]
    asserts = [node for node in tree.body if isinstance(node, ast.Assert)]
    if not asserts:
        defines_check = any(isinstance(n, ast.FunctionDef) and n.name == "check" for n in tree.body)
        if defines_check and not any(isinstance(n, ast.Expr) and isinstance(n.value, ast.Call) for n in tree.body):
            raise CodeTestsError(
                "the test code defines check(candidate) but never calls it (a HumanEval 'test' column alone): give "
                "the answer as {'test': ..., 'entry_point': 'fn'} (e.g. a JSON string), or end the tests with check(fn)"
            )
        return [{"kind": "assert", "code": code}]
    setup = "".join(f"{ast.get_source_segment(code, n)}\n" for n in tree.body if not isinstance(n, ast.Assert))
    return [{"kind": "assert", "code": f"{setup}{ast.get_source_segment(code, a)}"} for a in asserts]


def _stdin_text(value: Any) -> str:
    if isinstance(value, list):
        return "\n".join(str(v) for v in value) + "\n"
    return value if isinstance(value, str) else json.dumps(value)


def _call_args(value: Any) -> list:
    if isinstance(value, list):
        return value
    if isinstance(value, str):  # one JSON value per line (LeetCode-style rows)
        try:
            return [json.loads(line) for line in value.splitlines() if line.strip()]
        except ValueError:
            return [value]
    return [value]


def _io_tests(spec: Mapping) -> list[dict]:
    inputs = spec.get("inputs", spec.get("input"))
    outputs = spec.get("outputs", spec.get("output"))
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
        raise CodeTestsError(
            "test cases {'inputs': [...], 'outputs': [...]} need two lists of the same length, got "
            f"{type(inputs).__name__} and {type(outputs).__name__}"
            + (f" of lengths {len(inputs)} and {len(outputs)}" if isinstance(inputs, list) else "")
        )
    fn = spec.get("fn_name")
    if fn:
        return [{"kind": "call", "fn": str(fn), "args": _call_args(i), "expected": o} for i, o in zip(inputs, outputs)]
    return [{"kind": "stdio", "input": _stdin_text(i), "expected": _stdin_text(o)} for i, o in zip(inputs, outputs)]


def _decode(text: str) -> Any:
    """A JSON string, or a Python literal (some datasets store str(list)); None when it is neither."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None


def parse_tests(answer: Any) -> list[dict]:
    """The row's test cases as a list of {"kind": "assert", "code"} / {"kind": "stdio", "input", "expected"} /
    {"kind": "call", "fn", "args", "expected"}. Reads assert code (a string or a list of strings), {"inputs",
    "outputs"[, "fn_name"]} mappings, {"test_list": [...]} (MBPP rows), {"test", "entry_point"} (HumanEval rows),
    a list of {"input", "output"} pairs, and any of these as a JSON string (or a Python literal's text).
    CodeTestsError when none fits."""
    if isinstance(answer, str):
        text = answer.strip()
        if text[:1] in '[{"':
            decoded = _decode(text)
            if decoded is not None and decoded != answer:
                return parse_tests(decoded)
        tests = _assert_tests(answer) if text else []
    elif isinstance(answer, Mapping):
        if "test_list" in answer:
            setup = f"{answer['test_setup_code']}\n" if answer.get("test_setup_code") else ""
            tests = [{**t, "code": setup + t["code"]} for t in parse_tests(answer["test_list"])]
        elif "test" in answer and "entry_point" in answer:
            tests = [{"kind": "assert", "code": f"{answer['test']}\ncheck({answer['entry_point']})"}]
        elif any(k in answer for k in ("inputs", "input")):
            tests = _io_tests(answer)
        else:
            raise CodeTestsError(f"test cases: a mapping needs 'inputs'/'outputs' or 'test_list', got {sorted(answer)}")
    elif isinstance(answer, (list, tuple)):
        tests = []
        for item in answer:
            if isinstance(item, Mapping) and "input" in item and "output" in item and "fn_name" not in item:
                tests.append(
                    {"kind": "stdio", "input": _stdin_text(item["input"]), "expected": _stdin_text(item["output"])}
                )
            else:
                tests.extend(parse_tests(item))
    else:
        raise CodeTestsError(f"test cases must be assert code, a list or a mapping, got {type(answer).__name__}")
    if not tests:
        raise CodeTestsError("the row has no test cases")
    return tests


# -------------------------------------------------------------------------------------------------- judging


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.replace("\r\n", "\n").rstrip().split("\n")]


def same_output(actual: str, expected: str) -> bool:
    """stdout equals the expected output up to trailing whitespace on each line and trailing blank lines."""
    return _lines(actual) == _lines(expected)


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b if isinstance(a, bool) and isinstance(b, bool) else False
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
    if isinstance(a, list) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    return bool(a == b)


def same_value(value: Any, expected: Any) -> bool:
    """A call-based result equals the expected output (numbers to 1e-9; tuples as lists); APPS wraps outputs in
    a one-element list, so [x] also accepts x."""
    if _same_value(value, expected):
        return True
    return isinstance(expected, list) and len(expected) == 1 and _same_value(value, expected[0])


def judge(test: dict, status: str, stdout: str, value: Any) -> bool:
    """Whether a test that ran (no violation) passed."""
    if test["kind"] == "assert":
        return status == "pass"
    if status != "ran":
        return False
    if test["kind"] == "stdio":
        return same_output(stdout, test["expected"])
    return same_value(value, test["expected"])


def _sandbox_tests(tests: list[dict]) -> list[dict]:
    """What the sandbox gets: never the expected outputs (a program could read them there)."""
    return [{k: v for k, v in t.items() if k != "expected"} for t in tests]


# ---------------------------------------------------------------------------------------------- local sandbox

_warned: set[str] = set()


def _warn_once(text: str) -> None:
    if text not in _warned:
        _warned.add(text)
        print(f"rollout-hpc: code reward: {text}", file=sys.stderr, flush=True)


_DIR_PREFIX = "rollout-code-"  # + the reward process's pid: a directory whose owner died is stale


def _remove_stale_dirs() -> None:
    """The working directories of reward processes that were killed mid-sample (the pool's timeout SIGKILLs them)."""
    for path in Path(tempfile.gettempdir()).glob(f"{_DIR_PREFIX}*-*"):
        pid = path.name[len(_DIR_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


def _sandbox_ids() -> tuple[int, int]:
    try:
        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except KeyError:
        return 65534, 65534


class LocalSandbox:
    """Runs tests through code_runner.py (one runner process per sample, one sandboxed process per test)."""

    def __init__(self, limits: CodeLimits) -> None:
        self.limits = limits
        self.uid, self.gid = _sandbox_ids()
        self.harness = HARNESS.read_text(encoding="utf-8")
        self.isolation: dict = {}
        _remove_stale_dirs()
        self.python = self._pick_python()

    def _pick_python(self) -> str:
        """The first interpreter the sandbox uid can run a program with (checked by running one)."""
        if self.limits.python:
            candidates = [self.limits.python]
        else:
            candidates = [sys.executable, "/usr/bin/python3", shutil.which("python3") or ""]
        tried = []
        for python in dict.fromkeys(c for c in candidates if c):
            try:
                results = self._run("print(input())", [{"kind": "stdio", "input": "ok\n"}], python)
                if results[0].get("outcome") == "ran" and results[0]["stdout"].strip() == "ok":
                    return python
                tried.append(f"{python}: {results[0].get('detail') or 'wrong output'}")
            except CodeSandboxError as exc:
                tried.append(f"{python}: {exc}")
        field = "task.params.code_python"
        raise RewardSpecError(
            f"task.reward code: no Python interpreter runs in the sandbox (uid {self.uid} when root) - "
            f"{'; '.join(tried)}. Set {field} to an interpreter that user can read and run (e.g. /usr/bin/python3)"
        )

    def _run(self, program: str, tests: list[dict], python: str) -> list[dict]:
        lim = self.limits
        workdir = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-")
        spec = {
            "program": program,
            "tests": tests,
            "harness": self.harness,
            "python": python,
            "workdir": workdir,
            "timeout_s": lim.timeout_s,
            "memory_mb": lim.memory_mb,
            "max_procs": lim.max_procs,
            "file_mb": lim.file_mb,
            "tmpfs_mb": 4 * lim.file_mb,
            "uid": self.uid,
            "gid": self.gid,
        }
        budget = lim.timeout_s * len(tests) + 10.0
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", str(RUNNER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group: killed as one below
            cwd="/",
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        )
        try:
            out, err = proc.communicate(json.dumps(spec).encode(), timeout=budget)
        except subprocess.TimeoutExpired:
            raise CodeSandboxError(f"the sandbox did not finish within {budget:g}s") from None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the runner's process group
            except OSError:
                pass
            proc.communicate()
            shutil.rmtree(workdir, ignore_errors=True)
        records = [json.loads(line) for line in out.decode("utf-8", "replace").splitlines() if line.strip()]
        for record in records:
            if "isolation" in record:
                self.isolation = record["isolation"]
            elif "error" in record:
                raise CodeSandboxError(record["error"])
        results = [r for r in records if "outcome" in r]
        if not results:
            tail = " ".join(err.decode("utf-8", "replace").split())[-300:]
            raise CodeSandboxError(f"the sandbox runner failed (exit code {proc.returncode}): {tail}")
        return results

    def run(self, program: str, tests: list[dict]) -> list[bool]:
        """Pass/fail per test; CodeSandboxError on a violation (the first one stops the sample)."""
        results = self._run(program, _sandbox_tests(tests), self.python)
        iso = self.isolation
        if not (iso.get("network") and iso.get("pid")):
            _warn_once(
                "programs run without their own network and PID namespace "
                f"({iso.get('why') or 'unavailable'}): they can reach the network, and a process that leaves "
                "its process group can outlive its test. See docs/rewards.md."
            )
        passed = []
        for test, result in zip(tests, results):
            if result["outcome"] != "ran":
                raise CodeSandboxError(f"test {result['test'] + 1} of {len(tests)}: the program {result['detail']}")
            passed.append(judge(test, result["status"], result["stdout"], result.get("value")))
        if len(passed) != len(tests):
            raise CodeSandboxError(f"the sandbox reported {len(passed)} of {len(tests)} tests")
        return passed


# ------------------------------------------------------------------------------------------------ SandboxFusion

_CALL_SNIPPET = """

import json as _rollout_json
_rollout_fn = globals().get({fn!r}) or getattr(globals()["Solution"](), {fn!r})
print({marker!r} + _rollout_json.dumps(_rollout_fn(*_rollout_json.loads({args!r}))))
"""


class SandboxFusion:
    """Runs each test as one POST {url}/run_code (SandboxFusion's API) with urllib: a program that runs past
    run_timeout or that the service cannot run is a CodeSandboxError, like a local violation."""

    def __init__(self, limits: CodeLimits) -> None:
        self.limits = limits
        self.url = str(limits.sandbox_url).rstrip("/") + "/run_code"

    def _post(self, code: str, stdin: str) -> dict:
        import urllib.error  # urllib.request costs ~20 ms: only a SandboxFusion reward needs it
        import urllib.request

        body = {
            "code": code,
            "language": "python",
            "stdin": stdin,
            "run_timeout": self.limits.timeout_s,
            "compile_timeout": self.limits.timeout_s,
            "memory_limit_MB": self.limits.memory_mb,
        }
        request = urllib.request.Request(
            self.url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=self.limits.timeout_s + 30) as response:
                reply = json.loads(response.read())
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise CodeSandboxError(f"SandboxFusion at {self.url}: {type(exc).__name__}: {exc}") from None
        if not isinstance(reply, dict):
            raise CodeSandboxError(f"SandboxFusion at {self.url} answered {str(reply)[:200]!r}, not a JSON object")
        return reply

    def run(self, program: str, tests: list[dict]) -> list[bool]:
        passed = []
        for index, test in enumerate(tests):
            code, stdin = program, ""
            if test["kind"] == "assert":
                code = f"{program}\n\n{test['code']}\n"
            elif test["kind"] == "stdio":
                stdin = test["input"]
            else:
                code = program + _CALL_SNIPPET.format(fn=test["fn"], marker=_CALL_MARKER, args=json.dumps(test["args"]))
            reply = self._post(code, stdin)
            run = reply.get("run_result") or {}
            where = f"test {index + 1} of {len(tests)}"
            if reply.get("status") == "SandboxError":
                raise CodeSandboxError(f"{where}: SandboxFusion error: {str(reply.get('message'))[:300]}")
            if run.get("status") == "TimeLimitExceeded":
                raise CodeSandboxError(f"{where}: the program ran past the {self.limits.timeout_s:g}s time limit")
            stdout = str(run.get("stdout") or "")
            finished = run.get("status") == "Finished" and run.get("return_code") == 0
            value = None
            if test["kind"] == "call" and finished:
                lines = [line for line in stdout.splitlines() if line.startswith(_CALL_MARKER)]
                finished = bool(lines)
                value = json.loads(lines[-1][len(_CALL_MARKER) :]) if lines else None
            status = ("pass" if test["kind"] == "assert" else "ran") if finished else "fail"
            passed.append(judge(test, status, stdout, value))
        return passed


# ------------------------------------------------------------------------------------------------------- reward


def code_reward(limits: CodeLimits | None = None) -> Callable[[str, Any], float]:
    """The code reward `(response, answer) -> share of tests passed`: 0.0 without a fenced program; raises
    CodeSandboxError on a violation and CodeTestsError on unreadable test cases (reward errors in the pool).
    Building it runs one probe program (the local sandbox picks its interpreter)."""
    limits = limits or CodeLimits()
    backend = SandboxFusion(limits) if limits.sandbox_url else LocalSandbox(limits)

    def reward(response: str, answer: Any) -> float:
        program = extract_program(response)
        if program is None:
            return 0.0
        tests = parse_tests(answer)[: limits.max_tests]
        passed = backend.run(program, tests)
        return sum(passed) / len(tests)

    reward.__dict__["limits"] = limits  # a function attribute, for whoever inspects the reward
    return reward
