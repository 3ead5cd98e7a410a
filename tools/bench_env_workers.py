#!/usr/bin/env python3
"""Environments whose step costs CPU in Python (a simulator): stepped in threads of the generator rank (the default)
against `envs.workers` worker processes (envs/process_envs.py), on the same episodes and policy (docs/agentic.md).

    .venv/bin/python tools/bench_env_workers.py --quick        # 64 sokoban episodes, 4 turns, 2 ms a step, 5 rounds
    .venv/bin/python tools/bench_env_workers.py --step-ms 5 --workers 2 --rounds 7

The environment is the built-in sokoban with `--step-ms` milliseconds of pure-Python work added to every reset and
step (it holds the interpreter lock, as a Python simulator does). Three modes, same episodes (checked), a warm-up
round of each, then `--rounds` interleaved rounds:
  threads   the environments in threads of this process: their Python work is serialised by the interpreter lock
  workers   the environments in --workers processes: their work runs beside the policy's, on other cores
  free      the same episodes with environments that cost nothing (threads): the policy's time alone
The limit for the workers: the free round's time plus the environments' work (resets + steps x step-ms) spread over
min(workers, cores) cores (the policy waits for every observation of a turn, so the two do not overlap).
The last stdout line is one JSON object: medians and spreads of episodes/s, the limit, workers_vs_threads (median
ratio) and workers_vs_limit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from bench_agentic import spread  # noqa: E402 - the same median/min/max summary (tools/ is the script's directory)

from rollout_hpc.backends.episodes import EpisodeSettings  # noqa: E402
from rollout_hpc.backends.generate_hf import HFGenerator, SamplingParams  # noqa: E402
from rollout_hpc.config import ModelSection, TaskSection  # noqa: E402
from rollout_hpc.envs import load_task  # noqa: E402
from rollout_hpc.envs.process_envs import ProcessEnvs  # noqa: E402
from rollout_hpc.models import CharTokenizer, build_model  # noqa: E402

# sokoban with a busy loop of STEP_MS in every reset and step (a Python simulator's work)
PLUGIN = """
import time
from rollout_hpc.envs.sokoban import SokobanEnv, SokobanTask

def busy(ms):
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass

class CostlyEnv(SokobanEnv):
    def __init__(self, step_ms, **params):
        super().__init__(**params)
        self.step_ms = step_ms

    def reset(self, item):
        busy(self.step_ms)
        return super().reset(item)

    def step(self, text):
        busy(self.step_ms)
        return super().step(text)

class CostlyTask(SokobanTask):
    def __init__(self, step_ms=0.0, **params):
        self.step_ms = step_ms
        super().__init__(**params)

    def make_env(self):
        return CostlyEnv(self.step_ms, **self.params)
"""


def play(gen, task, envs: int) -> tuple[float, list]:
    t0 = time.perf_counter()
    batch = gen.rollout(task.prompts(0), list(range(envs)), 1, 0, 0)
    seconds = time.perf_counter() - t0
    f = batch.fixed
    return seconds, list(zip(f["n_turns"].tolist(), f["response_len"].tolist(), f["reward"].tolist()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="64 episodes, max_turns 4, 2 ms a step, 5 rounds")
    ap.add_argument("--envs", type=int, default=64, help="episodes per round (all stepped at once)")
    ap.add_argument("--turns", type=int, default=6, help="max_turns of an episode")
    ap.add_argument("--step-ms", type=float, default=3.0, help="pure-Python work per reset/step, milliseconds")
    ap.add_argument("--workers", type=int, default=2, help="environment worker processes (envs.workers)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds after the warm-up (at least 5)")
    args = ap.parse_args()
    if args.quick:
        args.envs, args.turns, args.step_ms, args.rounds = 64, 4, 2.0, 5
    args.rounds = max(args.rounds, 5)
    torch.set_num_threads(1)  # a generator rank's share of a node

    tmp = Path(tempfile.mkdtemp(prefix="bench_env_workers"))
    (tmp / "costly_sokoban.py").write_text(PLUGIN)
    params = {"max_turns": args.turns, "size": 5}
    costly = TaskSection(name=f"{tmp / 'costly_sokoban.py'}:CostlyTask", params={**params, "step_ms": args.step_ms})
    free = TaskSection(name=f"{tmp / 'costly_sokoban.py'}:CostlyTask", params={**params, "step_ms": 0.0})

    tok = CharTokenizer()
    model = build_model(ModelSection(max_seq_len=64 + 70 * args.turns), tok.vocab_size, seed=0).eval()
    sampling = SamplingParams(max_new_tokens=1, stop_ids=(tok.eos_id,))
    gens = {}
    for mode, section in (("threads", costly), ("workers", costly), ("free", free)):
        task = load_task(section)
        gen = HFGenerator(model, tok, task, sampling, seed=0)
        gen.episodes = EpisodeSettings(parallel_envs=args.envs)
        if mode == "workers":
            gen.env_host = ProcessEnvs(section, None, args.workers, timeout=30.0)
        gens[mode] = (gen, task)

    rates: dict[str, list[float]] = {m: [] for m in gens}
    played: dict[str, list] = {}
    for rnd in range(args.rounds + 1):  # round 0 warms up (and starts the workers)
        for mode, (gen, task) in gens.items():
            seconds, episodes = play(gen, task, args.envs)
            played.setdefault(mode, episodes)
            if episodes != played["threads"]:
                raise SystemExit(f"round {rnd}: {mode} played other episodes than threads: the comparison is void")
            label = "warm-up" if rnd == 0 else f"round {rnd}"
            print(f"{label:8s} {mode:8s} {seconds:7.3f} s  {args.envs / seconds:8.1f} episodes/s", flush=True)
            if rnd:
                rates[mode].append(args.envs / seconds)
    gens["workers"][0].env_host.close()
    ratios = [w / t for w, t in zip(rates["workers"], rates["threads"])]
    calls = sum(t + 1 for t, _, _ in played["threads"])  # a reset and each turn's step
    parallel = min(args.workers, len(os.sched_getaffinity(0)))
    limit = [args.envs / (args.envs / free + calls * args.step_ms / 1000 / parallel) for free in rates["free"]]
    result = {
        "episodes": args.envs,
        "max_turns": args.turns,
        "step_ms": args.step_ms,
        "workers": args.workers,
        "cores": len(os.sched_getaffinity(0)),
        "rounds": args.rounds,
        "turns": sum(t for t, _, _ in played["threads"]),
        **{f"{mode}_episodes_per_s": spread(v) for mode, v in rates.items()},
        "round_ratios": [round(r, 2) for r in ratios],
        "workers_vs_threads": statistics.median(rates["workers"]) / statistics.median(rates["threads"]),
        "limit_episodes_per_s": spread(limit),
        "workers_vs_limit": statistics.median(rates["workers"]) / statistics.median(limit),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
