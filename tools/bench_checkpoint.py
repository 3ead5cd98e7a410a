"""Checkpoint save/load: HDF5 (rollout-hpc) vs torch.save/torch.load vs safetensors vs the raw disk;
and trajectory-log append throughput (HDF5, with each compression choice) vs JSON lines.

    .venv/bin/python tools/bench_checkpoint.py           # >= 1 GB of weights + Adam state
    .venv/bin/python tools/bench_checkpoint.py --quick   # ~256 MB, under a minute

Every method writes the same tensors to the same directory and is timed best-of-N.
"durable" means fsync before the clock stops (our saves always fsync: atomic publish
needs it); torch.save is timed both with and without fsync. Loads read files the
previous save left in the page cache (the same for every method). The last line is
one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_hpc.store.atomic import fsync_file  # noqa: E402
from rollout_hpc.store.checkpoint import read_checkpoint_file, save_checkpoint  # noqa: E402
from rollout_hpc.store.trajlog import TrajectoryLog  # noqa: E402
from rollout_hpc.trajectory import FIXED_DTYPE, TrajectoryBatch  # noqa: E402


def make_state(hidden: int, layers: int) -> dict:
    """A transformer-shaped fp32 model with AdamW state (weights x 3 bytes in all)."""
    g = torch.Generator().manual_seed(0)
    weights = {}
    for i in range(layers):
        for name, shape in (
            ("qkv", (3 * hidden, hidden)),
            ("out", (hidden, hidden)),
            ("up", (4 * hidden, hidden)),
            ("down", (hidden, 4 * hidden)),
            ("norm1", (hidden,)),
            ("norm2", (hidden,)),
        ):
            weights[f"layers.{i}.{name}.weight"] = torch.randn(shape, generator=g)
    weights["embed.weight"] = torch.randn(8192, hidden, generator=g)
    params = list(weights)
    optimizer = {
        "state": {
            i: {
                "step": torch.tensor(100.0),
                "exp_avg": torch.randn_like(weights[p]) * 1e-3,
                "exp_avg_sq": torch.rand_like(weights[p]) * 1e-6,
            }
            for i, p in enumerate(params)
        },
        "param_groups": [
            {"lr": 1e-5, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "params": list(range(len(params)))}
        ],
    }
    return {"model": weights, "optimizer": optimizer, "step": 100, "rng": {"torch": torch.get_rng_state()}}


def nbytes(state: dict) -> int:
    total = 0
    for v in [*state["model"].values(), *(t for s in state["optimizer"]["state"].values() for t in s.values())]:
        total += v.numel() * v.element_size()
    return total


def flat_tensors(state: dict) -> dict[str, torch.Tensor]:
    flat = {f"model.{k}": v for k, v in state["model"].items()}
    for i, s in state["optimizer"]["state"].items():
        flat.update({f"optimizer.{i}.{k}": v for k, v in s.items()})
    return flat


def bench_checkpoint(state: dict, work: Path, repeats: int) -> dict:
    size = nbytes(state)
    flat = flat_tensors(state)
    raw = np.concatenate([t.reshape(-1).view(torch.uint8).numpy() for t in flat.values()])
    results: dict[str, dict] = {}

    def raw_save():
        path = work / "raw.bin"
        with open(path, "wb") as f:
            f.write(memoryview(raw))
            f.flush()
            os.fsync(f.fileno())

    def raw_load():
        np.fromfile(work / "raw.bin", np.uint8)

    def torch_save(durable: bool):
        path = work / "model.pt"
        torch.save(state, path)
        if durable:
            fsync_file(path)

    def st_save():
        from safetensors.torch import save_file

        path = work / "model.safetensors"
        save_file(flat, path)
        fsync_file(path)

    def st_load():
        from safetensors.torch import load_file

        # load_file maps the file lazily: touch every page so the data is really read
        for t in load_file(work / "model.safetensors").values():
            t.reshape(-1).view(torch.uint8)[::4096].sum()

    h5_path = work / "run" / "checkpoints" / "step-00000100.h5"
    cases = {
        "raw_disk": (raw_save, raw_load),
        "hdf5_rollout_hpc": (
            lambda: save_checkpoint(work / "run", 100, state, {"policy_version": 100}, keep_last=1),
            lambda: read_checkpoint_file(h5_path),
        ),
        "torch_save_durable": (lambda: torch_save(True), lambda: torch.load(work / "model.pt", weights_only=False)),
        "torch_save": (lambda: torch_save(False), lambda: torch.load(work / "model.pt", weights_only=False)),
        "safetensors_durable": (st_save, st_load),
    }
    # One untimed warm-up round, then `repeats` rounds, each running every case in turn (rotated per round), so a
    # busy moment of the machine falls on all of them alike; medians and the min-max spread are reported.
    names = list(cases)
    times: dict[str, dict[str, list[float]]] = {n: {"save": [], "load": []} for n in names}
    for rnd in range(repeats + 1):
        for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
            for what, fn in zip(("save", "load"), cases[name]):
                t = time.perf_counter()
                fn()
                if rnd:
                    times[name][what].append(time.perf_counter() - t)
    for name in names:
        save_s, load_s = (statistics.median(times[name][w]) for w in ("save", "load"))
        results[name] = {
            "save_s": round(save_s, 3),
            "load_s": round(load_s, 3),
            "save_s_spread": [round(min(times[name]["save"]), 3), round(max(times[name]["save"]), 3)],
            "load_s_spread": [round(min(times[name]["load"]), 3), round(max(times[name]["load"]), 3)],
            "save_GBps": round(size / save_s / 1e9, 3),
            "load_GBps": round(size / load_s / 1e9, 3),
        }
        print(
            f"{name:22s} save {save_s:6.2f} s ({size / save_s / 1e9:5.2f} GB/s) [{min(times[name]['save']):.2f}-"
            f"{max(times[name]['save']):.2f}]   load {load_s:6.2f} s ({size / load_s / 1e9:5.2f} GB/s)",
            flush=True,
        )
    ours = results["hdf5_rollout_hpc"]
    ours["repeats"] = repeats
    for base in ("torch_save_durable", "torch_save", "safetensors_durable", "raw_disk"):
        b = results[base]
        ours[f"save_speedup_vs_{base}"] = round(b["save_s"] / ours["save_s"], 3)
        ours[f"load_speedup_vs_{base}"] = round(b["load_s"] / ours["load_s"], 3)
    print(
        f"HDF5 vs torch.save+fsync: save {ours['save_speedup_vs_torch_save_durable']:.2f}x, "
        f"load {ours['load_speedup_vs_torch_save_durable']:.2f}x;  vs torch.save (no fsync): save "
        f"{ours['save_speedup_vs_torch_save']:.2f}x;  vs raw disk: save {ours['save_speedup_vs_raw_disk']:.2f}x, "
        f"load {ours['load_speedup_vs_raw_disk']:.2f}x",
        flush=True,
    )
    return {"state_bytes": size, **results}


def realistic_batches(
    n_steps: int, per_step: int, prompt_len: int, max_new: int, vocab: int = 32000
) -> list[TrajectoryBatch]:
    rng = np.random.default_rng(0)
    out = []
    for step in range(n_steps):
        fixed = np.zeros(per_step, FIXED_DTYPE)
        resp = rng.integers(max_new // 4, max_new + 1, per_step).astype(np.uint32)
        fixed["prompt_id"] = step * per_step + np.arange(per_step)
        fixed["policy_version"] = step
        fixed["reward"] = rng.random(per_step)
        fixed["prompt_len"], fixed["response_len"], fixed["n_turns"] = prompt_len, resp, 1
        fixed["t_start"] = time.time()
        total = int(resp.sum())
        out.append(
            TrajectoryBatch(
                fixed,
                rng.integers(0, vocab, per_step * prompt_len).astype(np.int32),
                rng.zipf(1.3, total).clip(max=vocab - 1).astype(np.int32),  # token frequencies are Zipf-like
                -np.abs(rng.normal(0, 1.5, total)).astype(np.float32),
                np.ones(total, np.uint8),
                np.zeros(per_step, np.int32),  # turn_starts: one turn at 0
                np.zeros(per_step, np.float32),  # turn_rewards
            )
        )
    return out


def bench_trajlog(work: Path, n_steps: int, per_step: int) -> dict:
    """Log n_steps steps of per_step trajectories (128-token prompts, up to 512-token responses),
    committing (flushing) after every step as the trainer does."""
    batches = realistic_batches(n_steps, per_step, prompt_len=128, max_new=512)
    tokens = sum(b.n_tokens for b in batches)
    results = {}
    for label, compression in (
        ("hdf5_gzip1_shuffle", {"compression": "gzip", "compression_opts": 1, "shuffle": True}),
        ("hdf5_lzf_shuffle", {"compression": "lzf", "shuffle": True}),
        ("hdf5_uncompressed", {}),
    ):
        path = work / f"{label}.h5"
        t = time.perf_counter()
        log = TrajectoryLog.open_for_append(path, {"run_name": "bench"}, compression=compression)
        for step, b in enumerate(batches):
            log.append(b, step)
            log.append_metrics(step, {"kl": 0.0})  # flushes: one durable commit per step
        log.close()
        dt = time.perf_counter() - t
        results[label] = {
            "tokens_per_s": round(tokens / dt),
            "seconds": round(dt, 3),
            "MB": round(path.stat().st_size / 1e6, 1),
        }
    path = work / "trajectories.jsonl"
    t = time.perf_counter()
    with open(path, "w") as f:
        for step, b in enumerate(batches):
            for i in range(len(b)):
                r = b.record(i)
                f.write(
                    json.dumps(
                        {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in r.items()} | {"step": step}
                    )
                    + "\n"
                )
            f.flush()
    dt = time.perf_counter() - t
    results["json_lines"] = {
        "tokens_per_s": round(tokens / dt),
        "seconds": round(dt, 3),
        "MB": round(path.stat().st_size / 1e6, 1),
    }
    for label, r in results.items():
        print(f"trajectory log {label:20s} {r['tokens_per_s'] / 1e6:7.2f} M tokens/s   {r['MB']:7.1f} MB", flush=True)
    base = results["json_lines"]["tokens_per_s"]
    print(f"HDF5 (gzip) append is {results['hdf5_gzip1_shuffle']['tokens_per_s'] / base:.1f}x JSON lines", flush=True)
    return {
        "tokens": tokens,
        "trajectories": n_steps * per_step,
        **results,
        "gzip_speedup_vs_json_lines": round(results["hdf5_gzip1_shuffle"]["tokens_per_s"] / base, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="~256 MB state and a small log (under a minute)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds after the warm-up (median reported)")
    parser.add_argument("--dir", help="where to write (default: a temp dir; put it on the file system you care about)")
    args = parser.parse_args()
    hidden, layers = (512, 7) if args.quick else (1024, 7)
    work = Path(tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir))
    try:
        state = make_state(hidden, layers)
        print(
            f"state: {nbytes(state) / 1e9:.2f} GB of fp32 weights + AdamW moments "
            f"({'quick mode: ~256 MB' if args.quick else 'full mode'}), files in {work}",
            flush=True,
        )
        ckpt = bench_checkpoint(state, work, repeats=args.repeats)
        del state
        log = bench_trajlog(work, n_steps=16 if args.quick else 100, per_step=256)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"bench": "checkpoint", "quick": args.quick, "checkpoint": ckpt, "trajectory_log": log}))


if __name__ == "__main__":
    main()
