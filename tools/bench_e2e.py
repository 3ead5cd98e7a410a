#!/usr/bin/env python3
"""Benchmark: end-to-end RL training, rollout-hpc vs TRL's GRPOTrainer vs a plain single-process loop.

The quickstart's task (configs/quickstart.yaml: two-digit sums from a prompt file, answers of 2-3 digits then EOS,
exact-match reward) and model (the built-in tiny Llama, hidden 128), on this machine's CPUs. Every method starts
from the same weights: a short SFT run of ours (run.program sft) made once per benchmark, so that answers end in
EOS with varied lengths and generation dominates the step as in real RL (a policy that misses EOS runs on to
max_new_tokens: the long tail). Same prompts, group size, generation length (--new-tokens) and learning rate:

  ours_colocated  rollout-hpc under mpirun, placement colocated: 1 generator + 1 trainer rank on one node,
               taking turns on-policy, each with all of the machine's cores in its phase
  ours_s0      rollout-hpc under mpirun, disaggregated: 1 generator rank + 1 trainer rank, one core each,
               max_staleness 0 (on-policy)
  ours_s1      ours_s0 with max_staleness 1: generation of step s+1 overlaps training of step s
  trl          trl.GRPOTrainer (single process, use_cpu), same batch: P prompts x G completions per step
  plain        a single-process loop: HF model.generate, a teacher-forced forward, GRPO loss, AdamW step
               (the floor any framework adds overhead to)

and, for sample-level rollout scheduling, a pair on a long-tailed response length: the random-init model (no SFT)
whose answers end at any of 20 stop characters (about 0.2 a token: lengths roughly geometric, mean ~5, a few run to
max_new_tokens 32), the rest as above:

  tail_s0      ours_s0 on it
  tail_extra   the same with generator.extra_prompts P/4: each step generates a quarter more prompts, trains on the
               groups that finish first and aborts the long tail (runtime/rollout_scheduler.py)

Figures: samples/s (trained samples) and tokens/s (prompt + response tokens actually generated, EOS included) over
the training steps (startup and the first step excluded: each method's clock is its own steps' end times), wall time
from launch to a rolling-10-step mean reward >= the threshold (startup included), and for ours the framework
overhead: the share of a step that is neither generation nor the trainer's forward/backward/optimizer step.
The last line printed is one JSON object with every figure.

    python tools/bench_e2e.py --quick     # < 1 minute: one round of 10 steps, no warm-up, only ours_colocated (our
                                          # fastest on-policy mode here), trl and plain: a smoke run
    python tools/bench_e2e.py             # a warm-up, then 5 interleaved rounds of 60 steps: medians and spreads
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


QUICKSTART = REPO / "configs" / "quickstart.yaml"
DATA = REPO / "configs" / "data"


def bench_cfg(steps: int, new_tokens: int, start: Path | None, overrides: list[str] = ()):
    """The quickstart's RL phase from `start`'s weights (no warm-up, no eval, no checkpoints)."""
    from rollout_hpc.config import load_config

    return load_config(
        QUICKSTART,
        [
            f"algorithm.steps={steps}",
            f"algorithm.max_new_tokens={new_tokens}",
            "placement=disaggregated",  # the quickstart ships colocated; ours_colocated sets it again
            "checkpoint.every_steps=0",
            "warmup.sft_steps=0",
            "eval=null",
            f"task.params.train={DATA / 'sums-train.jsonl'}",
            f"task.params.val={DATA / 'sums-val.jsonl'}",
            *([f"model.init_from={start}"] if start is not None else []),
            *overrides,
        ],
    )


def launch(cfg, run_dir: Path) -> float:
    """`rollout-hpc submit --local`'s mpirun of `cfg` in run_dir; returns the wall time."""
    import yaml

    from rollout_hpc.launch.local import launch_env, mpirun_command
    from rollout_hpc.launch.mpi_env import placement_env

    (run_dir / "config.resolved.yaml").write_text(yaml.safe_dump(cfg.resolved()))
    env = {**launch_env(), **placement_env(cfg)}  # as submit --local: colocated ranks' OpenMP spin briefly
    t0 = time.time()
    done = subprocess.run(mpirun_command(cfg, run_dir), env=env, cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"our run failed:\n{done.stderr[-3000:]}")
    return time.time() - t0


TAIL_STOPS = list("QWERTYUIOPASDFGHJKLZ")  # the long-tailed pair's stop strings: 20 of 99 tokens, ~0.2 a token
TAIL_TOKENS = 32


