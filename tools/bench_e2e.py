#!/usr/bin/env python3
"""Benchmark: end-to-end RL training, rollout-hpc vs TRL's GRPOTrainer vs a plain single-process loop.

The same tiny model (the built-in random-init Llama), task (the smoke config's arithmetic), prompts, group
size, generation length, learning rate and number of steps, on this machine's CPUs, side by side:

  ours_colocated  rollout-hpc under mpirun, placement colocated: 1 generator + 1 trainer rank on one node,
               taking turns on-policy, each with all of the machine's cores in its phase
  ours_s0      rollout-hpc under mpirun, disaggregated: 1 generator rank + 1 trainer rank, one core each,
               max_staleness 0 (on-policy)
  ours_s1      the same with max_staleness 1: generation of step s+1 overlaps training of step s
  trl          trl.GRPOTrainer (single process, use_cpu), same batch: P prompts x G completions per step
  plain        a single-process loop: HF model.generate, a teacher-forced forward, GRPO loss, AdamW step
               (the floor any framework adds overhead to)

Figures: samples/s and tokens/s over the training steps (startup excluded), wall time from launch to a
rolling-10-step mean reward >= the threshold (startup included), and for ours the framework overhead:
the share of a step that is neither generation nor the trainer's forward/backward/optimizer step.
The last line printed is one JSON object with every figure.

    python tools/bench_e2e.py --quick     # < 1 minute: one round of 60 steps, no warm-up (a smoke run)
    python tools/bench_e2e.py             # a warm-up, then 5 interleaved rounds of 250 steps: medians and spreads
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def smoke_cfg(steps: int, overrides: list[str] = ()):
    from rollout_hpc.config import load_config

    return load_config(
        REPO / "configs" / "smoke.yaml", [f"algorithm.steps={steps}", "checkpoint.every_steps=0", *overrides]
    )


def time_to_threshold(times: np.ndarray, rewards: np.ndarray, t0: float, threshold: float) -> float | None:
    rolling = np.convolve(rewards, np.ones(10) / 10, mode="full")[: len(rewards)]
    rolling[:9] = [rewards[: i + 1].mean() for i in range(min(9, len(rewards)))]
    hit = np.flatnonzero(rolling >= threshold)
    return float(times[hit[0]] - t0) if len(hit) else None


def summarize(name, times, rewards, samples, tokens, t0, wall, threshold, extra=None) -> dict:
    span = times[-1] - times[0]  # first to last step end: startup and the first step excluded
    steps = len(times) - 1
    out = {
        "samples_per_s": samples * steps / span,
        "tokens_per_s": tokens * steps / span,
        "step_ms": 1000 * span / steps,
        "wall_s": wall,
        "time_to_threshold_s": time_to_threshold(times, rewards, t0, threshold),
        "reward_first10": float(rewards[:10].mean()),
        "reward_last10": float(rewards[-10:].mean()),
    }
    out.update(extra or {})
    return out


# --- ours -------------------------------------------------------------------------------


def run_ours(steps: int, staleness: int, threshold: float, placement: str = "disaggregated") -> dict:
    import yaml

    from rollout_hpc.launch.local import launch_env, mpirun_command
    from rollout_hpc.store.trajlog import read_metrics

    cfg = smoke_cfg(steps, [f"exchange.max_staleness={staleness}", f"placement={placement}"])
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp:
        run_dir = Path(tmp)
        (run_dir / "config.resolved.yaml").write_text(yaml.safe_dump(cfg.resolved()))
        cmd = mpirun_command(cfg, run_dir)  # what `rollout-hpc submit --local` runs
        env = launch_env()
        t0 = time.time()
        done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
        wall = time.time() - t0
        if done.returncode:
            raise RuntimeError(f"our run failed:\n{done.stderr[-3000:]}")
        m = read_metrics(run_dir / "trajectories.h5")
    col = lambda k: np.array([row[k] for row in m])  # noqa: E731
    period, gen, train = col("step_time")[1:], col("gen_time")[1:], col("train_compute_time")[1:]
    extra = {
        "gen_ms": 1000 * gen.mean(),
        "train_ms": 1000 * train.mean(),
        "sync_ms": 1000 * col("sync_time")[1:].mean(),
    }
    if staleness == 0:  # colocated is on-policy too
        # Sequential on-policy pipeline: a step is generation (sampling + rewards) then the trainer's
        # forward/backward/optimizer step; the rest of the loop period is the framework's.
        extra["overhead_share"] = float(1 - (gen.sum() + train.sum()) / period.sum())
        # Where it goes on the critical path (the trainer's logging overlaps the next generation):
        # last reward -> batch on the trainer (exchange + pooling), trainer work around the model step
        # (sorting, collating, advantages), weight publish (sync_ms); the rest is weights -> generation start.
        extra["handoff_ms"] = 1000 * col("handoff_time")[1:].mean()
        extra["prep_ms"] = 1000 * (col("train_time")[1:] - train).mean()
    a = cfg.algorithm
    return summarize(
        "ours",
        col("time"),
        col("reward_mean"),
        a.prompts_per_step * a.group_size,
        col("tokens").mean(),
        t0,
        wall,
        threshold,
        extra,
    )


# --- the same task for single-process baselines -----------------------------------------


def task_batch(cfg, tokenizer, dataset, step):
    from rollout_hpc.envs.base import prompt_text

    P = cfg.algorithm.prompts_per_step
    items = [dataset[i] for i in range(step * P, (step + 1) * P)]
    return items, [tokenizer.encode_prompt(prompt_text(it)) for it in items]


def run_plain(steps: int, threshold: float) -> dict:
    """HF generate + teacher-forced GRPO step in one process (2 torch threads: the whole machine)."""
    import torch

    from rollout_hpc import algos
    from rollout_hpc.envs import load_task
    from rollout_hpc.models import build_model, load_tokenizer
    from rollout_hpc.models.logprobs import left_pad

    t0 = time.time()
    torch.set_num_threads(2)
    cfg = smoke_cfg(steps)
    a = cfg.algorithm
    tok = load_tokenizer(cfg.model)
    model = build_model(cfg.model, tok.vocab_size, seed=cfg.run.seed)
    task = load_task(cfg.task)
    dataset = task.prompts(cfg.run.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.99), weight_decay=0.0)
    torch.manual_seed(cfg.run.seed)
    times, rewards, gen_s, train_s, tokens = [], [], 0.0, 0.0, 0
    for step in range(steps):
        items, prompts = task_batch(cfg, tok, dataset, step)
        g0 = time.perf_counter()
        ids, attn = left_pad(prompts, tok.pad_id)
        model.eval()
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=attn,
                do_sample=True,
                top_k=0,
                temperature=a.temperature,
                max_new_tokens=a.max_new_tokens,
                num_return_sequences=a.group_size,
                pad_token_id=tok.pad_id,
                eos_token_id=tok.eos_id,
            )
        L = ids.shape[1]
        resp = out[:, L:]
        texts = [tok.decode(r.tolist()) for r in resp]
        r = torch.tensor([task.reward(items[i // a.group_size], t) for i, t in enumerate(texts)])
        g1 = time.perf_counter()
        model.train()
        full_attn = torch.cat([attn.repeat_interleave(a.group_size, 0), (resp != tok.pad_id).long()], 1)
        logits = (
            model(input_ids=out, attention_mask=full_attn, use_cache=False).logits[:, L - 1 : -1].float()
            / a.temperature
        )
        logp = torch.log_softmax(logits, -1).gather(-1, resp[..., None])[..., 0]
        mask = (resp != tok.pad_id).float()
        adv = algos.compute_advantages("grpo", r, a.group_size, mask)
        loss, _ = algos.policy_loss(logp, logp.detach(), adv, mask, a.clip_eps, None, a.loss_agg)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), a.max_grad_norm)
        opt.step()
        g2 = time.perf_counter()
        gen_s, train_s = gen_s + g1 - g0, train_s + g2 - g1
        tokens += int(full_attn.sum())
        times.append(time.time())
        rewards.append(float(r.mean()))
    wall = time.time() - t0
    return summarize(
        "plain",
        np.array(times),
        np.array(rewards),
        a.prompts_per_step * a.group_size,
        tokens / steps,
        t0,
        wall,
        threshold,
        {"gen_ms": 1000 * gen_s / steps, "train_ms": 1000 * train_s / steps},
    )


def char_tokenizer_for_hf():
    """Our built-in character tokenizer as a transformers tokenizer (TRL needs one): same ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rollout_hpc.models.tokenizer import CharTokenizer

    ours = CharTokenizer()
    vocab = {"<pad>": ours.pad_id, "<bos>": ours.bos_id, "<eos>": ours.eos_id}
    vocab.update({c: i + 3 for i, c in enumerate(CharTokenizer.CHARS)})
    t = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    t.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    t.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")
    hf.add_special_tokens({"additional_special_tokens": ["<bos>"]})
    return hf, ours


