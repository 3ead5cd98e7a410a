"""One pass over a trajectory log, in bounded memory: the numbers that say how a run went.

`analyze_run` streams the per-trajectory columns in chunks (a rich progress bar
shows on long reads in a terminal) into per-step accumulators and histograms,
joins the per-step metrics table (and the eval table, when the run validated
during training), and returns a `RunAnalysis`: a JSON-able
summary plus per-step series for the figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from rollout_hpc.analysis.run_info import launches, resolved_config, run_dir_of
from rollout_hpc.rewards.mixing import metric_key, models_in_metrics
from rollout_hpc.store.trajlog import TrajectoryReader, read_meta
from rollout_hpc.trajectory import EPISODE_OK, REWARD_OK, REWARD_TIMEOUT, SINGLE_TURN

CHUNK_ROWS = 1 << 16
PROGRESS_MIN_ROWS = 1 << 20  # show a progress bar from this many trajectories on
_COLUMNS = [
    "step",
    "reward",
    "prompt_len",
    "response_len",
    "truncated",
    "staleness",
    "t_start",
    "t_end",
    "reward_status",
    "domain",
    "episode_status",
    "n_turns",
    "format_errors",
    "success",
]
# Metric names some writers use for the standard columns of the metrics table.
METRIC_ALIASES = {
    "gen_time": ("gen_time", "gen_span_s"),
    "train_time": ("train_time", "train_s"),
    "sync_time": ("sync_time", "sync_s"),
    "idle_time": ("idle_time", "gen_wait_s"),
    "staleness_max": ("staleness_max", "staleness"),
    "response_len_mean": ("response_len_mean", "response_len"),
}
TIME_PARTS = ("gen_time", "train_time", "sync_time", "idle_time")
TRUNCATION_WARN = 0.10  # warn when more than this share of responses hit max_new_tokens


@dataclass
class RunAnalysis:
    summary: dict  # JSON-able
    per_step: dict[str, np.ndarray]  # step-indexed series (trajectory stats joined with metrics)
    length_hist: np.ndarray  # count of responses per length
    staleness_hist: np.ndarray  # count of trajectories per staleness
    warnings: list[str] = field(default_factory=list)
    eval: dict[str, np.ndarray] = field(default_factory=dict)  # eval table, one entry per eval ({} if none)
    domains: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # a mixture's per-source series


class _StepAccumulator:
    """Per-step sums, min and max grown as larger steps appear."""

    def __init__(self) -> None:
        self.size = 0
        self.count = np.zeros(0)
        self.sums: dict[str, np.ndarray] = {}
        self.mins: dict[str, np.ndarray] = {}
        self.maxs: dict[str, np.ndarray] = {}

    def _grow(self, size: int) -> None:
        if size <= self.size:
            return
        size = max(size, 2 * self.size)
        pad = size - self.size
        self.count = np.concatenate([self.count, np.zeros(pad)])
        for d, fill in ((self.sums, 0.0), (self.mins, np.inf), (self.maxs, -np.inf)):
            for k in d:
                d[k] = np.concatenate([d[k], np.full(pad, fill)])
        self.size = size

    def add(self, steps: np.ndarray, **values: np.ndarray) -> None:
        if not len(steps):
            return
        self._grow(int(steps.max()) + 1)
        self.count += np.bincount(steps, minlength=self.size)
        for name, v in values.items():
            v = v.astype(np.float64)
            for d, fill in ((self.sums, 0.0), (self.mins, np.inf), (self.maxs, -np.inf)):
                d.setdefault(name, np.full(self.size, fill))
            self.sums[name] += np.bincount(steps, weights=v, minlength=self.size)
            self.sums.setdefault(name + "^2", np.zeros(self.size))
            self.sums[name + "^2"] += np.bincount(steps, weights=v * v, minlength=self.size)
            np.minimum.at(self.mins[name], steps, v)
            np.maximum.at(self.maxs[name], steps, v)


def _bincount_into(hist: np.ndarray, values: np.ndarray) -> np.ndarray:
    counts = np.bincount(values)
    if len(counts) > len(hist):
        hist = np.concatenate([hist, np.zeros(len(counts) - len(hist), np.int64)])
    hist[: len(counts)] += counts
    return hist


def _metric(table: dict[str, np.ndarray], name: str) -> np.ndarray | None:
    for alias in METRIC_ALIASES.get(name, (name,)):
        if alias in table and not np.isnan(table[alias]).all():
            return table[alias]
    return None


def _rl_rows(table: dict[str, np.ndarray], values: np.ndarray | None) -> np.ndarray | None:
    """A metric's values on RL steps only (an SFT warm-up's rows have an sft_loss; they also log an entropy)."""
    sft = table.get("sft_loss")
    if values is None or sft is None:
        return values
    rl = values[np.isnan(sft)]
    return rl if len(rl) and not np.isnan(rl).all() else None


def _sft_summary(table: dict[str, np.ndarray]) -> dict | None:
    """The SFT warm-up's steps and loss (None for a run without one)."""
    sft = table.get("sft_loss")
    if sft is None or np.isnan(sft).all():
        return None
    loss = sft[~np.isnan(sft)]
    return {"steps": int(len(loss)), "loss_first": float(loss[0]), "loss_last": float(loss[-1])}


