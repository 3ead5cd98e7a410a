"""Reward-model scoring throughput: rollout-hpc's batched scorer (rewards.models, what a generator rank runs) against
scoring inside a reward plugin one sample at a time (what a user writes without rewards.models), on the same
classifier and the same samples, and against the compute limit of the machine.

    python tools/bench_reward.py            # 512 samples, hidden 256, 4 layers, 5 rounds
    python tools/bench_reward.py --quick    # under a minute; the last line is one JSON object

- ours: `rollout_hpc.rewards.reward_models.ClassifierRewardModel.score` with batch_size (default 32): the rows of a
  batch padded together, one forward pass each.
- inline: the same model, tokenizer and chat-template text, one sample per forward pass (a plugin function
  `reward(prompt, text)`, called in-process: no worker-process round trip is charged to it).
- limit: 2 x parameters x tokens floating-point operations at the machine's measured float32 matmul rate (a large
  square matmul, same threads): what no scorer of this model can beat.

A warm-up round, then --repeats rounds alternating ours and inline; medians and min-max spreads of samples/s; the
scores of both agree (checked). The model is made in code (random weights: speed does not depend on them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_hf import make_tiny_reward_classifier  # noqa: E402

from rollout_hpc.config import RewardModelSpec  # noqa: E402
from rollout_hpc.rewards.reward_models import load_reward_model  # noqa: E402


def samples(n: int, seed: int) -> tuple[list[str], list[str]]:
    """Arithmetic-style questions and responses of long-tailed length (most short, a few long), as RL makes."""
    rng = np.random.default_rng(seed)
    questions = [f"What is {a} + {b}? Show your work." for a, b in rng.integers(0, 1000, size=(n, 2))]
    lengths = np.minimum(rng.lognormal(mean=4.0, sigma=0.8, size=n).astype(int) + 4, 600)
    words = ["the", "sum", "is", "carry", "one", "so", "we", "add", "digits", "then", "answer"]
    responses = [" ".join(rng.choice(words, size=max(1, int(k) // 5))) for k in lengths]
    return questions, responses


def inline_scorer(rm):
    """A plugin's reward(prompt, text): tokenize one conversation, one forward pass, the logit."""
    tok, model = rm.tokenizer, rm.model

    def reward(question: str, text: str) -> float:
        enc = tok(
            rm.conversation(question, text),
            return_tensors="pt",
            truncation=True,
            max_length=rm.max_length,
            add_special_tokens=False,
        )
        with torch.inference_mode():
            return float(model(**enc).logits[0, 0])

    return reward


def matmul_flops_per_s(size: int = 1024, reps: int = 5) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * size**3 / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="128 samples, hidden 128, 5 rounds")
    args = parser.parse_args()
    if args.quick:
        args.samples, args.hidden, args.layers = 128, 128, 2

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_reward_classifier(Path(tmp) / "rm", hidden=args.hidden, layers=args.layers)
        rm = load_reward_model(
            RewardModelSpec(name="rm", path=str(path), kind="classifier", batch_size=args.batch_size, max_length=1024)
        )
    questions, responses = samples(args.samples, seed=0)
    reward = inline_scorer(rm)
    answers = [None] * len(questions)

    def ours() -> np.ndarray:
        return rm.score(questions, responses, answers)

    def inline() -> np.ndarray:
        return np.array([reward(q, r) for q, r in zip(questions, responses)])

    np.testing.assert_allclose(ours(), inline(), atol=1e-4)  # the warm-up round, and both score alike
    times: dict[str, list[float]] = {"ours": [], "inline": []}
    for i in range(args.repeats):
        for name in ("ours", "inline") if i % 2 == 0 else ("inline", "ours"):
            t = time.perf_counter()
            (ours if name == "ours" else inline)()
            times[name].append(time.perf_counter() - t)
    tokens = sum(len(rm._encode([rm.conversation(q, r)])["input_ids"][0]) for q, r in zip(questions, responses))
    params = sum(p.numel() for p in rm.model.parameters())
    limit_s = 2 * params * tokens / matmul_flops_per_s()
    rate = {k: [args.samples / t for t in v] for k, v in times.items()}
    ratios = [o / i for o, i in zip(rate["ours"], rate["inline"])]
    med = {k: statistics.median(v) for k, v in rate.items()}
    print(
        f"{args.samples} samples, {tokens} tokens, {params / 1e6:.2f} M parameters, {torch.get_num_threads()} threads"
    )
    for k in ("ours", "inline"):
        print(f"  {k:7s} {med[k]:9.1f} samples/s  [{min(rate[k]):.1f}-{max(rate[k]):.1f}]")
    print(f"  limit   {args.samples / limit_s:9.1f} samples/s  (2 x params x tokens at the measured matmul rate)")
    result = {
        "samples": args.samples,
        "tokens": tokens,
        "params": params,
        "batch_size": args.batch_size,
        "ours_samples_per_s": med["ours"],
        "inline_samples_per_s": med["inline"],
        "limit_samples_per_s": args.samples / limit_s,
        "rm_batched_vs_inline": statistics.median(ratios),
        "rm_batched_vs_inline_spread": [min(ratios), max(ratios)],
        "ours_vs_limit": med["ours"] * limit_s / args.samples,
        "repeats": args.repeats,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
