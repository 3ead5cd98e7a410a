"""Built-in verifiable rewards (rollout_hpc.rewards.verifiers) and the reward process pool (rollout_hpc.rewards.pool).

The pool tests start real worker processes; their factories live in tests/reward_plugins.py (named both as
'reward_plugins:fn' — the tests directory is on this interpreter's sys.path, which the pool hands to its workers —
and as a file path). Throughput benchmark: `.venv/bin/python tools/bench_rewards.py --quick`.
"""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path

import pytest

from rollout_hpc.config import UserError
from rollout_hpc.rewards import (
    REWARD_ERROR,
    REWARD_OK,
    REWARD_TIMEOUT,
    RewardFatal,
    RewardPool,
    RewardResult,
    builtin_reward,
    exact_reward,
    format_ok,
    gold_answer,
    is_builtin_reward,
    math_reward,
    regex_reward,
    reward_factory,
)
from rollout_hpc.rewards.verifiers import RewardSpecError, last_boxed, last_number

PLUGINS = Path(__file__).with_name("reward_plugins.py")


def alive(pid: int) -> bool:
    """True while the process exists (a zombie counts: not reaped yet)."""
    return Path(f"/proc/{pid}").exists()


# ----------------------------------------------------------------------------------------------------- answers


def test_gold_answer_forms():
    assert gold_answer(42) == ("42",)
    assert gold_answer(0.5) == ("0.5",)
    assert gold_answer(3.0) == ("3",)
    assert gold_answer("1,234") == ("1234",)
    assert gold_answer(" -3.5 ") == ("-3.5",)
    assert gold_answer("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 1,234") == ("1234",)
    assert gold_answer(["7", 7, "x"]) == ("7", "x")
    assert gold_answer({"answer": "#### 5"}) == ("5",)
    assert gold_answer(None) == ()
    assert gold_answer("1,2") == ("1,2",)  # not a thousands separator: a tuple/list answer stays as written


def test_extraction_helpers():
    assert last_boxed(r"first \boxed{1} then \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{a{b}c}") == "a{b}c"
    assert last_boxed(r"truncated \boxed{12") is None
    assert last_number("so the answer is 42.") == "42"
    assert last_number("He pays $1,234.50 in total") == "1234.50"
    assert last_number("x = -3") == "-3" and last_number("5-3") == "3"
    assert last_number("no digits") is None and last_number("") is None


# -------------------------------------------------------------------------------------------------------- math


@pytest.mark.parametrize(
    "response, answer",
    [
        (r"The probability is \boxed{\frac{1}{2}}.", "0.5"),
        (r"so we get $\boxed{\dfrac12}$", r"\frac{1}{2}"),
        (r"\boxed{0.5}", r"$\frac{1}{2}$"),
        (r"Thus \boxed{\sqrt{2}}", r"$\sqrt{2}$"),
        ("He has 1000 + 234 apples, so 1234", "Natalia sold ... <<x=y>>\n#### 1,234"),
        ("so the answer is 42.", 42),
        ("so the answer is 42.", "42"),
        ("The total is 1,234 dollars", "1234"),
        ("It drops to -3.5 degrees", "-3.5"),
        ("7.0", 7),
        (r"First \boxed{3}, no wait: \boxed{4}", "4"),
        (r"\boxed{1,234}", "1234"),
        ("answer: 12", ["11", "12"]),
    ],
)
def test_math_reward_correct(response, answer):
    assert math_reward(response, answer) == 1.0


@pytest.mark.parametrize(
    "response, answer",
    [
        (r"The probability is \boxed{\frac{1}{3}}.", "0.5"),
        ("so the answer is 41.", "#### 42"),
        (r"\boxed{4} although 3 is tempting", "3"),  # the boxed answer wins over the last number
        (r"First \boxed{3}, no wait: \boxed{4}", "3"),
        ("asdf {{{ \\frac{ $$ ]]", "1"),
        ("", "42"),
        (None, "42"),
        ("42", None),
        (r"\boxed{}", "0"),
        ("\x00\udcff garbage \\boxed{\\frac{", "1"),
    ],
)
def test_math_reward_wrong_or_garbage(response, answer):
    assert math_reward(response, answer) == 0.0


def test_math_reward_symbolic_string_answers():
    assert math_reward(r"\boxed{x + 1}", "1 + x") == 1.0
    assert math_reward(r"\boxed{\text{Paris}}", r"\text{Paris}") == 1.0
    assert math_reward(r"\boxed{x + 2}", "1 + x") == 0.0


# ---------------------------------------------------------------------------------------------- exact / regex


