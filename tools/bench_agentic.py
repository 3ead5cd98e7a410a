#!/usr/bin/env python3
"""Multi-turn throughput: batched stepping (task.env.parallel_envs episodes per generate call) against one episode at a
time, on the same environments, seeds and policy (docs/agentic.md).

    .venv/bin/python tools/bench_agentic.py --quick      # 64 sokoban episodes, max_turns 4, 5 rounds (< 1 minute)
    .venv/bin/python tools/bench_agentic.py --envs 64 --turns 8 --rounds 7 --task frozenlake

Both modes play the same episodes (the same seeds give the same replies whatever the batch: checked here); a warm-up
round of each comes first, then `--rounds` interleaved rounds (batched, one at a time, batched, ...). Prints one line
per round; the last stdout line is one JSON object: episodes, turns (model turns played per round), the medians and
spreads of episodes/s and turns/s of each mode, and batched_vs_sequential (median episodes/s ratio).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from rollout_hpc.backends.episodes import EpisodeSettings  # noqa: E402
from rollout_hpc.backends.generate_hf import HFGenerator, SamplingParams  # noqa: E402
from rollout_hpc.config import ModelSection, TaskSection  # noqa: E402
from rollout_hpc.envs import load_task  # noqa: E402
from rollout_hpc.models import CharTokenizer, build_model  # noqa: E402


def play(gen, task, envs: int, parallel: int) -> tuple[float, int, list]:
    """(seconds, model turns, per-episode (turns, response tokens)) of `envs` episodes (prompts 0.., one sample each)."""
    gen.episodes = EpisodeSettings(parallel_envs=parallel)
    t0 = time.perf_counter()
    batch = gen.rollout(task.prompts(0), list(range(envs)), 1, 0, 0)
    seconds = time.perf_counter() - t0
    f = batch.fixed
    return seconds, int(f["n_turns"].sum()), list(zip(f["n_turns"].tolist(), f["response_len"].tolist()))


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="64 episodes, max_turns 4, 5 rounds")
    ap.add_argument("--envs", type=int, default=64, help="episodes per round (= parallel_envs of the batched mode)")
    ap.add_argument("--turns", type=int, default=8, help="max_turns of an episode")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds after the warm-up (at least 5)")
    ap.add_argument("--task", choices=["sokoban", "frozenlake"], default="sokoban")
    ap.add_argument("--max-new-tokens", type=int, default=1, help="tokens per reply (one action word)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: a generator rank's share of a node)")
    args = ap.parse_args()
    if args.quick:
        args.envs, args.turns, args.rounds = 64, 4, 5
    args.rounds = max(args.rounds, 5)
    torch.set_num_threads(args.threads)

    tok = CharTokenizer()
    model_cfg = ModelSection(max_seq_len=64 + 70 * args.turns)  # the built-in tiny model (hidden 64 x 2 layers)
    model = build_model(model_cfg, tok.vocab_size, seed=0).eval()
    task = load_task(TaskSection(name=args.task, params={"max_turns": args.turns}))
    params = SamplingParams(max_new_tokens=args.max_new_tokens, stop_ids=(tok.eos_id,))
    gen = HFGenerator(model, tok, task, params, seed=0)

    modes = {"batched": args.envs, "sequential": 1}
    rates: dict[str, dict[str, list[float]]] = {m: {"episodes_per_s": [], "turns_per_s": []} for m in modes}
    played = {}
    for rnd in range(args.rounds + 1):  # round 0 warms up (allocator, threads, first calls)
        for mode, parallel in modes.items():
            seconds, turns, episodes = play(gen, task, args.envs, parallel)
            played.setdefault(mode, episodes)
            if played[mode] != episodes or played[mode] != played["batched"]:
                raise SystemExit(f"round {rnd}: {mode} played other episodes than batched: the comparison is void")
            label = "warm-up" if rnd == 0 else f"round {rnd}"
            print(
                f"{label:8s} {mode:10s} {seconds:7.3f} s  {args.envs / seconds:8.1f} episodes/s  {turns / seconds:8.1f} turns/s"
            )
            if rnd:
                rates[mode]["episodes_per_s"].append(args.envs / seconds)
                rates[mode]["turns_per_s"].append(turns / seconds)
    ratios = [b / s for b, s in zip(rates["batched"]["episodes_per_s"], rates["sequential"]["episodes_per_s"])]
    result = {
        "task": args.task,
        "episodes": args.envs,
        "parallel_envs": args.envs,
        "max_turns": args.turns,
        "turns": sum(t for t, _ in played["batched"]),
        "rounds": args.rounds,
        "torch_threads": args.threads,
        **{f"{mode}_{k}": spread(v) for mode, r in rates.items() for k, v in r.items()},
        "round_ratios": [round(r, 2) for r in ratios],
        "batched_vs_sequential": statistics.median(rates["batched"]["episodes_per_s"])
        / statistics.median(rates["sequential"]["episodes_per_s"]),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