def _stats(values: np.ndarray | None) -> dict | None:
    if values is None:
        return None
    v = values[~np.isnan(values)]
    if not len(v):
        return None
    return {
        "first": float(v[0]),
        "last": float(v[-1]),
        "mean": float(v.mean()),
        "min": float(v.min()),
        "max": float(v.max()),
    }


def _percentile_from_hist(hist: np.ndarray, q: float) -> float:
    total = hist.sum()
    if not total:
        return float("nan")
    return float(np.searchsorted(np.cumsum(hist), q * total, side="left"))


def _progress(total: int, label: str) -> Progress:
    console = Console(stderr=True)
    return Progress(
        TextColumn(label),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=total < PROGRESS_MIN_ROWS or not console.is_terminal,
    )


@dataclass
class _Totals:
    """Whole-run scalars and histograms, accumulated chunk by chunk."""

    n: int = 0
    tokens: int = 0
    truncated: int = 0
    reward_errors: int = 0  # reward_status != REWARD_OK: the reward is a stand-in 0
    reward_timeouts: int = 0  # of those, the reward function ran past its timeout
    reward_sum: float = 0.0
    reward_sq: float = 0.0
    reward_min: float = math.inf
    reward_max: float = -math.inf
    reward_not_0_or_1: int = 0  # 0: a binary (pass / fail) reward
    t_first: float = math.inf
    t_last: float = -math.inf
    length_hist: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int64))
    stale_hist: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int64))

    def add(self, chunk: dict[str, np.ndarray], reward: np.ndarray, resp: np.ndarray) -> None:
        self.n += len(reward)
        self.tokens += int(resp.sum() + chunk["prompt_len"].astype(np.int64).sum())
        self.truncated += int(chunk["truncated"].sum())
        status = chunk["reward_status"]
        self.reward_errors += int(np.count_nonzero(status != REWARD_OK))
        self.reward_timeouts += int(np.count_nonzero(status == REWARD_TIMEOUT))
        self.reward_sum += reward.sum()
        self.reward_sq += (reward * reward).sum()
        self.reward_min, self.reward_max = min(self.reward_min, reward.min()), max(self.reward_max, reward.max())
        self.reward_not_0_or_1 += int(np.count_nonzero((reward != 0) & (reward != 1)))
        self.t_first, self.t_last = min(self.t_first, chunk["t_start"].min()), max(self.t_last, chunk["t_end"].max())
        self.length_hist = _bincount_into(self.length_hist, resp)
        self.stale_hist = _bincount_into(self.stale_hist, np.maximum(chunk["staleness"], 0))


