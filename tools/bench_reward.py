"""Reward-model scoring throughput: rollout-hpc's reward group and batched scorer (rewards.models) against scoring
inside a reward plugin one sample at a time (what a user writes without rewards.models), on the same classifier and
the same samples, and against the compute limit of the machine.

    python tools/bench_reward.py            # 512 samples, hidden 256, 4 layers, 5 rounds
    python tools/bench_reward.py --quick    # under a minute; the last line is one JSON object

- group: a real reward group under mpirun (the local launcher's layout: one generator, one trainer and one reward
  rank, ROLLOUT_NODE gen0/train0/rm0): the generator rank puts the samples as trajectory batches of --put-size
  records into the exchange, the reward rank (runtime.reward_group.RewardGroup) decodes and scores each put and
  forwards it, the trainer rank takes them. Clock: from a barrier after every rank is set up (the model loaded) to the
  last batch in the trainer's hands; mpirun's start-up is not in it.
- ours: `rollout_hpc.rewards.reward_models.ClassifierRewardModel.score` in this process, with batch_size (default
  32): the rows of a batch padded together, one forward pass each.
- inline: the same model, tokenizer and chat-template text, one sample per forward pass (a plugin function
  `reward(prompt, text)`, called in-process: no worker-process round trip is charged to it).
- limit: 2 x parameters x tokens floating-point operations at the machine's measured float32 matmul rate (a large
  square matmul, same threads): what no scorer of this model can beat.

Every side uses one torch thread (a reward rank's cpus_per_task default) and the same questions (the arithmetic task's
prompts) and responses (decoded from the token ids the group receives). A warm-up round, then --repeats rounds in
rotated order; medians and min-max spreads of samples/s; the scores of all three agree (checked). The model is made
in code (random weights: speed does not depend on them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_hf import make_tiny_reward_classifier  # noqa: E402

from rollout_hpc.config import load_config  # noqa: E402
from rollout_hpc.envs import load_task  # noqa: E402
from rollout_hpc.envs.base import dataset_item  # noqa: E402
from rollout_hpc.models import load_tokenizer  # noqa: E402
from rollout_hpc.rewards.reward_models import load_reward_model  # noqa: E402
from rollout_hpc.runtime.model_rewards import question_of  # noqa: E402

GROUP_CONFIG = """
run: {{name: bench-rm, seed: 0}}
task: {{name: arithmetic, params: {{max_operand: 999, ops: "+"}}}}
rewards:
  models: [{{name: rm, path: {path}, kind: classifier, batch_size: {batch_size}, max_length: 1024, nodes: 1}}]