def run_trl(steps: int, threshold: float) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rollout_hpc.envs import load_task
    from rollout_hpc.envs.base import prompt_text
    from rollout_hpc.models import build_model

    t0 = time.time()
    torch.set_num_threads(2)
    cfg = smoke_cfg(steps)
    a = cfg.algorithm
    hf_tok, ours = char_tokenizer_for_hf()
    model = build_model(cfg.model, ours.vocab_size, seed=cfg.run.seed)
    task = load_task(cfg.task)
    data = task.prompts(cfg.run.seed)
    items = [data[i] for i in range(steps * a.prompts_per_step)]
    ds = Dataset.from_dict(
        {"prompt": ["<bos>" + prompt_text(it) for it in items], "answer": [it.answer for it in items]}
    )

    def reward(prompts, completions, answer, **_):
        return [1.0 if c.strip() == ans else 0.0 for c, ans in zip(completions, answer)]

    times, rewards = [], []

    class Clock(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                times.append(time.time())
                rewards.append(logs["reward"])

    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.99), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as out:
        args = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=a.prompts_per_step * a.group_size,
            num_generations=a.group_size,
            max_completion_length=a.max_new_tokens,
            temperature=a.temperature,
            learning_rate=a.lr,
            max_steps=steps,
            beta=0.0,
            use_cpu=True,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            seed=cfg.run.seed,
            max_grad_norm=a.max_grad_norm,
            shuffle_dataset=False,
            disable_tqdm=True,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=args,
            train_dataset=ds,
            processing_class=hf_tok,
            callbacks=[Clock()],
            optimizers=(opt, sched),
        )
        with contextlib.redirect_stdout(io.StringIO()):  # its per-step log dicts
            trainer.train()
    wall = time.time() - t0
    P, G = a.prompts_per_step, a.group_size
    tokens = G * np.mean([len(ours.encode_prompt(prompt_text(it))) + a.max_new_tokens for it in items])
    return summarize("trl", np.array(times), np.array(rewards), P * G, tokens * P, t0, wall, threshold)