def analyze_run(run_dir_or_log: str | Path, chunk_rows: int = CHUNK_ROWS) -> RunAnalysis:
    with TrajectoryReader(run_dir_or_log) as reader:
        meta = read_meta(reader)
        acc, totals, episodes = _StepAccumulator(), _Totals(), _StepAccumulator()
        names = list(meta.get("domains") or [])
        by_domain = [_StepAccumulator() for _ in names] if len(names) > 1 else []
        with _progress(reader.rows, f"reading {reader.path.name}") as bar:
            task = bar.add_task("rows", total=reader.rows)
            for chunk in reader.iter_chunks(chunk_rows, _COLUMNS):
                steps = chunk["step"].astype(np.int64)
                reward = chunk["reward"].astype(np.float64)
                resp = chunk["response_len"].astype(np.int64)
                acc.add(
                    steps,
                    reward=reward,
                    response_len=resp,
                    tokens=resp + chunk["prompt_len"],
                    staleness=chunk["staleness"],
                )
                totals.add(chunk, reward, resp)
                _add_episodes(episodes, steps, chunk)
                for k, domain_acc in enumerate(by_domain):
                    mine = chunk["domain"] == k
                    domain_acc.add(steps[mine], reward=reward[mine])
                bar.advance(task, len(steps))
        log_state = {
            "log": reader.status_line(),
            "closed_cleanly": reader.closed_cleanly,
            "uncommitted_rows_ignored": int(reader.cut_rows),
        }
        table = reader.metrics()
        evals = reader.eval_metrics()
    analysis = _assemble(meta, acc, totals, table, log_state, evals)
    # The log's allocation column, where a runtime wrote one, or the launches the run's manifest records
    # (submit, then each resume): a cancelled and resumed run has restarted once.
    run_dir = run_dir_of(run_dir_or_log)
    launched = launches(run_dir)
    if launched:
        analysis.summary["restarts"] = max(analysis.summary["restarts"], launched - 1)
    # algorithm.kl_coef 0: no reference model, and the logged KL is only estimator noise (None: no config here)
    analysis.summary["kl_coef"] = ((resolved_config(run_dir) or {}).get("algorithm") or {}).get("kl_coef")
    analysis.summary["episodes"] = _episode_series(episodes)
    analysis.summary["reward_models"] = reward_model_series(table)
    analysis.domains = _domain_series(names, by_domain, evals)
    analysis.summary["domains"] = {
        name: {
            key: [int(v) if key in ("step", "eval_step", "samples") else float(v) for v in values]
            for key, values in d.items()
        }
        for name, d in analysis.domains.items()
    }
    return analysis


RM_FIELDS = ("mean", "std", "parse_failures", "scored")


def reward_model_series(table: dict[str, np.ndarray]) -> dict[str, dict[str, list]]:
    """Per reward model (metrics rm/<name>/<field>): per step its mean and std raw score, the judge replies that did
    not parse and the samples it scored ({} for a run without rewards.models). A replayed step keeps its last row."""
    names = models_in_metrics(table)
    steps = table.get("step", np.zeros(0)).astype(np.int64)
    last = {int(s): i for i, s in enumerate(steps)}  # step -> its last row
    rows = np.array([last[s] for s in sorted(last)], np.int64)
    out = {}
    for name in names:
        cols = {f: table.get(metric_key(name, f)) for f in RM_FIELDS}
        mine = rows[~np.isnan(cols["scored"][rows])] if cols["scored"] is not None else rows
        series: dict[str, Any] = {"step": [int(s) for s in steps[mine]]}
        for f, col in cols.items():
            values = col[mine] if col is not None else np.full(len(mine), np.nan)
            series[f] = [int(v) for v in values] if f in ("parse_failures", "scored") else [float(v) for v in values]
        series["parse_failures_total"] = int(sum(series["parse_failures"]))
        out[name] = series
    return out


def _add_episodes(acc: _StepAccumulator, steps: np.ndarray, chunk: dict[str, np.ndarray]) -> None:
    """The multi-turn records of a chunk into the per-step episode accumulator (single-turn rows are skipped)."""
    mine = chunk["episode_status"] != SINGLE_TURN
    if mine.any():
        acc.add(
            steps[mine],
            success=chunk["success"][mine],
            turns=chunk["n_turns"][mine],
            format_errors=chunk["format_errors"][mine],
            env_errors=chunk["episode_status"][mine] > EPISODE_OK,
        )


def _episode_series(acc: _StepAccumulator) -> dict | None:
    """Per step of a multi-turn run (None for a single-turn one): the share of episodes solved, turns per
    episode, the share of turns whose reply the environment could not parse, episodes whose environment failed."""
    has = acc.count > 0
    if not has.any():
        return None
    count, sums = acc.count[has], {k: v[has] for k, v in acc.sums.items()}
    return {
        "step": [int(s) for s in np.flatnonzero(has)],
        "episodes": [int(c) for c in count],
        "success_rate": (sums["success"] / count).tolist(),
        "turns_per_episode": (sums["turns"] / count).tolist(),
        "format_error_rate": (sums["format_errors"] / np.maximum(sums["turns"], 1)).tolist(),
        "env_errors": [int(e) for e in sums["env_errors"]],
    }