def make_start(directory: Path, sft_steps: int, new_tokens: int) -> Path:
    """The weights every method starts from: `sft_steps` of the quickstart's SFT warm-up (run.program sft)."""
    cfg = bench_cfg(1, new_tokens, None, ["run.program=sft", f"warmup.sft_steps={sft_steps}"])
    run_dir = directory / "start"
    run_dir.mkdir()
    seconds = launch(cfg, run_dir)
    print(f"start weights: {sft_steps} SFT steps of the quickstart in {seconds:.1f} s ({run_dir})", flush=True)
    return run_dir


def start_policy(cfg, vocab_size: int):
    """The built-in model with the start weights (what model.init_from gives our ranks)."""
    from rollout_hpc.backends.generate_hf import load_weights_into
    from rollout_hpc.models import build_model
    from rollout_hpc.models.export import init_weights

    model = build_model(cfg.model, vocab_size, seed=cfg.run.seed)
    load_weights_into(model, init_weights(cfg.model.init_from).weights)
    return model


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


def run_ours(cfg, threshold: float) -> dict:
    from rollout_hpc.store.trajlog import read_metrics

    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp:
        run_dir = Path(tmp)
        t0 = time.time()
        wall = launch(cfg, run_dir)
        m = read_metrics(run_dir / "trajectories.h5")
    col = lambda k: np.array([row[k] for row in m])  # noqa: E731
    period, gen, train = col("step_time")[1:], col("gen_time")[1:], col("train_compute_time")[1:]
    extra = {
        "gen_ms": 1000 * gen.mean(),
        "train_ms": 1000 * train.mean(),
        "sync_ms": 1000 * col("sync_time")[1:].mean(),
        "response_len": float(col("response_len_mean").mean()),
    }
    if cfg.exchange.max_staleness == 0:  # colocated is on-policy too
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
    from rollout_hpc.models.prompting import encode_prompt_item

    P = cfg.algorithm.prompts_per_step
    items = [dataset[i] for i in range(step * P, (step + 1) * P)]
    return items, [encode_prompt_item(tokenizer, it, cfg.task.params.get("chat_template", "auto")) for it in items]


def run_plain(cfg, threshold: float) -> dict:
    """HF generate + teacher-forced GRPO step in one process (2 torch threads: the whole machine)."""
    import torch

    from rollout_hpc import algos
    from rollout_hpc.envs import load_task
    from rollout_hpc.models import load_tokenizer
    from rollout_hpc.models.logprobs import left_pad

    t0 = time.time()
    torch.set_num_threads(2)
    a, steps = cfg.algorithm, cfg.algorithm.steps
    tok = load_tokenizer(cfg.model)
    model = start_policy(cfg, tok.vocab_size)
    task = load_task(cfg.task)
    dataset = task.prompts(cfg.run.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.99), weight_decay=0.0)
    torch.manual_seed(cfg.run.seed)
    times, rewards, gen_s, train_s, tokens, lengths = [], [], 0.0, 0.0, 0, []
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
        lengths.append(float(mask.sum(1).mean()))
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
        {"gen_ms": 1000 * gen_s / steps, "train_ms": 1000 * train_s / steps, "response_len": float(np.mean(lengths))},
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


def run_trl(cfg, threshold: float) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rollout_hpc.envs import load_task

    t0 = time.time()
    torch.set_num_threads(2)
    a, steps = cfg.algorithm, cfg.algorithm.steps
    hf_tok, ours = char_tokenizer_for_hf()
    model = start_policy(cfg, ours.vocab_size)
    task = load_task(cfg.task)
    data = task.prompts(cfg.run.seed)
    P, G = a.prompts_per_step, a.group_size
    _, prompts = zip(*(task_batch(cfg, ours, data, s) for s in range(steps)))
    flat = [p for step in prompts for p in step]  # the same token ids as ours (BOS + the raw prompt)
    assert all(p[0] == ours.bos_id for p in flat)  # the char tokenizer for HF writes it from the text "<bos>"
    ds = Dataset.from_dict({"prompt": ["<bos>" + ours.decode(p[1:]) for p in flat], "index": list(range(len(flat)))})

    def reward(prompts, completions, index, **_):
        return [task.reward(data[i], c) for c, i in zip(completions, index)]

    times, rewards, lengths = [], [], []

    class Clock(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                times.append(time.time())
                rewards.append(logs["reward"])
                lengths.append(logs["completions/mean_length"])  # tokens generated, EOS included

    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.99), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as out:
        args = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=P * G,
            num_generations=G,
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
    # per step after the first (as the others count): its prompts' tokens and the completion tokens TRL logged
    tokens = G * float(np.mean([sum(map(len, step)) for step in prompts[1:]])) + P * G * float(np.mean(lengths[1:]))
    return summarize(
        "trl",
        np.array(times),
        np.array(rewards),
        P * G,
        tokens,
        t0,
        wall,
        threshold,
        {"response_len": float(np.mean(lengths))},
    )