def ratios(results: dict) -> dict:
    """samples/s ratios: colocated_vs_plain, onpolicy_vs_trl (our fastest on-policy mode vs TRL, which is on-policy),
    best_vs_trl (our fastest mode, staleness allowed, vs TRL's), overhead_share (of our fastest on-policy mode)."""
    rate = {k: r["samples_per_s"] for k, r in results.items() if isinstance(r, dict) and "samples_per_s" in r}
    onpolicy = [k for k in ("ours_colocated", "ours_s0") if k in rate]
    out = {}
    if "ours_colocated" in rate and "plain" in rate:
        out["colocated_vs_plain"] = rate["ours_colocated"] / rate["plain"]
    if onpolicy:
        fastest = max(onpolicy, key=rate.__getitem__)
        out["overhead_share"] = results[fastest]["overhead_share"]
        if "trl" in rate:
            out["onpolicy_vs_trl"] = rate[fastest] / rate["trl"]
            best = max((k for k in rate if k.startswith("ours")), key=rate.__getitem__)
            out["best_vs_trl"] = rate[best] / rate["trl"]
    return out


def median_of(repeats: list[dict]) -> dict:
    """Each figure's median over the repeats, with samples_per_s's min and max and the number of repeats."""
    out: dict = {}
    for key in repeats[0]:
        values = [r[key] for r in repeats if r.get(key) is not None]
        out[key] = float(np.median(values)) if values else None
    rates = [r["samples_per_s"] for r in repeats]
    out.update(samples_per_s_min=min(rates), samples_per_s_max=max(rates), repeats=len(repeats))
    return out


