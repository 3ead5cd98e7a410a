"""Resident memory of a memory-mapped prompt dataset per generator rank (docs/datasets.md).

Writes an N-row GSM8K-like dataset (~200-byte prompts, short string answers, an int column) with
write_arrow, then in FRESH child processes (clean baselines) measures /proc/self/status VmRSS / RssAnon /
RssFile deltas of:
  ours:      open_arrow (memory-mapped) + PromptRows/EpochShuffled reading 1000 random rows
  baseline:  the same file read into memory (ipc.open_file(path).read_all() without a mapping: a copy)
and the time of check_table on the N rows (string prompts and chat-message prompts).

    .venv/bin/python tools/measure_dataset_memory.py            # 2,000,000 rows
    .venv/bin/python tools/measure_dataset_memory.py --quick    # 200,000 rows
The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, sys, time
import numpy as np

def status():
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "RssFile"):
                out[k] = int(v.split()[0]) * 1024
    return out

import pyarrow as pa, pyarrow.ipc as ipc
from rollout_hpc.envs.datafile import EpochShuffled, PromptRows, open_arrow
mode, path, n_read = sys.argv[1], sys.argv[2], int(sys.argv[3])
s0 = status()
t0 = time.perf_counter()
if mode == "ours":
    table = open_arrow(path)
else:
    with pa.OSFile(path, "rb") as f:  # plain reads: the whole table copied into process memory
        table = ipc.open_file(f).read_all()
t_open = time.perf_counter() - t0
s1 = status()
rows = PromptRows(table)
stream = EpochShuffled(rows, seed=0)
t0 = time.perf_counter()
stream.permutation(3)  # one epoch's permutation (kept while the stream is in that epoch)
t_perm = time.perf_counter() - t0
picks = 3 * len(rows) + np.random.default_rng(1).integers(0, len(rows), n_read)  # random rows of epoch 3
t0 = time.perf_counter()
n_chars = sum(len(stream[int(i)].text) for i in picks)
t_read = time.perf_counter() - t0
s2 = status()
print(json.dumps({"open": {k: s1[k] - s0[k] for k in s0}, "open_and_read": {k: s2[k] - s0[k] for k in s0},
                  "open_s": t_open, "perm_s": t_perm, "read_us_per_row": 1e6 * t_read / n_read, "chars": n_chars}))
"""

BODY = (
    "Natalia sold clips to {a} of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Answer with a number. #{i}"
)


def build(n: int):
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(0)
    a = rng.integers(2, 500, n)
    prompts = pa.array([BODY.format(a=int(x), i=i) for i, x in enumerate(a)])
    answers = pa.array([str(int(x) + int(x) // 2) for x in a])
    return pa.table({"prompt": prompts, "answer": answers, "level": pa.array(rng.integers(1, 6, n))})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--read", type=int, default=1000, help="random rows read per child")
    ap.add_argument("--quick", action="store_true", help="200,000 rows")
    ap.add_argument("--dir", default=None, help="where to write the file (default: a temporary directory)")
    args = ap.parse_args()
    n = 200_000 if args.quick else args.rows

    import pyarrow as pa

    from rollout_hpc.envs.datafile import check_table, write_arrow

    tmp = tempfile.TemporaryDirectory(dir=args.dir)
    path = os.path.join(tmp.name, "prompts.arrow")
    t0 = time.perf_counter()
    table = build(n)
    t_build = time.perf_counter() - t0
    t0 = time.perf_counter()
    check_table(table, path)
    t_check = time.perf_counter() - t0
    mean_prompt = table.column("prompt").chunk(0).buffers()[2].size / n
    import numpy as np  # chat prompts [system, user] built column-wise (2 messages a row)

    users = table.column("prompt").combine_chunks()
    contents = pa.concat_arrays([pa.array(["Be brief."] * n), users]).take(
        pa.array(np.stack([np.arange(n), n + np.arange(n)], axis=1).ravel())
    )
    roles = pa.array(np.tile(np.array(["system", "user"], dtype=object), n), pa.string())
    messages = pa.StructArray.from_arrays([roles, contents], names=["role", "content"])
    offsets = pa.array(np.arange(0, 2 * n + 1, 2, dtype=np.int32))
    chat = pa.table({"prompt": pa.ListArray.from_arrays(offsets, messages)})
    t0 = time.perf_counter()
    check_table(chat, path + " (chat)", require_answer=False)
    t_check_chat = time.perf_counter() - t0
    del chat
    write_arrow(table, path)
    del table
    size = os.path.getsize(path)
    print(
        f"{n} rows, mean prompt {mean_prompt:.0f} bytes, file {size / 2**20:.1f} MiB (built in {t_build:.1f} s); "
        f"check_table {t_check:.3f} s (strings), {t_check_chat:.3f} s (chat messages)"
    )

    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = {}
    for mode in ("ours", "baseline"):
        out = subprocess.run(
            [sys.executable, "-c", CHILD, mode, path, str(args.read)],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        res[mode] = json.loads(out.strip().splitlines()[-1])
        r = res[mode]
        mib = lambda b: f"{b / 2**20:7.1f} MiB"  # noqa: E731
        print(
            f"{mode:8s}: open {r['open_s'] * 1e3:7.1f} ms, VmRSS +{mib(r['open']['VmRSS'])} after open, "
            f"+{mib(r['open_and_read']['VmRSS'])} after {args.read} random rows "
            f"(RssAnon +{mib(r['open_and_read']['RssAnon'])}, RssFile +{mib(r['open_and_read']['RssFile'])}); "
            f"{r['read_us_per_row']:.0f} us/row, epoch permutation {r['perm_s'] * 1e3:.0f} ms"
        )
    ours, base = res["ours"]["open_and_read"], res["baseline"]["open_and_read"]
    print(
        f"ours: {ours['VmRSS'] / size:.3f} x file size resident ({ours['RssAnon'] / size:.4f} x private); "
        f"baseline: {base['VmRSS'] / size:.3f} x; ratio baseline/ours {base['VmRSS'] / max(ours['VmRSS'], 1):.1f}"
    )
    summary = {
        "rows": n,
        "file_bytes": size,
        "mean_prompt_bytes": round(mean_prompt, 1),
        "read_rows": args.read,
        "check_table_s": round(t_check, 4),
        "check_table_chat_s": round(t_check_chat, 4),
        "ours_rss_open_bytes": res["ours"]["open"]["VmRSS"],
        "ours_rss_bytes": ours["VmRSS"],
        "ours_anon_bytes": ours["RssAnon"],
        "ours_file_bytes": ours["RssFile"],
        "baseline_rss_bytes": base["VmRSS"],
        "ours_rss_over_file": round(ours["VmRSS"] / size, 4),
        "baseline_rss_over_file": round(base["VmRSS"] / size, 4),
        "read_us_per_row": round(res["ours"]["read_us_per_row"], 1),
        "epoch_permutation_s": round(res["ours"]["perm_s"], 4),
    }
    tmp.cleanup()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
