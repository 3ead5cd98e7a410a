#!/usr/bin/env python3
"""Multi-turn throughput: batched stepping against one episode at a time, same environments, seeds and policy.

Batched: task.env.parallel_envs episodes per generate call; one at a time: parallel_envs 1 (docs/agentic.md).

    .venv/bin/python tools/bench_agentic.py --quick      # 64 sokoban episodes, max_turns 4, 5 rounds (< 1 minute)
    .venv/bin/python tools/bench_agentic.py --envs 64 --turns 8 --rounds 7 --task frozenlake --reply-tokens 1

Each reply length of --reply-tokens is measured on its own: both modes play the same episodes (the same seeds give
the same replies whatever the batch: checked here); a warm-up round of each comes first, then `--rounds` interleaved
rounds (batched, one at a time, batched, ...). Prints one line per round; the last stdout line is one JSON object:
per reply length, the turns played per round, the medians and spreads of episodes/s and turns/s of each mode and
batched_vs_sequential (median episodes/s ratio); at the top level `batched_vs_sequential` of the longest length
and `batched_vs_sequential_by_reply_tokens`.

Why two lengths (docs/agentic.md): with one-token replies (the built-in Sokoban's move letters) a turn is the
prefill of the next observation, whose compute per row is the same at any batch size on a CPU, so batching saves
only the per-call overhead; with replies of several tokens (ROLL's Sokoban actions are up to 64 tokens, e.g.
"<answer>Up</answer>", 19 characters) decoding dominates, and a one-row decode step is almost all overhead.
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


def measure(task, args, reply_tokens: int) -> dict:
    """Batched against one at a time at one reply length: a warm-up round of each, then interleaved rounds."""
    tok = CharTokenizer()
    # the built-in tiny model (hidden 64 x 2 layers), with context for every turn's observation (~70 tokens) and reply
    model = build_model(ModelSection(max_seq_len=64 + (80 + reply_tokens) * args.turns), tok.vocab_size, seed=0)
    params = SamplingParams(max_new_tokens=reply_tokens, stop_ids=(tok.eos_id,))
    gen = HFGenerator(model.eval(), tok, task, params, seed=0)
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
                f"{reply_tokens:3d} tok {label:8s} {mode:10s} {seconds:7.3f} s  {args.envs / seconds:8.1f} episodes/s"
                f"  {turns / seconds:8.1f} turns/s"
            )
            if rnd:
                rates[mode]["episodes_per_s"].append(args.envs / seconds)
                rates[mode]["turns_per_s"].append(turns / seconds)
    ratios = [b / s for b, s in zip(rates["batched"]["episodes_per_s"], rates["sequential"]["episodes_per_s"])]
    return {
        "turns": sum(t for t, _ in played["batched"]),
        "episode_tokens": sum(n for _, n in played["batched"]),  # replies and the observations between them
        **{f"{mode}_{k}": spread(v) for mode, r in rates.items() for k, v in r.items()},
        "round_ratios": [round(r, 2) for r in ratios],
        "batched_vs_sequential": statistics.median(rates["batched"]["episodes_per_s"])
        / statistics.median(rates["sequential"]["episodes_per_s"]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="64 episodes, max_turns 4, 5 rounds")
    ap.add_argument("--envs", type=int, default=64, help="episodes per round (= parallel_envs of the batched mode)")
    ap.add_argument("--turns", type=int, default=8, help="max_turns of an episode")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds after the warm-up (at least 5)")
    ap.add_argument("--task", choices=["sokoban", "frozenlake"], default="sokoban")
    ap.add_argument(
        "--reply-tokens",
        default="1,16",
        help="comma-separated max_new_tokens per reply to measure, each on its own (1: the built-in move letter; "
        "16: a ROLL-like action such as '<answer>Up</answer>' in characters)",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: a generator rank's share of a node)")
    args = ap.parse_args()
    if args.quick:
        args.envs, args.turns, args.rounds = 64, 4, 5
    args.rounds = max(args.rounds, 5)
    torch.set_num_threads(args.threads)

    try:
        lengths = sorted({int(x) for x in args.reply_tokens.split(",") if x.strip()})
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise SystemExit(f"--reply-tokens {args.reply_tokens!r}: give positive integers, e.g. 1,16")
    task = load_task(TaskSection(name=args.task, params={"max_turns": args.turns}))
    by_length = {str(n): measure(task, args, n) for n in lengths}
    result = {
        "task": args.task,
        "episodes": args.envs,
        "parallel_envs": args.envs,
        "max_turns": args.turns,
        "rounds": args.rounds,
        "torch_threads": args.threads,
        "reply_tokens": by_length,
        "batched_vs_sequential_by_reply_tokens": {n: r["batched_vs_sequential"] for n, r in by_length.items()},
        "batched_vs_sequential": by_length[str(lengths[-1])]["batched_vs_sequential"],
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
