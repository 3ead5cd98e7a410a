"""Synthetic trajectory batches and logs, built vectorised: test fixtures (and tools/bench_analysis.py) for the
store and the analysis. Tests import it as `synthetic_trajectories` (tests/ is on their sys.path, as tiny_hf)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rollout_hpc.store.trajlog import TrajectoryLog
from rollout_hpc.trajectory import FIXED_DTYPE, TrajectoryBatch

T0 = 1_700_000_000.0


def synthetic_batch(
    rng: np.random.Generator,
    n: int,
    step: int,
    group_size: int = 4,
    max_new_tokens: int = 16,
    prompt_len: int = 8,
    vocab: int = 64,
    multi_turn: bool = False,
    lag: int = 0,
) -> TrajectoryBatch:
    """n trajectories of train step `step`: rewards that improve with the step, lengths up to max_new_tokens."""
    fixed = np.zeros(n, FIXED_DTYPE)
    fixed["prompt_id"] = step * (n // group_size + 1) + np.arange(n) // group_size
    fixed["sample_idx"] = np.arange(n) % group_size
    fixed["policy_version"] = max(0, step - lag) if lag else step
    fixed["reward"] = np.clip(rng.normal(0.8 - 0.6 * np.exp(-step / 50), 0.3, n), 0, 1).astype(np.float32)
    fixed["prompt_len"] = prompt_len
    resp = rng.integers(1, max_new_tokens + 1, n).astype(np.uint32)
    fixed["response_len"] = resp
    fixed["truncated"] = resp == max_new_tokens
    turns = np.where(multi_turn, rng.integers(1, 4, n), 1).astype(np.uint32)
    turns = np.minimum(turns, resp)
    fixed["n_turns"] = turns
    start = T0 + 2.0 * step  # deterministic clock: one step every two seconds
    fixed["t_start"] = start
    fixed["t_end"] = start + rng.random(n)
    total = int(resp.sum())
    # turn i of a response starts at i * len // n_turns (turn 0 at 0)
    turn_row = np.repeat(np.arange(n), turns)
    turn_idx = np.arange(len(turn_row)) - np.repeat(np.cumsum(turns) - turns, turns)
    turn_starts = (turn_idx * resp[turn_row] // turns[turn_row]).astype(np.int32)
    mask = np.ones(total, np.uint8)
    if multi_turn:
        mask[rng.random(total) < 0.2] = 0
    return TrajectoryBatch(
        fixed,
        prompt_ids=rng.integers(0, vocab, n * prompt_len).astype(np.int32),
        response_ids=rng.integers(0, vocab, total).astype(np.int32),
        logprobs=-rng.random(total, dtype=np.float32) * 3,
        loss_mask=mask,
        turn_starts=turn_starts,
        # the environment's per-turn rewards: 0 for single-turn records, as a real log has them
        turn_rewards=(rng.normal(0, 0.3, len(turn_starts)) if multi_turn else np.zeros(len(turn_starts))).astype(
            np.float32
        ),
    )


def write_synthetic_log(
    path: str | Path, steps: int, per_step: int, seed: int = 0, restart_at: int | None = None, **batch_kw
) -> None:
    """A complete trajectory log of `steps` steps with per-step metrics (one restart at `restart_at`)."""
    rng = np.random.default_rng(seed)
    meta = {
        "run_name": "synthetic",
        "group_size": batch_kw.get("group_size", 4),
        "max_new_tokens": batch_kw.get("max_new_tokens", 16),
        "max_staleness": batch_kw.get("lag", 0),
    }
    log = TrajectoryLog.open_for_append(path, meta)
    try:
        for step in range(steps):
            allocation = int(restart_at is not None and step >= restart_at)
            batch = synthetic_batch(rng, per_step, step, **batch_kw)
            log.append(batch, step)
            log.append_metrics(
                step,
                {
                    "time": T0 + 2.0 * step + 1.65,
                    "kl": 0.01 * step / steps,
                    "entropy": 2.0 - step / steps,
                    "clip_frac": 0.1,
                    "gen_time": 1.0,
                    "train_time": 0.5,
                    "sync_time": 0.1,
                    "idle_time": 0.05,
                    "tokens_per_s": batch.n_tokens / 1.65,
                    "allocation": allocation,
                    "policy_version": step,
                },
                flush=(step % 16 == 15 or step == steps - 1),
            )
    finally:
        log.close()
