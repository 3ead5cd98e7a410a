#!/usr/bin/env python3
"""Benchmark: trainer peak memory and samples/s as the per-rank batch grows (tokens per step x1, x4, x16).

One trainer rank (the torch backend, torch.distributed over MPI.COMM_SELF), a fixed model (built-in Llama
with a large vocabulary so that the logits matter), one GRPO train step per measurement:

  ours      trainer.max_tokens_per_microbatch = the x1 batch's tokens, logprob_chunk_tokens 256:
            micro-batches with gradient accumulation, log-probs from hidden states in chunks
  packed    ours + trainer.packing: each micro-batch is one row of up to that many real tokens, the
            sequences end to end with their own position ids (no padding computed)
  unsplit   the old path: one forward over the whole share, full-vocabulary fp32 logits
            (max_tokens_per_microbatch None, logprob_chunk_tokens None)

Rows have random lengths (a quarter of `seq` to `seq` tokens, the first quarter of each the prompt), so the padded
paths compute padding that the packed one skips.

Each (path, scale) runs in a fresh subprocess: peak RSS (ru_maxrss) is per process. Reported: the peak RSS
of the process, the part of it the train steps added (peak - RSS after building model and optimizer), and
samples/s of the timed steps. With --device cuda the model trains on GPU 0 and the memory figures are CUDA max
allocated (peak, and peak - allocated after building) instead. The last stdout line is one JSON object;
`peak_mem_growth_x16` = peak memory at x16 / peak memory at x1 per path.

    python tools/bench_trainer.py --quick     # < 1 minute on an idle 2-core machine
    python tools/bench_trainer.py             # larger vocabulary and rows, more steps
    python tools/bench_trainer.py --quick --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SCALES = (1, 4, 16)


def child(args) -> None:
    """One measurement, in this process: build, note RSS, train `steps` steps, report the peak."""
    from types import SimpleNamespace

    import torch
    from mpi4py import MPI

    from rollout_hpc.backends.trainer import make_trainer
    from rollout_hpc.config import load_config
    from rollout_hpc.models import build_model
    from rollout_hpc.runtime import objective

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    rows = args.rows * args.scale
    over = [
        f"model.hidden_size={args.hidden}",
        "model.num_layers=2",
        "model.num_heads=4",
        f"model.max_seq_len={args.seq}",
        "algorithm.group_size=4",
        "algorithm.lr=1e-4",
        f"trainer.gpus_per_task={int(args.device == 'cuda')}",
    ]
    if args.path in ("ours", "packed"):
        over += [f"trainer.max_tokens_per_microbatch={args.rows * args.seq}", "trainer.logprob_chunk_tokens=256"]
        over += [f"trainer.packing={args.path == 'packed'}"]
    else:
        over += ["trainer.logprob_chunk_tokens=null"]
    cfg = load_config(None, over)
    world = SimpleNamespace(group_comm=MPI.COMM_SELF, group_rank=0, group_size=1, local_rank=0)
    trainer = make_trainer(cfg, build_model(cfg.model, args.vocab, seed=0), world)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, args.vocab, (rows, args.seq), generator=g)
    lengths = torch.randint(args.seq // 4, args.seq + 1, (rows,), generator=g)
    attn = (torch.arange(args.seq)[None, :] < lengths[:, None]).long()  # right-padded rows
    mask = attn.float()
    mask[:, : args.seq // 4] = 0  # a quarter prompt, the rest response
    tensors = {
        "input_ids": ids * attn,
        "attention_mask": attn,
        "mask": mask,
        "old_logprobs": -torch.rand(rows, args.seq, generator=g) * mask,
        "rewards": torch.randint(0, 2, (rows,), generator=g).float(),
        "response_len": mask.sum(1),
    }
    objective.add_advantages(cfg, tensors, None, None)
    loss_fn = objective.make_loss_fn(cfg)
    cuda = args.device == "cuda"
    if cuda:  # the GPU measure: what torch allocated at most on the device, above the model and optimizer
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_mb = torch.cuda.memory_allocated() / 2**20
    else:
        base_mb = _rss_kb() / 1024
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        stats = trainer.train_step(tensors, loss_fn, agg=cfg.algorithm.loss_agg)
        times.append(time.perf_counter() - t0)
    if cuda:
        torch.cuda.synchronize()
        peak_mb = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    timed = times[1:] or times
    print(
        json.dumps(
            {
                "peak_mb": peak_mb,
                "step_extra_mb": peak_mb - base_mb,
                "samples_per_s": rows / (sum(timed) / len(timed)),
                "tokens": int(attn.sum()),
                "micro_batches": int(stats["micro_batches"]),
            }
        )
    )


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--path", default="ours")
    ap.add_argument("--scale", type=int, default=1)
    ap.add_argument("--rows", type=int, default=None, help="rows per step at x1")
    ap.add_argument("--seq", type=int, default=None, help="tokens per row")
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cuda: train on GPU 0, measure CUDA max allocated"
    )
    args = ap.parse_args()
    args.rows = args.rows or 4
    args.seq = args.seq or (128 if args.quick else 256)
    args.vocab = args.vocab or (8192 if args.quick else 32768)
    args.steps = args.steps or (2 if args.quick else 3)
    if args.child:
        child(args)
        return
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.exit("bench_trainer: --device cuda, but no CUDA device is visible here; use --device cpu")
    results: dict[str, dict[int, dict]] = {"ours": {}, "packed": {}, "unsplit": {}}
    measure = "CUDA max alloc" if args.device == "cuda" else "peak RSS"
    print(
        f"per-rank batch x1 = {args.rows} rows x {args.seq} tokens, vocab {args.vocab}, hidden {args.hidden}, "
        f"{args.steps} step(s) per measurement; ours and packed: max_tokens_per_microbatch {args.rows * args.seq}, "
        "logprob_chunk_tokens 256",
        flush=True,
    )
    print(
        f"{'path':8} {'scale':>5} {'tokens':>7} {'micro':>5} {measure + ' MB':>12} {'step extra MB':>14} {'samples/s':>10}",
        flush=True,
    )
    for path in results:
        for scale in SCALES:
            cmd = [
                sys.executable,
                __file__,
                "--child",
                "--path",
                path,
                "--scale",
                str(scale),
                "--rows",
                str(args.rows),
                "--seq",
                str(args.seq),
                "--vocab",
                str(args.vocab),
                "--hidden",
                str(args.hidden),
                "--steps",
                str(args.steps),
                "--device",
                args.device,
            ]
            out = subprocess.run(
                cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}
            )
            if out.returncode:
                sys.exit(f"{path} x{scale} failed:\n{out.stderr[-3000:]}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            results[path][scale] = r
            print(
                f"{path:8} {f'x{scale}':>5} {r['tokens']:>7} {r['micro_batches']:>5} {r['peak_mb']:>12.0f} "
                f"{r['step_extra_mb']:>14.0f} "
                f"{r['samples_per_s']:>10.1f}",
                flush=True,
            )
    summary = {"quick": args.quick, "rows_x1": args.rows, "seq": args.seq, "vocab": args.vocab, "memory": measure}
    for path, by in results.items():
        summary[path] = {
            "peak_mem_growth_x16": by[16]["peak_mb"] / by[1]["peak_mb"],
            "step_mem_growth_x16": by[16]["step_extra_mb"] / max(by[1]["step_extra_mb"], 1.0),
            "peak_mb": {f"x{s}": round(r["peak_mb"], 1) for s, r in by.items()},
            "samples_per_s": {f"x{s}": round(r["samples_per_s"], 2) for s, r in by.items()},
            "micro_batches": {f"x{s}": r["micro_batches"] for s, r in by.items()},
        }
    summary["peak_mem_growth_x16"] = {p: round(summary[p]["peak_mem_growth_x16"], 3) for p in results}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
