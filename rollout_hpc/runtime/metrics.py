"""Per-step training metrics: the progress line and where the numbers are stored.

Trainer group rank 0 prints one line per step and writes the metrics (and the
step's trajectories) to the run's HDF5 trajectory log (rollout_hpc.store.trajlog).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from rollout_hpc.rewards.mixing import metric_key, models_in_metrics
from rollout_hpc.runtime.scoring_rate import METRIC as RATE_METRIC
from rollout_hpc.runtime.step_plan import domain_names
from rollout_hpc.store.trajlog import TrajectoryLog, log_path
from rollout_hpc.store.trajlog import read_metrics as read_log_metrics
from rollout_hpc.trajectory import EPISODE_OK, SINGLE_TURN, TrajectoryBatch

# Fields of the progress line: (metric key, label, format). Names follow store.trajlog.STANDARD_METRICS.
_LINE = (
    ("reward_mean", "reward", "{:.3f}"),
    ("reward_std", "±", "{:.2f}"),
    ("response_len_mean", "len", "{:.1f}"),
    ("kl", "kl", "small"),  # KL is often ~1e-6 (or 0 without a reference model): see _small
    ("entropy", "ent", "{:.2f}"),
    ("clip_frac", "clip", "{:.2f}"),
    ("lr", "lr", "{:.2e}"),  # the policy's learning rate this step (algorithm.lr_schedule)
    ("staleness_max", "stale", "{:.0f}"),
    ("groups_kept", "kept", "{:.0f}"),  # dynamic sampling: informative groups trained on
    ("generation_rounds", "rounds", "{:.0f}"),
    ("gen_time", "gen", "{:.2f}s"),
    ("idle_time", "wait", "{:.2f}s"),
    ("train_time", "train", "{:.2f}s"),
    ("sync_time", "sync", "{:.2f}s"),
    ("tokens_per_s", "tok/s", "{:.0f}"),
    ("reward_errors", "reward errors", "{:.0f}"),  # shown only when non-zero
    ("success_rate", "success", "{:.2f}"),  # multi-turn episodes only (episode_metrics)
    ("turns_per_episode", "turns", "{:.1f}"),
    ("format_error_rate", "format errors", "{:.2f}"),
    ("env_errors", "env errors", "{:.0f}"),  # shown only when non-zero
)
_ONLY_NONZERO = {"reward_errors", "env_errors"}


def batch_metrics(batch: TrajectoryBatch, step: int) -> dict[str, float]:
    """What the records of one step say (rewards, lengths, staleness, generation time)."""
    f = batch.fixed
    rewards = f["reward"].astype(np.float64)
    lengths = f["response_len"].astype(np.float64)
    stale = step - f["policy_version"].astype(np.int64)
    return {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "reward_min": float(rewards.min()),
        "reward_max": float(rewards.max()),
        "response_len_mean": float(lengths.mean()),
        "response_len_max": float(lengths.max()),
        "truncated_frac": float(f["truncated"].mean()),
        "staleness_max": float(stale.max()),
        "staleness_mean": float(stale.mean()),
        "gen_time": float(f["t_end"].max() - f["t_start"].min()),  # first sample started -> last reward done
        "samples": float(len(batch)),
        "tokens": float(f["response_len"].sum() + f["prompt_len"].sum()),
        "response_tokens": float(f["response_len"].sum()),
        "reward_errors": float(np.count_nonzero(f["reward_status"])),  # raised or timed out: scored 0
        **episode_metrics(batch),
    }


def episode_metrics(batch: TrajectoryBatch) -> dict[str, float]:
    """A multi-turn step's episodes ({} for single-turn records): the share solved, turns per episode, the share of
    turns whose reply the environment could not parse, and episodes whose environment failed."""
    f = batch.fixed
    status = f["episode_status"]
    if not np.any(status != SINGLE_TURN):
        return {}
    turns = f["n_turns"].astype(np.float64)
    return {
        "success_rate": float(f["success"].mean()),
        "turns_per_episode": float(turns.mean()),
        "format_error_rate": float(f["format_errors"].sum() / max(turns.sum(), 1.0)),
        "env_errors": float(np.count_nonzero(status > EPISODE_OK)),
    }


def domain_metrics(batch: TrajectoryBatch, names: list[str]) -> dict[str, float]:
    """A mixed dataset's step per source: `samples/<name>` and `reward_mean/<name>` (records carry `domain`)."""
    out: dict[str, float] = {}
    domain, rewards = batch.fixed["domain"], batch.fixed["reward"].astype(np.float64)
    for k, name in enumerate(names):
        mine = rewards[domain == k]
        out[f"samples/{name}"] = float(len(mine))
        out[f"reward_mean/{name}"] = float(mine.mean()) if len(mine) else float("nan")
    return out