def describe(name: str, r: dict, threshold: float) -> str:
    if "error" in r:
        return f"{name:14s} error: {r['error']}"
    ttt = r["time_to_threshold_s"]
    spread = f" [{r['samples_per_s_min']:.0f}-{r['samples_per_s_max']:.0f}]" if r.get("repeats", 1) > 1 else ""
    line = (
        f"{name:14s} {r['samples_per_s']:6.0f}{spread} samples/s {r['tokens_per_s']:7.0f} tok/s  step "
        f"{r['step_ms']:5.1f} ms  wall {r['wall_s']:5.1f} s  to reward>={threshold}: "
        f"{'-' if ttt is None else f'{ttt:.1f} s'}  reward {r['reward_first10']:.2f} -> {r['reward_last10']:.2f}"
    )
    if "overhead_share" in r:
        line += (
            f"  overhead {100 * r['overhead_share']:.1f}% (handoff {r['handoff_ms']:.1f} + prep {r['prep_ms']:.1f}"
            f" + sync {r['sync_ms']:.1f} ms)"
        )
    return line


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Full mode: one short warm-up run of each method, then --repeats rounds; each round runs every method "
        "once, in an order rotated per round, so that ours and the baselines alternate. Printed: medians with the "
        "min-max of samples/s; ratios: the median of the per-round ratios, with their min-max in ratios_spread.",
    )
    ap.add_argument("--quick", action="store_true", help="60 steps, one round, no warm-up (< 1 minute): a smoke run")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None, help="rounds (default 5; --quick 1)")
    ap.add_argument(
        "--threshold", type=float, default=None, help="rolling mean reward to time (default 0.3, quick 0.1)"
    )
    ap.add_argument(
        "--skip", default="", help="comma list of runs to skip: ours_colocated, ours_s0, ours_s1, trl, plain"
    )
    args = ap.parse_args()
    steps = args.steps or (60 if args.quick else 250)
    repeats = args.repeats or (1 if args.quick else 5)
    threshold = args.threshold if args.threshold is not None else (0.1 if args.quick else 0.3)
    skip = set(filter(None, args.skip.split(",")))
    runs = {
        "ours_colocated": lambda n: run_ours(n, 0, threshold, "colocated"),
        "ours_s0": lambda n: run_ours(n, 0, threshold),
        "ours_s1": lambda n: run_ours(n, 1, threshold),
        "trl": lambda n: run_trl(n, threshold),
        "plain": lambda n: run_plain(n, threshold),
    }
    names = [name for name in runs if name not in skip]
    errors: dict[str, str] = {}

    def attempt(name: str, n: int) -> dict | None:
        try:
            return runs[name](n)
        except Exception as exc:  # a baseline that cannot run here is reported (and fails the benchmark)
            errors[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(f"{name:14s} error: {errors[name]}", flush=True)
            return None

    if not args.quick:  # warm-up: caches, imports, the page cache; its figures are dropped
        for name in names:
            attempt(name, 10)
    rounds: list[dict[str, dict]] = []
    for k in range(repeats):
        order = names[k % len(names) :] + names[: k % len(names)] if names else []
        done: dict[str, dict] = {}
        for name in order:
            if name in errors:
                continue
            r = attempt(name, steps)
            if r is not None:
                done[name] = r
                print(f"round {k + 1}/{repeats} " + describe(name, r, threshold), flush=True)
        rounds.append(done)

    results: dict = {"steps": steps, "threshold": threshold, "repeats": repeats}
    for name in names:
        mine = [r[name] for r in rounds if name in r]
        results[name] = {"error": errors[name]} if name in errors or not mine else median_of(mine)
    per_round = [ratios(r) for r in rounds]
    keys = sorted({key for r in per_round for key in r})
    results["ratios"] = {key: float(np.median([r[key] for r in per_round if key in r])) for key in keys}
    results["ratios_spread"] = {
        key: [min(r[key] for r in per_round if key in r), max(r[key] for r in per_round if key in r)] for key in keys
    }
    print("medians:")
    for name in names:
        print(describe(name, results[name], threshold), flush=True)
    for key, value in results["ratios"].items():
        low, high = results["ratios_spread"][key]
        print(f"{key:20s} {value:.3f}  [{low:.3f}-{high:.3f}]", flush=True)
    if errors:  # a ratio against a baseline that did not run measures nothing: say so in the exit code
        print(
            f"could not run: {', '.join(errors)} (install the baselines with `tools/setup.sh --bench`, "
            "or leave a run out with --skip)",
            file=sys.stderr,
        )
    print(json.dumps(results))
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