def ratios(results: dict) -> dict:
    """samples/s ratios: colocated_vs_plain, onpolicy_vs_trl (our fastest on-policy mode vs TRL, which is on-policy),
    best_vs_trl (our fastest mode, staleness allowed, vs TRL's), overhead_share (of our fastest on-policy mode),
    extra_vs_s0 (on the long-tailed pair: extra prompts against the same on-policy run without them)."""
    rate = {k: r["samples_per_s"] for k, r in results.items() if isinstance(r, dict) and "samples_per_s" in r}
    onpolicy = [k for k in ("ours_colocated", "ours_s0") if k in rate]
    out = {}
    if "ours_colocated" in rate and "plain" in rate:
        out["colocated_vs_plain"] = rate["ours_colocated"] / rate["plain"]
    if "tail_extra" in rate and "tail_s0" in rate:
        out["extra_vs_s0"] = rate["tail_extra"] / rate["tail_s0"]
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
        f"{r['step_ms']:5.1f} ms  answer {r['response_len']:4.1f} tok  wall {r['wall_s']:5.1f} s  to reward>={threshold}: "
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
    ap.add_argument(
        "--quick",
        action="store_true",
        help="10 steps, one round, no warm-up, ours_colocated, trl and plain only (< 1 minute): a smoke run",
    )
    ap.add_argument("--steps", type=int, default=None, help="RL steps of each run (default 60; --quick 10)")
    ap.add_argument("--repeats", type=int, default=None, help="rounds (default 5; --quick 1)")
    ap.add_argument("--sft-steps", type=int, default=None, help="SFT steps of the start weights (default 90; quick 20)")
    ap.add_argument("--new-tokens", type=int, default=8, help="max_new_tokens: room for the long tail (default 8)")
    ap.add_argument(
        "--threshold", type=float, default=None, help="rolling mean reward to time (default 0.6, quick 0.3)"
    )
    ap.add_argument(
        "--skip",
        default="",
        help="comma list of runs to skip: ours_colocated, ours_s0, ours_s1, tail_s0, tail_extra, trl, plain",
    )
    args = ap.parse_args()
    steps = args.steps or (10 if args.quick else 60)
    repeats = args.repeats or (1 if args.quick else 5)
    threshold = args.threshold if args.threshold is not None else (0.3 if args.quick else 0.6)
    quick_skips = {"ours_s0", "ours_s1", "tail_s0", "tail_extra"}  # a minute's budget: each of our runs starts ~9 s
    skip = set(filter(None, args.skip.split(","))) | (quick_skips if args.quick else set())
    workdir = Path(tempfile.mkdtemp(prefix="bench-e2e-start-"))
    start = make_start(workdir, args.sft_steps or (20 if args.quick else 90), args.new_tokens)
    P = bench_cfg(1, args.new_tokens, start).algorithm.prompts_per_step
    tail = [f"algorithm.stop={json.dumps(TAIL_STOPS)}", "model.max_seq_len=64"]
    modes = {
        "ours_colocated": (args.new_tokens, start, ["placement=colocated"]),
        "ours_s0": (args.new_tokens, start, []),
        "ours_s1": (args.new_tokens, start, ["exchange.max_staleness=1"]),
        "tail_s0": (TAIL_TOKENS, None, tail),
        "tail_extra": (TAIL_TOKENS, None, [*tail, f"generator.extra_prompts={max(1, P // 4)}"]),
    }
    runs = {name: lambda n, m=m: run_ours(bench_cfg(n, *m), threshold) for name, m in modes.items()}
    runs["trl"] = lambda n: run_trl(bench_cfg(n, args.new_tokens, start), threshold)
    runs["plain"] = lambda n: run_plain(bench_cfg(n, args.new_tokens, start), threshold)
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

    results: dict = {"steps": steps, "threshold": threshold, "repeats": repeats, "new_tokens": args.new_tokens}
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
    shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(results))
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