def _domain_series(names: list[str], accs: list[_StepAccumulator], evals: dict) -> dict[str, dict[str, np.ndarray]]:
    """Per source of a mixed dataset: the steps it has samples in, its samples and mean reward there, and its
    held-out accuracy per eval where the eval has one ({} for a run of one source)."""
    out = {}
    for name, acc in zip(names, accs):
        has = acc.count > 0
        count = acc.count[has]
        series = {
            "step": np.flatnonzero(has).astype(np.float64),
            "samples": count,
            "reward": acc.sums["reward"][has] / count if "reward" in acc.sums else np.zeros(0),
        }
        accuracy = evals.get(f"accuracy/{name}")
        if accuracy is not None and not np.isnan(accuracy).all():
            ok = ~np.isnan(accuracy)
            series["eval_step"], series["accuracy"] = evals["step"][ok], accuracy[ok]
        out[name] = series
    return out


def _eval_lists(evals: dict[str, np.ndarray]) -> dict | None:
    """The eval table as JSON-able lists (one entry per eval; step as int), None when the run has no evals."""
    if not evals or not len(evals.get("step", ())):
        return None
    out = {name: [float(v) for v in values] for name, values in evals.items()}
    out["step"] = [int(v) for v in evals["step"]]
    return out


def eval_accuracy(evals: dict[str, np.ndarray]) -> dict | None:
    """first / last / best eval accuracy and the step of the best (the first eval reaching it)."""
    acc = evals.get("accuracy")
    if acc is None or np.isnan(acc).all():
        return None
    ok = ~np.isnan(acc)
    steps, values = evals["step"][ok], acc[ok]
    best = int(np.argmax(values))
    return {
        "first": float(values[0]),
        "last": float(values[-1]),
        "best": float(values[best]),
        "best_step": int(steps[best]),
        "first_step": int(steps[0]),
        "last_step": int(steps[-1]),
        "evals": int(len(values)),
    }


def _assemble(
    meta: dict,
    acc: _StepAccumulator,
    t: _Totals,
    table: dict[str, np.ndarray],
    log_state: dict,
    evals: dict[str, np.ndarray] | None = None,
) -> RunAnalysis:
    evals = evals or {}
    n = t.n
    has = acc.count > 0
    steps = np.flatnonzero(has)
    count = acc.count[has]
    per_step: dict[str, np.ndarray] = {"step": steps.astype(np.float64), "samples": count}
    for name in ("reward", "response_len", "tokens", "staleness"):
        means = acc.sums[name][has] / count if n else np.zeros(0)
        per_step[f"{name}_mean"] = means
        per_step[f"{name}_std"] = np.sqrt(np.maximum(acc.sums[name + "^2"][has] / count - means**2, 0)) if n else means
        per_step[f"{name}_min"] = acc.mins[name][has] if n else means
        per_step[f"{name}_max"] = acc.maxs[name][has] if n else means
    # Join the metrics table on step (a step the table lacks gets NaN).
    mstep = table.get("step", np.zeros(0)).astype(np.int64)
    where = {s: i for i, s in enumerate(mstep)}
    pick = np.array([where.get(int(s), -1) for s in steps], np.int64)
    for name in ("kl", "entropy", "clip_frac", "tokens_per_s", "time", "allocation", *TIME_PARTS):
        col = _metric(table, name)
        if col is not None and len(steps):
            per_step[name] = np.where(pick >= 0, col[np.maximum(pick, 0)], np.nan)

    wall = float(t.t_last - t.t_first) if n else 0.0
    if "time" in table and len(table["time"]) and n:
        wall = max(wall, float(np.nanmax(table["time"]) - t.t_first))
    mean = t.reward_sum / n if n else float("nan")
    slope = float(np.polyfit(steps, per_step["reward_mean"], 1)[0]) if len(steps) >= 2 else float("nan")
    allocation = _metric(table, "allocation")
    allocations = np.unique(allocation[~np.isnan(allocation)]) if allocation is not None else ()
    restarts = max(0, len(allocations) - 1)
    time_totals = {part: float(np.nansum(col)) for part in TIME_PARTS if (col := _metric(table, part)) is not None}
    max_new = meta.get("max_new_tokens")
    summary = {
        **log_state,
        "run_name": meta.get("run_name"),
        "steps": int(len(steps)),
        "last_step": int(steps[-1]) if len(steps) else None,
        "metric_rows": int(len(mstep)),
        "samples": int(n),
        "tokens": int(t.tokens),
        "wall_time_s": wall,
        "restarts": restarts,
        "reward": {
            "mean": mean,
            "std": math.sqrt(max(t.reward_sq / n - mean * mean, 0.0)) if n else float("nan"),
            "min": float(t.reward_min) if n else float("nan"),
            "max": float(t.reward_max) if n else float("nan"),
            "binary": bool(n) and not t.reward_not_0_or_1,  # every reward 0 or 1
            "first_step_mean": float(per_step["reward_mean"][0]) if n else float("nan"),
            "last_step_mean": float(per_step["reward_mean"][-1]) if n else float("nan"),
            "trend_per_step": slope,
        },
        "response_length": {
            "mean": float((np.arange(len(t.length_hist)) * t.length_hist).sum() / n) if n else float("nan"),
            "p50": _percentile_from_hist(t.length_hist, 0.5),
            "p90": _percentile_from_hist(t.length_hist, 0.9),
            "p99": _percentile_from_hist(t.length_hist, 0.99),
            "max": int(np.flatnonzero(t.length_hist)[-1]) if n else 0,
            "truncated_fraction": t.truncated / n if n else 0.0,
            "max_new_tokens": max_new,
        },
        "staleness": {
            "mean": float((np.arange(len(t.stale_hist)) * t.stale_hist).sum() / n) if n else float("nan"),
            "max": int(np.flatnonzero(t.stale_hist)[-1]) if n else 0,
            "histogram": {int(k): int(v) for k, v in enumerate(t.stale_hist) if v},
            "bound": meta.get("max_staleness"),
        },
        "kl": _stats(_rl_rows(table, _metric(table, "kl"))),
        "entropy": _stats(_rl_rows(table, _metric(table, "entropy"))),
        "clip_fraction": _stats(_rl_rows(table, _metric(table, "clip_frac"))),
        "sft": _sft_summary(table),
        "time_s": time_totals,
        "tokens_per_s": t.tokens / wall if wall > 0 else float("nan"),
        "tokens_per_s_reported": _stats(_metric(table, "tokens_per_s")),
        "reward_errors": int(t.reward_errors),
        "reward_timeouts": int(t.reward_timeouts),
        "eval": _eval_lists(evals),
        "eval_accuracy": eval_accuracy(evals),
    }
    warnings = _warnings(summary, per_step, meta)
    summary["warnings"] = warnings
    return RunAnalysis(summary, per_step, t.length_hist, t.stale_hist, warnings, evals)