"""


def samples(cfg, n: int, seed: int) -> tuple[list, list[list[int]]]:
    """The task's first n questions, and responses of long-tailed length (most short, a few long) as RL makes, as
    the policy's token ids."""
    rng = np.random.default_rng(seed)
    dataset = load_task(cfg.task).prompts(cfg.run.seed)
    questions = [question_of(dataset_item(dataset, i)) for i in range(n)]
    lengths = np.minimum(rng.lognormal(mean=4.0, sigma=0.8, size=n).astype(int) + 4, 600)
    words = ["the", "sum", "is", "carry", "one", "so", "we", "add", "digits", "then", "answer"]
    tokenizer = load_tokenizer(cfg.model)
    ids = [tokenizer.encode(" ".join(rng.choice(words, size=max(1, int(k) // 5)))) for k in lengths]
    return questions, ids


def puts_of(cfg, world, ids: list[list[int]], put_size: int) -> list:
    """The samples as a generator rank puts them: trajectory batches of put_size records, rule reward 0, the reward
    group's parts PENDING (the generator side of runtime.model_rewards.ModelScorer)."""
    from rollout_hpc.backends.generator import trajectory_batch
    from rollout_hpc.runtime.model_rewards import ModelScorer

    marker = ModelScorer(cfg, load_task(cfg.task).prompts(cfg.run.seed))
    puts = []
    for lo in range(0, len(ids), put_size):
        rows = list(range(lo, min(len(ids), lo + put_size)))
        batch = trajectory_batch(
            [[1] for _ in rows],
            [ids[i] for i in rows],
            [[0.0] * len(ids[i]) for i in rows],
            [0.0] * len(rows),
            prompt_index=rows,
            sample_idx=[0] * len(rows),
            gen_rank=world.rank,
            policy_version=0,
            truncated=[False] * len(rows),
            t_start=0.0,
            t_end=0.0,
        )
        puts.append(marker.apply(batch, [("train", i) for i in rows], [""] * len(rows)))
    return puts


def rank_main(run_dir: Path, args) -> None:
    """One rank of the measurement job (mpirun: gen0, train0, rm0). The generator rank also times the in-process
    scorers, in rounds interleaved with the group's; the ranks not in a round wait in sleeping barriers (a spinning
    MPI wait would take a core from the round's scorer)."""
    from rollout_hpc.runtime.world import init_world, sleeping_barrier  # MPI with threads: before mpi4py.MPI

    cfg = load_config(run_dir / "config.yaml")
    world = init_world(cfg)
    torch.set_num_threads(1)
    from rollout_hpc.exchange.forward import Exchange
    from rollout_hpc.runtime.reward_group import ALL, RewardGroup
    from rollout_hpc.runtime.train_program import experience_exchange

    if world.is_reward:
        incoming = Exchange(world, cfg, source="generator", dest="reward")
        outgoing = Exchange(world, cfg, source="reward", dest="trainer")
        RewardGroup(world, cfg, run_dir).run(incoming, outgoing)  # every round's puts, one stream
        return
    exchange = experience_exchange(world, cfg)
    sides = ["group", "ours", "inline"]
    rounds = [name for i in range(1 + args.repeats) for name in sides[i % 3 :] + sides[: i % 3]]  # 3 of warm-up
    peer = world.inter_comm  # generator rank 0 <-> trainer rank 0
    if world.is_trainer:
        for name in rounds:
            sleeping_barrier(peer)
            if name != "group":
                continue
            t0, got = time.perf_counter(), []
            while sum(map(len, got)) < args.samples:
                got.append(exchange.get_available(ALL, timeout=60))
            seconds = time.perf_counter() - t0
            batch = got[0].concat(got)
            scores = batch.reward_parts.reshape(len(batch), 2)[:, 1][np.argsort(batch.fixed["prompt_id"])]
            peer.send((seconds, scores), dest=0)
        exchange.close()
        return
    questions, ids = samples(cfg, args.samples, seed=0)
    tokenizer = load_tokenizer(cfg.model)
    responses = [tokenizer.decode(x) for x in ids]  # what the reward rank decodes
    rm = load_reward_model(cfg.rewards.models[0])
    reward = inline_scorer(rm)
    puts = puts_of(cfg, world, ids, args.put_size)
    times: dict[str, list[float]] = {name: [] for name in sides}
    scores: dict[str, np.ndarray] = {}
    for i, name in enumerate(rounds):
        sleeping_barrier(peer)
        if name == "group":  # clock: the trainer's, from the barrier to the last record in its hands
            for batch in puts:
                exchange.put(batch)
            while not peer.iprobe(source=0):  # not a blocking recv: its spin would take a core from the group
                time.sleep(0.001)
            seconds, scores[name] = peer.recv(source=0)
        else:
            t0 = time.perf_counter()
            if name == "ours":  # the same batching as the group's: each put scored whole, as a generator rank does
                scores[name] = np.concatenate(
                    [
                        rm.score(
                            questions[lo : lo + args.put_size],
                            responses[lo : lo + args.put_size],
                            [None] * args.put_size,
                        )
                        for lo in range(0, len(questions), args.put_size)
                    ]
                )
            else:
                scores[name] = np.array([reward(q, r) for q, r in zip(questions, responses)])
            seconds = time.perf_counter() - t0
        if i >= 3:  # after the warm-up
            times[name].append(seconds)
    exchange.close()
    np.testing.assert_allclose(scores["inline"], scores["ours"], atol=1e-4)  # all three score alike
    np.testing.assert_allclose(scores["group"], scores["ours"], atol=1e-4)
    tokens = sum(len(rm._encode([rm.conversation(q, r)])["input_ids"][0]) for q, r in zip(questions, responses))
    params = sum(p.numel() for p in rm.model.parameters())
    limit_s = 2 * params * tokens / matmul_flops_per_s()
    result = {"times": times, "tokens": tokens, "params": params, "limit_s": limit_s}
    (run_dir / "result.json").write_text(json.dumps(result))


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
    parser.add_argument("--put-size", type=int, default=32, help="records per generator put (a rank's step share)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="128 samples, hidden 128, 5 rounds")
    parser.add_argument("--as-rank", type=Path, help=argparse.SUPPRESS)  # a rank of the measurement job
    args = parser.parse_args()
    if args.quick:
        args.samples, args.hidden, args.layers = 128, 128, 2
    if args.as_rank:
        rank_main(args.as_rank, args)
        return
    from rollout_hpc.launch.local import launch_env

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        path = make_tiny_reward_classifier(run_dir / "rm", hidden=args.hidden, layers=args.layers)
        (run_dir / "config.yaml").write_text(GROUP_CONFIG.format(path=path, batch_size=args.batch_size))
        me = [sys.executable, __file__, "--as-rank", str(run_dir), *sys.argv[1:]]
        cmd = ["mpirun", "--oversubscribe", "--bind-to", "none"]
        for i, node in enumerate(("gen0", "train0", "rm0")):
            cmd += ([":"] if i else []) + ["-np", "1", "-x", f"ROLLOUT_NODE={node}", *me]
        done = subprocess.run(cmd, env=launch_env(), capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise SystemExit(
                f"the measurement job failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
            )
        result = json.loads((run_dir / "result.json").read_text())
    times, tokens, params, limit_s = (result[k] for k in ("times", "tokens", "params", "limit_s"))
    rate = {k: [args.samples / t for t in v] for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in rate.items()}

    def ratio(a: str, b: str) -> tuple[float, list[float]]:
        r = [x / y for x, y in zip(rate[a], rate[b])]
        return statistics.median(r), [min(r), max(r)]

    print(f"{args.samples} samples, {tokens} tokens, {params / 1e6:.2f} M parameters, 1 thread per scorer")
    for k in ("group", "ours", "inline"):
        print(f"  {k:7s} {med[k]:9.1f} samples/s  [{min(rate[k]):.1f}-{max(rate[k]):.1f}]")
    print(f"  limit   {args.samples / limit_s:9.1f} samples/s  (2 x params x tokens at the measured matmul rate)")
    group_vs_inline, group_spread = ratio("group", "inline")
    batched_vs_inline, batched_spread = ratio("ours", "inline")
    print(f"  group / inline {group_vs_inline:.2f}x [{group_spread[0]:.2f}-{group_spread[1]:.2f}]")
    print(f"  batched / inline {batched_vs_inline:.2f}x [{batched_spread[0]:.2f}-{batched_spread[1]:.2f}]")
    result = {
        "samples": args.samples,
        "tokens": tokens,
        "params": params,
        "batch_size": args.batch_size,
        "put_size": args.put_size,
        "group_samples_per_s": med["group"],
        "ours_samples_per_s": med["ours"],
        "inline_samples_per_s": med["inline"],
        "limit_samples_per_s": args.samples / limit_s,
        "rm_group_vs_inline": group_vs_inline,
        "rm_group_vs_inline_spread": group_spread,
        "rm_batched_vs_inline": batched_vs_inline,
        "rm_batched_vs_inline_spread": batched_spread,
        "group_vs_batched": med["group"] / med["ours"],
        "ours_vs_limit": med["ours"] * limit_s / args.samples,
        "repeats": args.repeats,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
