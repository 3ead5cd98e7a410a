#!/usr/bin/env python3
"""Throughput of RewardPool against calling the reward in-process (docs/rewards.md).

    .venv/bin/python tools/bench_rewards.py --quick      # 128 jobs of a trivial reward, 2 workers
    .venv/bin/python tools/bench_rewards.py --jobs 1024 --workers 4 --reward math

Prints one line per measurement, the last stdout line is one JSON object: jobs, workers, reward, pool_ms (median of
the warm repeats), pool_min_ms, in_process_ms, per_job_us (pool overhead per job), start_s (first workers ready).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_hpc.rewards import RewardPool  # noqa: E402


def trivial_reward():
    """Factory of the trivial reward: len(text)."""

    def fn(key, text):
        return float(len(text))

    return fn


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="128 jobs, 2 workers, trivial reward, 20 repeats")
    ap.add_argument("--jobs", type=int, default=128)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--reward", choices=["trivial", "math"], default="trivial")
    args = ap.parse_args()
    if args.quick:
        args.jobs, args.workers, args.repeats, args.reward = 128, 2, 20, "trivial"

    if args.reward == "math":
        from rollout_hpc.rewards.verifiers import builtin_reward

        factory, fargs = "rollout_hpc.rewards.verifiers:builtin_reward", ("math", 0.0, None)
        fn = builtin_reward("math")
        jobs = [("#### 1,234" if i % 2 else "0.5", rf"so \boxed{{\frac{{{i}}}{{2}}}}") for i in range(args.jobs)]
    else:
        factory, fargs = f"{Path(__file__).resolve()}:trivial_reward", ()
        fn = trivial_reward()
        jobs = [(i, "x" * (i % 200)) for i in range(args.jobs)]

    in_process = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        [fn(k, t) for k, t in jobs]
        in_process.append((time.perf_counter() - t0) * 1e3)

    t0 = time.perf_counter()
    with RewardPool(factory, fargs, n_workers=args.workers, timeout_s=10.0, name="bench") as pool:
        pool.warmup()
        start_s = time.perf_counter() - t0
        pool.score(jobs)  # warm
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            results = pool.score(jobs)
            times.append((time.perf_counter() - t0) * 1e3)
        assert all(r.status == 0 for r in results), [r for r in results if r.status][:3]

    pool_ms, in_ms = statistics.median(times), statistics.median(in_process)
    print(
        f"{args.jobs} jobs, {args.workers} workers, {args.reward} reward: pool {pool_ms:.2f} ms "
        f"(min {min(times):.2f}), in-process {in_ms:.3f} ms, workers ready after {start_s:.2f} s",
        file=sys.stderr,
    )
    print(
        json.dumps(
            {
                "jobs": args.jobs,
                "workers": args.workers,
                "reward": args.reward,
                "pool_ms": round(pool_ms, 3),
                "pool_min_ms": round(min(times), 3),
                "in_process_ms": round(in_ms, 4),
                "per_job_us": round((pool_ms - in_ms) * 1e3 / args.jobs, 2),
                "start_s": round(start_s, 3),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
