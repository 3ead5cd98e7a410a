"""Run summary (`rollout-hpc analyze`) on large trajectory logs: time and peak memory,
vs loading the Parquet export with pandas and computing the same numbers there.

    .venv/bin/python tools/bench_analysis.py           # logs of 100k and 1M trajectories
    .venv/bin/python tools/bench_analysis.py --quick   # 100k only, under a minute

Each measurement runs in a fresh process: wall time, and peak memory as the rise of the
process's peak RSS (VmHWM, reset through /proc/self/clear_refs after the imports) over its
RSS before the work. RSS counts every allocator (numpy, Arrow, HDF5), unlike tracemalloc.
The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the synthetic log the tests use too

from synthetic_trajectories import write_synthetic_log  # noqa: E402

from rollout_hpc.analysis.export import export_run  # noqa: E402

PER_STEP = 1000

_MEASURE = """
import json, sys, time
sys.path.insert(0, {root!r})
method, target = sys.argv[1], sys.argv[2]
if method == "ours":
    from rollout_hpc.analysis.summary import summarize
else:
    import pandas as pd
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")  # reset the peak RSS to the current RSS
base = status("VmRSS:")
t = time.perf_counter()
if method == "ours":
    s = summarize(target)
    out = {{"samples": s["samples"], "reward_mean": s["reward"]["mean"], "steps": s["steps"]}}
else:
    df = pd.read_parquet(target)
    per_step = df.groupby("step")["reward"].agg(["mean", "std", "min", "max"])
    lengths = df["response_len"].describe(percentiles=[0.5, 0.9, 0.99])
    out = {{"samples": len(df), "reward_mean": float(df["reward"].astype("float64").mean()), "steps": len(per_step)}}
elapsed = time.perf_counter() - t
print(json.dumps({{**out, "seconds": elapsed, "peak_MB": (status("VmHWM:") - base) / 1e6}}))
"""


def measure(method: str, target: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE.format(root=str(ROOT)), method, str(target)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench(n: int, work: Path) -> dict:
    run = work / f"run_{n}"
    t = time.perf_counter()
    write_synthetic_log(run, n // PER_STEP, PER_STEP, restart_at=n // PER_STEP // 2)
    write_s = time.perf_counter() - t
    t = time.perf_counter()
    exported = export_run(run, "parquet", run / "export")
    export_s = time.perf_counter() - t
    log_mb = (run / "trajectories.h5").stat().st_size / 1e6
    ours = measure("ours", run)
    pandas = measure("pandas", exported["trajectories"][0])
    assert ours["samples"] == pandas["samples"] == n
    assert abs(ours["reward_mean"] - pandas["reward_mean"]) < 1e-9
    result = {
        "trajectories": n,
        "log_MB": round(log_mb, 1),
        "write_log_s": round(write_s, 2),
        "export_parquet_s": round(export_s, 2),
        "ours": {k: round(v, 3) for k, v in ours.items() if k not in ("samples", "reward_mean", "steps")},
        "pandas_parquet": {k: round(v, 3) for k, v in pandas.items() if k not in ("samples", "reward_mean", "steps")},
    }
    result["speedup_vs_pandas"] = round(pandas["seconds"] / ours["seconds"], 2)
    result["memory_ratio_pandas_over_ours"] = round(pandas["peak_MB"] / max(ours["peak_MB"], 0.1), 1)
    print(
        f"{n:>9,} trajectories ({log_mb:.0f} MB log): summary {ours['seconds']:.2f} s, peak +{ours['peak_MB']:.0f} MB  |  "
        f"pandas on the parquet export {pandas['seconds']:.2f} s, peak +{pandas['peak_MB']:.0f} MB  |  "
        f"ours {result['speedup_vs_pandas']:.2f}x the speed, {result['memory_ratio_pandas_over_ours']:.1f}x less memory",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100k trajectories only (under a minute)")
    args = parser.parse_args()
    sizes = [100_000] if args.quick else [100_000, 1_000_000]
    work = Path(tempfile.mkdtemp(prefix="bench_analysis_"))
    try:
        results = [bench(n, work) for n in sizes]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"bench": "analysis", "quick": args.quick, "results": results}))


if __name__ == "__main__":
    main()
