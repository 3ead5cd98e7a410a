#!/usr/bin/env python3
"""Generation speed of the HF backend: our sampling loop (backends/generate_hf.generate, as HFGenerator calls it: one
torch.Generator per row) against plain Hugging Face `model.generate` on the same batch, and our loop with the
compaction of finished rows against the same loop with a fixed batch shape.

    .venv/bin/python tools/bench_generate.py --quick     # 16 prompts x 8 samples, 64 new tokens, 5 rounds (< 1 minute)
    .venv/bin/python tools/bench_generate.py --prompts 32 --samples 8 --rounds 7

The model is the built-in tiny Llama (hidden 128, 2 layers, 4 heads, random weights) made long-tailed: its lm_head
is untied from the input embedding (a copy), the EOS row of its weight zeroed and a bias added that is 0 for every
token but EOS and log(p / (1 - p) * (V - 1) * E[exp(logit)]) for EOS. The other logits stay small (random init: std
about 0.2), so every step ends a response with probability about p (--eos-prob, 0.06): response lengths are roughly
geometric (median ~11, a tenth of the rows still going at 37 tokens), the long tail that compaction is for.

Every side samples at temperature 1 from the full distribution (HF: top_k=0, top_p=1) and stops at EOS; a warm-up
round of each comes first, then `--rounds` interleaved rounds (compacted, fixed, hf, compacted, ...), each timing
only the generation call (HF's left-padded input is built before; our clock includes making the per-row generators).
Tokens/s counts the response tokens each side produced, up to and including EOS. Compacted and fixed should sample
the same tokens (same seeds; compared every round: the share of rows that differ and the largest log-probability
difference are printed, not hidden). The last stdout line is one JSON object with medians and spreads [min, max] of
tokens/s and of the per-round ratios (ratio_spreads), and `ratios`: their medians, ours_vs_hf_generate (compacted /
hf tokens/s) and compacted_vs_fixed.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from bench_agentic import spread  # noqa: E402 - the same median/min/max summary (tools/ is the script's directory)

from rollout_hpc.backends.generate_hf import RowStreams, SamplingParams, generate  # noqa: E402
from rollout_hpc.config import ModelSection  # noqa: E402
from rollout_hpc.models import CharTokenizer, build_model  # noqa: E402
from rollout_hpc.models.logprobs import left_pad  # noqa: E402


@torch.no_grad()
def long_tailed_model(tok, max_seq_len: int, eos_prob: float, seed: int = 0):
    """The built-in tiny model whose every step samples EOS with probability about `eos_prob` (module docstring)."""
    model = build_model(
        ModelSection(hidden_size=128, num_layers=2, num_heads=4, max_seq_len=max_seq_len), tok.vocab_size, seed
    )
    head = model.lm_head
    head.weight = torch.nn.Parameter(head.weight.detach().clone())  # untied: the input embeddings stay as built
    head.weight[tok.eos_id] = 0.0
    hidden = torch.randn(512, head.in_features, generator=torch.Generator().manual_seed(seed))  # final states ~ N(0, 1)
    spread_of_logits = float((hidden @ head.weight.T).std())
    bias = torch.zeros(head.out_features)
    others = (head.out_features - 1) * math.exp(spread_of_logits**2 / 2)  # E[sum of exp(logit)] over the others
    bias[tok.eos_id] = math.log(eos_prob / (1 - eos_prob) * others)
    head.bias = torch.nn.Parameter(bias)
    return model.eval()


def make_prompts(tok, n: int, samples: int) -> list[list[int]]:
    """`n` arithmetic prompts of a few lengths, each `samples` times (a GRPO group)."""
    texts = [f"{7 * i % 97}+{(13 * i + 5) % (10 ** (1 + i % 3))}=" for i in range(n)]
    return [tok.encode_prompt(t) for t in texts for _ in range(samples)]


def ours(model, prompts, seeds, params, pad_id, compact: bool):
    """(seconds, response tokens, responses) of our loop, with per-row generators as HFGenerator.generate builds."""
    t0 = time.perf_counter()
    out = generate(model, prompts, params, pad_id, RowStreams(seeds), compact=compact)
    seconds = time.perf_counter() - t0
    return seconds, sum(len(r) for r in out.response_ids), out


def hf(model, ids, attn, max_new_tokens: int, tok, seed: int):
    """(seconds, response tokens) of model.generate on its own left-padded batch (built before the clock starts)."""
    torch.manual_seed(seed)  # the same draws every round
    t0 = time.perf_counter()
    seqs = model.generate(
        input_ids=ids,
        attention_mask=attn,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
    )
    seconds = time.perf_counter() - t0
    resp = seqs[:, ids.shape[1] :]
    is_eos = resp == tok.eos_id
    # up to and including the first EOS; the whole width where there is none
    lengths = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, resp.shape[1])
    return seconds, int(lengths.sum())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16 prompts x 8 samples, 64 new tokens, 5 rounds")
    ap.add_argument("--prompts", type=int, default=32, help="distinct prompts of the batch")
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt (rows = prompts x samples)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--eos-prob", type=float, default=0.06, help="probability of EOS at every step")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds after the warm-up (at least 5)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: a generator rank's share of a node)")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.samples, args.max_new_tokens, args.rounds = 16, 8, 64, 5
    args.rounds = max(args.rounds, 5)
    torch.set_num_threads(args.threads)

    tok = CharTokenizer()
    prompts = make_prompts(tok, args.prompts, args.samples)
    model = long_tailed_model(tok, max(len(p) for p in prompts) + args.max_new_tokens, args.eos_prob)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, stop_ids=(tok.eos_id,))
    seeds = list(range(len(prompts)))
    hf_ids, hf_attn = left_pad(prompts, tok.pad_id, "cpu")

    sides = ("compacted", "fixed", "hf")
    rates: dict[str, list[float]] = {s: [] for s in sides}
    tokens: dict[str, int] = {}
    differ = lp_diff = 0.0
    for rnd in range(args.rounds + 1):  # round 0 warms up (allocator, threads, first calls)
        label = "warm-up" if rnd == 0 else f"round {rnd}"
        results = {}
        for side in sides:
            if side == "hf":
                seconds, n_tok = hf(model, hf_ids, hf_attn, args.max_new_tokens, tok, seed=1)
            else:
                seconds, n_tok, results[side] = ours(model, prompts, seeds, params, tok.pad_id, side == "compacted")
            tokens[side] = n_tok
            print(
                f"{label:8s} {side:9s} {seconds:7.3f} s  {n_tok:6d} tokens  {n_tok / seconds:9.1f} tokens/s", flush=True
            )
            if rnd:
                rates[side].append(n_tok / seconds)
        a, b = results["compacted"], results["fixed"]
        differ = sum(x != y for x, y in zip(a.response_ids, b.response_ids)) / len(prompts)
        same = [(x, y) for x, y, r, s in zip(a.logprobs, b.logprobs, a.response_ids, b.response_ids) if r == s]
        lp_diff = max((abs(u - v) for x, y in same for u, v in zip(x, y)), default=0.0)
    if differ:
        print(
            f"compacted and fixed sampled different tokens in {differ:.1%} of the rows (batch-size dependent matmuls)"
        )
    lengths = sorted(len(r) for r in results["compacted"].response_ids)

    def ratio(x: str, y: str) -> dict:
        return spread([u / v for u, v in zip(rates[x], rates[y])])

    spreads = {"ours_vs_hf_generate": ratio("compacted", "hf"), "compacted_vs_fixed": ratio("compacted", "fixed")}
    result = {
        "rows": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "eos_prob": args.eos_prob,
        "rounds": args.rounds,
        "torch_threads": args.threads,
        "response_len": {
            "median": statistics.median(lengths),
            "p90": lengths[int(0.9 * len(lengths))],
            "max": lengths[-1],
        },
        "tokens": tokens,
        **{f"{side}_tokens_per_s": spread(v) for side, v in rates.items()},
        "compacted_vs_fixed_rows_differ": differ,
        "compacted_vs_fixed_max_logprob_diff": lp_diff,
        "ratio_spreads": spreads,
        "ratios": {k: v["median"] for k, v in spreads.items()},
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