def _small(value: float) -> str:
    """A value that may be tiny or zero: 4 decimals, scientific below 1e-4, and never a negative zero
    ("-0.0000" reads as a bug; an estimator's -1e-9 is 0 within rounding)."""
    if value == 0 or abs(value) < 1e-12:
        return "0"
    if abs(value) < 1e-4:
        return f"{value:.1e}"
    return f"{value:.4f}"


def _no_negative_zero(text: str) -> str:
    """ "-0.00" (a tiny negative rounded away) as "0.00"."""
    return text[1:] if text.startswith("-") and not text.strip("-0.e+s") else text


def _reward_model_fields(m: dict[str, float]) -> list[str]:
    """ "rm helpful 0.42" per reward model (its mean raw score), with its parse failures when there are any."""
    out = []
    for name in models_in_metrics(m):
        value = m[metric_key(name, "mean")]
        text = f"rm {name} {'n/a' if np.isnan(value) else f'{value:.3f}'}"  # n/a: no reply parsed
        failures = m.get(metric_key(name, "parse_failures"), 0.0)
        if failures:
            text += f" ({failures:.0f} unparsed)"
        out.append(text)
    if out and RATE_METRIC in m:  # runtime.scoring_rate: per scoring process, while it scores
        out.append(f"rm {m[RATE_METRIC]:.0f} samples/s")
    return out


def progress_line(step: int, steps: int, m: dict[str, float]) -> str:
    parts = [f"step {step + 1}/{steps}"]
    for key, label, fmt in _LINE:
        if key in m and not (key in _ONLY_NONZERO and not m[key]):
            value = _small(m[key]) if fmt == "small" else _no_negative_zero(fmt.format(m[key]))
            if label == "±":
                parts[-1] += f" ±{value}"  # "reward 0.42 ±0.31"
                per_domain = [f"{k.partition('/')[2]} {v:.3f}" for k, v in m.items() if k.startswith("reward_mean/")]
                if per_domain:  # "reward 0.42 ±0.31 (math 0.50 code 0.17)"
                    parts[-1] += f" ({' '.join(per_domain)})"
                parts.extend(_reward_model_fields(m))
            else:
                parts.append(f"{label} {value}")
    return "  ".join(parts)


class MetricsSink:
    """Appends each step's trajectories and metrics to RUN_DIR/trajectories.h5 and prints the progress line.
    Only trainer group rank 0 owns one."""

    FLUSH_EVERY = 10

    def __init__(self, run_dir: Path, cfg, steps_done: int, quiet: bool = False):
        self.quiet = quiet
        meta = {
            "run_name": cfg.run.name,
            "group_size": cfg.algorithm.group_size,
            "max_new_tokens": cfg.algorithm.max_new_tokens,
            "max_staleness": cfg.exchange.max_staleness,
            "algorithm": cfg.algorithm.name,
            "config_digest": cfg.digest(),
            "domains": domain_names(cfg),  # a mixed dataset's sources: record field `domain` indexes this list
            "reward_models": [m.name for m in cfg.rewards.models],  # reward_parts 1.. of each record, in order
        }
        self.domains = meta["domains"] if len(meta["domains"]) > 1 else []
        # Steps logged after the checkpoint we start from were lost with the old allocation and
        # are redone: drop them (step indices are 0-based, so the last kept one is steps_done - 1).
        self.log = TrajectoryLog.open_for_append(Path(run_dir), meta, resume_step=steps_done - 1)

    def write(self, step: int, steps: int, batch: TrajectoryBatch, metrics: dict[str, float]) -> None:
        if self.domains:
            metrics = {**metrics, **domain_metrics(batch, self.domains)}
        self.log.append(batch, step)
        # Durable every FLUSH_EVERY steps (and at close), not every step: an HDF5 flush costs
        # milliseconds on the trainer's critical path, and steps lost in a crash are redone from
        # the last checkpoint anyway (resume truncates the log to it).
        self.log.append_metrics(step, metrics, flush=(step + 1) % self.FLUSH_EVERY == 0)
        if not self.quiet:
            print(progress_line(step, steps, {"step": step, **metrics}), file=sys.stdout, flush=True)

    def write_metrics(self, step: int, steps: int, metrics: dict[str, float], label: str = "step") -> None:
        """A step without trajectories (the SFT warm-up): metrics row and progress line."""
        self.log.append_metrics(step, metrics, flush=(step + 1) % self.FLUSH_EVERY == 0)
        if not self.quiet:
            line = progress_line(step, steps, {"step": step, **metrics})
            extra = f"  loss {metrics['sft_loss']:.4f}" if "sft_loss" in metrics else ""
            print(label + line.removeprefix("step") + extra, file=sys.stdout, flush=True)

    def close(self) -> None:
        self.log.flush()
        self.log.close()


def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    """The per-step metrics of a run, in step order (a replayed step keeps its last row)."""
    return read_log_metrics(log_path(run_dir))