def test_exact_reward():
    assert exact_reward("  Paris. ", "paris") == 1.0
    assert exact_reward("New   York", "new york") == 1.0
    assert exact_reward('"yes"', "Yes") == 1.0
    assert exact_reward("$42$", 42) == 1.0
    assert exact_reward("7", "7.0") == 1.0 and exact_reward("7.", 7) == 1.0
    assert exact_reward("1,234", "#### 1234") == 1.0
    assert exact_reward("7", "8") == 0.0
    assert exact_reward("Paris France", "paris") == 0.0
    assert exact_reward("", "x") == 0.0 and exact_reward(None, "x") == 0.0
    assert exact_reward("b", ["a", "b"]) == 1.0


def test_regex_reward_with_group_takes_the_last_match():
    fn = regex_reward(r"Answer:\s*(\S+)")
    assert fn("Answer: 3 ... actually Answer: 4.", "4") == 1.0
    assert fn("Answer: 3 ... actually Answer: 4.", "3") == 0.0
    assert fn("no answer here", "4") == 0.0
    assert fn("Answer: 7.0", 7) == 1.0


def test_regex_reward_without_group_is_a_search():
    fn = regex_reward(r"\bdone\b")
    assert fn("all done now", None) == 1.0
    assert fn("undone", None) == 0.0


def test_invalid_regex_names_pattern_and_reason():
    with pytest.raises(RewardSpecError) as err:
        regex_reward("Answer: (\\d+")
    assert isinstance(err.value, UserError)
    assert "Answer: (\\\\d+" in str(err.value) and "missing )" in str(err.value)
    with pytest.raises(UserError, match="missing"):
        builtin_reward("regex:([a-z]")


# ------------------------------------------------------------------------------------------- format / builtins


def test_format_ok():
    assert format_ok(r"so \boxed{3}", "math") and not format_ok("so 3", "math")
    assert format_ok("<answer>3</answer>", r"<answer>.*</answer>")
    assert not format_ok("3", r"<answer>.*</answer>")


def test_builtin_reward_specs_and_format_bonus():
    assert is_builtin_reward("math") and is_builtin_reward("exact") and is_builtin_reward("regex:a(b)")
    assert not is_builtin_reward("my_pkg.rewards:fn") and not is_builtin_reward("maths")
    assert builtin_reward("my_pkg.rewards:fn") is None and builtin_reward("path/r.py:fn") is None

    m = builtin_reward("math")
    assert m("0.5", r"\boxed{\frac12}") == 1.0 and m("0.5", "0.5") == 1.0 and m("1", "0.5") == 0.0

    m = builtin_reward("math", format_weight=0.1)
    assert m("0.5", r"\boxed{\frac12}") == pytest.approx(1.1)
    assert m("0.5", "0.5") == 1.0  # right, but not boxed
    assert m("2", r"\boxed{3}") == pytest.approx(0.1)  # wrong, but well formatted

    e = builtin_reward("exact", 0.5, r"^\w+$")
    assert e("paris", "Paris") == 1.5 and e("paris", "Paris.") == 1.0
    with pytest.raises(RewardSpecError, match="format pattern"):
        builtin_reward("exact", format_weight=0.5)

    r = builtin_reward(r"regex:<a>(\d+)</a>", format_weight=0.25)
    assert r(3, "<a>3</a>") == 1.25 and r(4, "<a>3</a>") == 0.25 and r(4, "4") == 0.0


# -------------------------------------------------------------------------------------------------------- pool


@pytest.fixture
def pool_factory():
    pools = []

    def make(factory, **kwargs):
        kwargs.setdefault("n_workers", 2)
        kwargs.setdefault("timeout_s", 5.0)
        pool = RewardPool(factory, **kwargs)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()


def test_pool_scores_in_job_order(pool_factory):
    pool = pool_factory("reward_plugins:correct", args=(0.5,))
    jobs = [(i, str(i) if i % 2 else "wrong") for i in range(100)]
    results = pool.score(jobs)
    assert [r.value for r in results] == [1.5 if i % 2 else 0.5 for i in range(100)]
    assert all(r == RewardResult(r.value, REWARD_OK, None) for r in results)
    assert pool.score([]) == []
    assert pool.score([(1, "1")])[0].value == 1.5


def test_pool_uses_every_worker(pool_factory):
    pool = pool_factory("reward_plugins:pid", n_workers=2)
    pool.warmup()
    pids = {int(r.value) for r in pool.score([(i, "") for i in range(64)])}
    assert pids == set(pool.pids) and len(pids) == 2


def test_pool_file_factory_and_builtin_math(pool_factory):
    pool = pool_factory(f"{PLUGINS}:correct", n_workers=1)
    assert [r.value for r in pool.score([("a", "a"), ("a", "b")])] == [1.0, 0.0]
    math_pool = pool_factory("rollout_hpc.rewards.verifiers:builtin_reward", args=("math", 0.1, None), n_workers=1)
    results = math_pool.score([("#### 1,234", "so 1234"), ("0.5", r"\boxed{\frac{1}{2}}"), ("3", "garbage")])
    assert [r.value for r in results] == pytest.approx([1.0, 1.1, 0.0])