def _warnings(summary: dict, per_step: dict, meta: dict) -> list[str]:
    out = []
    if not summary["closed_cleanly"]:
        out.append(f"log not closed: {summary['log']}")
    n_steps = summary["steps"]
    if n_steps >= 3:
        tail = max(3, n_steps // 10)
        stds = per_step["reward_std"][-tail:]
        if np.all(stds < 1e-9):
            value = per_step["reward_mean"][-1]
            out.append(
                f"reward collapsed: every sample of the last {tail} steps got the same reward ({value:g}); "
                "group-relative advantages are zero, so the policy gets no learning signal"
            )
    frac = summary["response_length"]["truncated_fraction"]
    # With max_new_tokens 1 (one-token answers, as in the quickstart) every response "hits" the limit by design.
    if frac > TRUNCATION_WARN and summary["response_length"]["max_new_tokens"] != 1:
        out.append(
            f"{frac:.0%} of responses hit max_new_tokens ({summary['response_length']['max_new_tokens']}); "
            "raise algorithm.max_new_tokens or add overlong shaping"
        )
    errors, timeouts = summary["reward_errors"], summary["reward_timeouts"]
    if errors:
        out.append(
            f"{errors} trajectories ({errors / max(summary['samples'], 1):.1%}) have a stand-in reward of 0: "
            f"the reward function raised for {errors - timeouts} and ran past task.reward_timeout for {timeouts}"
        )
    bound = summary["staleness"]["bound"]
    if bound is not None and summary["staleness"]["max"] > bound:
        over = sum(v for k, v in summary["staleness"]["histogram"].items() if k > bound)
        out.append(
            f"staleness above the bound: {over} trajectories lagged more than max_staleness={bound} "
            f"(max {summary['staleness']['max']})"
        )
    return out


def summarize(run_dir_or_log: str | Path, chunk_rows: int = CHUNK_ROWS) -> dict:
    """The JSON-able summary of a run (see analyze_run for the per-step series)."""
    return analyze_run(run_dir_or_log, chunk_rows).summary
