"""What the code reward's sandbox costs per sample, side by side in one run:

- sandbox: `LocalSandbox.run` (runner, namespaces, tmpfs, one sandboxed interpreter per test, audit hook);
- bare: the same program and tests each run as `python -I -c` with no isolation at all (the naive way);
- floor: starting the interpreter alone (`python -I -S -c pass`), once per test: what any process-per-test design pays.

    .venv/bin/python tools/bench_code_reward.py --quick      # last line: one JSON object
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

from rollout_hpc.rewards.code_sandbox import CodeLimits, LocalSandbox, parse_tests

PROGRAM = "def add(a, b):\n    return a + b\n"


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats (well under a minute)")
    parser.add_argument("--tests", type=int, default=5, help="tests per sample")
    args = parser.parse_args()
    repeats = 5 if args.quick else 20
    sandbox = LocalSandbox(CodeLimits())
    tests = parse_tests([f"assert add({i}, 1) == {i + 1}" for i in range(args.tests)])
    python = sandbox.python

    def bare() -> None:
        for test in tests:
            subprocess.run([python, "-I", "-c", f"{PROGRAM}\n{test['code']}"], check=True)

    def floor() -> None:
        for _ in tests:
            subprocess.run([python, "-I", "-S", "-c", "pass"], check=True)

    one = timed(lambda: sandbox.run(PROGRAM, tests[:1]), repeats)
    many = timed(lambda: sandbox.run(PROGRAM, tests), repeats)
    bare_s, floor_s = timed(bare, repeats), timed(floor, repeats)
    figures = {
        "tests": len(tests),
        "isolation": "namespaces" if sandbox.isolation.get("pid") else "rlimits only",
        "sandbox_1_test_s": round(one, 4),
        "sandbox_s": round(many, 4),
        "per_extra_test_s": round((many - one) / max(1, len(tests) - 1), 4),
        "bare_s": round(bare_s, 4),
        "floor_s": round(floor_s, 4),
        "sandbox_over_bare": round(many / bare_s, 2),
        "sandbox_over_floor": round(many / floor_s, 2),
    }
    print(
        f"{len(tests)} tests: sandbox {many * 1e3:.0f} ms ({one * 1e3:.0f} ms for one), bare subprocesses "
        f"{bare_s * 1e3:.0f} ms, interpreter starts alone {floor_s * 1e3:.0f} ms"
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