def test_reward_factory_builtin_or_plugin(pool_factory, tmp_path):
    assert reward_factory("exact")("a", "A.") == 1.0
    plugin = tmp_path / "my_reward.py"
    plugin.write_text("def starts(item, text):\n    return 1.0 if text.startswith(str(item)) else 0.0\n")
    fn = reward_factory(f"{plugin}:starts", 0.5, r"!$")
    assert fn("ab", "abc!") == 1.5 and fn("ab", "abc") == 1.0 and fn("x", "abc!") == 0.5
    assert reward_factory(f"{plugin}:starts")("ab", "abc!") == 1.0
    with pytest.raises(UserError, match="no attribute 'nope'"):
        reward_factory(f"{plugin}:nope")
    pool = pool_factory("rollout_hpc.rewards.verifiers:reward_factory", args=(f"{plugin}:starts", 0.5, "!$"))
    assert [r.value for r in pool.score([("ab", "abc!"), ("x", "abc")])] == [1.5, 0.0]


def test_pool_raising_reward_is_an_error_and_the_worker_survives(pool_factory):
    pool = pool_factory("reward_plugins:flaky", n_workers=1)
    pool.warmup()
    pid = pool.pids[0]
    results = pool.score([(i, "") for i in range(10)])
    for i, r in enumerate(results):
        if i % 3 == 0:
            assert r.status == REWARD_ERROR and r.value == 0.0 and r.error == f"ValueError: no reward for {i}"
        else:
            assert r.status == REWARD_OK and r.value == float(i) and r.error is None
    assert pool.pids == [pid]


def test_pool_hang_costs_the_timeout_and_the_pool_goes_on(pool_factory):
    timeout = 1.0
    pool = pool_factory("reward_plugins:hangs", n_workers=2, timeout_s=timeout)
    pool.warmup()
    before = set(pool.pids)
    jobs = [("a", "")] * 40 + [("hang", "")] + [("b", "")] * 40
    t0 = time.monotonic()
    results = pool.score(jobs)
    elapsed = time.monotonic() - t0
    assert timeout * 0.9 <= elapsed <= timeout + 2.0
    assert results[40] == RewardResult(0.0, REWARD_TIMEOUT, "timed out after 1s")
    assert all(r.status == REWARD_OK and r.value == 1.0 for i, r in enumerate(results) if i != 40)
    killed = before - set(pool.pids)
    assert len(killed) == 1 and not alive(killed.pop())  # SIGKILLed and reaped
    assert len(pool.pids) == 2
    again = pool.score([("c", "")] * 10)
    assert all(r.status == REWARD_OK for r in again)
    stats = pool.stats()
    assert stats["timeouts"] == 1 and stats["workers_started"] == 3


def test_pool_timeout_is_per_sample_not_per_chunk(pool_factory):
    pool = pool_factory("reward_plugins:sleeps", n_workers=1, timeout_s=0.6)
    pool.warmup()
    results = pool.score([(0.2, "")] * 8)  # 1.6 s in all, each sample well under the timeout
    assert [r.status for r in results] == [REWARD_OK] * 8


def test_pool_worker_death_is_an_error_and_the_pool_goes_on(pool_factory):
    pool = pool_factory("reward_plugins:dies", n_workers=2)
    jobs = [("a", "")] * 20 + [("die", "")] + [("b", "")] * 20
    results = pool.score(jobs)
    assert results[20] == RewardResult(0.0, REWARD_ERROR, "worker died (exit code 3)")
    assert all(r.status == REWARD_OK for i, r in enumerate(results) if i != 20)
    results = pool.score([("die", ""), ("a", ""), ("die", "")] + [("b", "")] * 5)
    assert [r.status for r in results] == [REWARD_ERROR, REWARD_OK, REWARD_ERROR] + [REWARD_OK] * 5
    assert len(pool.pids) == 2 and pool.stats()["worker_deaths"] == 3


def test_pool_nan_is_fatal_and_names_the_plugin(pool_factory):
    pool = pool_factory("reward_plugins:nan_reward", name="task.reward 'reward_plugins:nan_reward'")
    with pytest.raises(RewardFatal) as err:
        pool.score([("ok", "x")] * 5 + [("nan", "the response")])
    message = str(err.value)
    assert "task.reward 'reward_plugins:nan_reward'" in message and "nan" in message
    assert isinstance(err.value, UserError)
    assert [r.value for r in pool.score([("ok", "x")] * 3)] == [1.0] * 3  # usable again (workers restarted)


def test_pool_non_number_is_fatal(pool_factory):
    pool = pool_factory("reward_plugins:wrong_type", name="myreward")
    with pytest.raises(RewardFatal, match=r"myreward returned str 'one'"):
        pool.score([(1, "x")])


@pytest.mark.parametrize(
    "factory, expected",
    [
        ("reward_plugins:broken_factory", "RuntimeError: cannot load the reward model"),
        ("reward_plugins:not_callable", "not a function"),
        ("reward_plugins:no_such_factory", "has no attribute 'no_such_factory'"),
        ("no_such_module_xyz:fn", "module 'no_such_module_xyz' not found"),
        ("tests/no_such_file.py:fn", "not found"),
    ],
)
def test_pool_factory_failure_is_fatal(pool_factory, factory, expected):
    pool = pool_factory(factory, name="task.reward")
    with pytest.raises(RewardFatal) as err:
        pool.score([(1, "x")])
    assert "task.reward" in str(err.value) and factory in str(err.value) and expected in str(err.value)
    with pytest.raises(RewardFatal):
        pool_factory(factory).warmup()


def test_pool_stdout_noise_does_not_break_the_protocol(pool_factory, capfd):
    pool = pool_factory("reward_plugins:prints", n_workers=1)
    assert [r.value for r in pool.score([(i, "") for i in range(5)])] == [1.0] * 5


def test_worker_stays_light(pool_factory):
    pool = pool_factory("reward_plugins:loaded_modules", n_workers=1)
    heavy = "mpi4py mpi4py.MPI torch numpy pydantic rollout_hpc.config rollout_hpc.runtime rollout_hpc.exchange"
    assert pool.score([(0, heavy)])[0].value == 1.0


def test_close_is_idempotent_and_leaves_no_process():
    with RewardPool("reward_plugins:correct", n_workers=2) as pool:
        pool.warmup()
        pids = pool.pids
        assert all(alive(p) for p in pids)
    assert not any(alive(p) for p in pids)
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.score([(1, "1")])


def test_garbage_collected_pool_leaves_no_process():
    pool = RewardPool("reward_plugins:hangs", n_workers=2, timeout_s=0.3)
    pool.warmup()
    pids = pool.pids
    del pool
    gc.collect()
    deadline = time.monotonic() + 5
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids)


def running(pid: int) -> bool:
    """True while the process exists and is not a zombie (an orphan's zombie is its new parent's business)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_workers_exit_when_the_rank_dies_even_in_a_hung_job(tmp_path, repo_root, venv_python):
    import subprocess

    script = tmp_path / "rank.py"
    script.write_text(f"""
import os, sys, threading, time
from rollout_hpc.rewards import RewardPool
pool = RewardPool({str(PLUGINS) + ":hangs"!r}, n_workers=2, timeout_s=600)
pool.warmup()
print(*pool.pids, flush=True)
threading.Thread(target=pool.score, args=([("hang", ""), ("hang", "")],), daemon=True).start()
time.sleep(0.5)
os._exit(0)  # like a SIGKILLed rank: no finalizers, no close()
""")
    out = subprocess.run([str(venv_python), str(script)], capture_output=True, text=True, timeout=60, cwd=repo_root)
    assert out.returncode == 0, out.stderr
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 30  # they notice within a second or two; a loaded machine may take longer
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(running(p) for p in pids)


def test_bad_arguments():
    with pytest.raises(RewardFatal, match="picklable"):
        RewardPool("reward_plugins:correct", args=(lambda: 1,))
    with pytest.raises(RewardFatal, match="package.module:function"):
        RewardPool("reward_plugins.correct")
    with pytest.raises(ValueError):
        RewardPool("reward_plugins:correct", timeout_s=0)


def test_bench_quick_reports_json(repo_root, venv_python):
    import json
    import subprocess

    out = subprocess.run(
        [str(venv_python), str(repo_root / "tools" / "bench_rewards.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=repo_root,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["jobs"] == 128 and result["pool_ms"] > 0 and result["in_process_ms"] > 0
    assert os.environ.get("CI") or result["pool_ms"] < 200  # generous: the machine is shared


def test_the_jobs_signals_at_a_workers_start_do_not_kill_it(pool_factory):
    """slurmstepd signals every process of a job step: a time-limit warning (USR1), and the other job signals, must
    not kill a reward worker whose interpreter is still starting (before it ignores them). It starts with them
    blocked; once it ignores them they are dropped, and it scores. (Seen: a storm of warnings right after a requeued
    job started killed a worker, and its rank ended the job instead of checkpointing.)"""
    import signal

    pool = pool_factory("reward_plugins:pid", n_workers=2)
    pids = list(pool.pids)
    assert len(pids) == 2
    for pid in pids:  # at once: the workers are still starting Python
        for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
            os.kill(pid, sig)
    pool.warmup()
    scored = {int(r.value) for r in pool.score([(i, "") for i in range(32)])}
    assert scored == set(pids) and pool.pids == pids  # the same two workers, alive, scoring
