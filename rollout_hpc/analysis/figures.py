"""Figures of a run (and of several runs side by side), drawn with matplotlib's Agg backend into PNGs."""

from __future__ import annotations

import functools
import io
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on cluster login nodes
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from rollout_hpc.analysis.summary import TIME_PARTS, RunAnalysis  # noqa: E402

FIGSIZE = (8.0, 4.5)  # inches; at DPI this is 800 x 450 pixels
DPI = 100


def _new(title: str, xlabel: str = "train step", ylabel: str = ""):
    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if xlabel == "train step":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no step 0.5
    return fig, ax


def _legend(ax, handles=None, labels=None) -> None:
    """A legend outside the plot, so that it never covers data (bands fill most of the axes, where
    matplotlib's "best" corner still lands on them): at the right, or below with handles from a twin axis
    (whose label takes the right)."""
    if handles is None:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", framealpha=0.85)
    else:
        ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=len(handles), frameon=False)


def has_reference(a: RunAnalysis) -> bool:
    """The run trained against a reference model (algorithm.kl_coef > 0; unknown without a config: assumed)."""
    return a.summary.get("kl_coef") != 0


def _has(per_step: dict, key: str) -> bool:
    """The metric was logged and at least one step has a value."""
    return key in per_step and not np.isnan(per_step[key]).all()


def _has_steps(a: RunAnalysis) -> bool:
    return len(a.per_step["step"]) > 0


def _has_rate_intervals(per_step: dict) -> bool:
    """Step times were logged for at least two steps: tokens / interval can be drawn."""
    return "time" in per_step and len(per_step["step"]) > 1


def _figure(
    title: str, *, shows: Callable[[RunAnalysis], bool], missing: str, xlabel: str = "train step", ylabel: str = ""
):
    """Turns `draw(a, fig, ax)` into `figure(a) -> Figure`: one titled axis, drawn on where `shows(a)`,
    else a "no <missing> in this log" note."""

    def decorate(draw: Callable[[RunAnalysis, plt.Figure, plt.Axes], None]) -> Callable[[RunAnalysis], plt.Figure]:
        @functools.wraps(draw)
        def figure(a: RunAnalysis) -> plt.Figure:
            fig, ax = _new(title, xlabel, ylabel)
            if shows(a):
                draw(a, fig, ax)
            else:
                ax.text(
                    0.5,
                    0.5,
                    f"no {missing} in this log",
                    ha="center",
                    va="center",
                    transform=ax.transAxes,
                    color="gray",
                )
            return fig

        return figure

    return decorate


@_figure("Reward per step", shows=_has_steps, missing="trajectories", ylabel="reward")
def reward_figure(a: RunAnalysis, fig, ax) -> None:
    s = a.per_step
    # A 0/1 reward's min and max are 0 and 1 at almost every step: that band says nothing, so it is left out.
    if not a.summary["reward"].get("binary"):
        ax.fill_between(s["step"], s["reward_min"], s["reward_max"], alpha=0.12, color="C0", label="min - max")
    # mean ± std, kept inside the values seen (a reward never below its minimum: no band under 0 for 0/1 rewards)
    low = np.clip(s["reward_mean"] - s["reward_std"], s["reward_min"], s["reward_max"])
    high = np.clip(s["reward_mean"] + s["reward_std"], s["reward_min"], s["reward_max"])
    ax.fill_between(s["step"], low, high, alpha=0.3, color="C0", label="mean ± std (within min - max)")
    ax.plot(s["step"], s["reward_mean"], color="C0", label="mean")
    _legend(ax)


@_figure("Response length per step", shows=_has_steps, missing="trajectories", ylabel="tokens")
def length_figure(a: RunAnalysis, fig, ax) -> None:
    ax.plot(a.per_step["step"], a.per_step["response_len_mean"], label="mean")
    ax.plot(a.per_step["step"], a.per_step["response_len_max"], label="max", alpha=0.7)
    limit = a.summary["response_length"]["max_new_tokens"]
    if limit:
        ax.axhline(limit, color="red", linestyle="--", linewidth=1, label=f"max_new_tokens = {limit}")
    _legend(ax)


def _kl_shown(a: RunAnalysis) -> bool:
    return _has(a.per_step, "kl") and has_reference(a)


@_figure(
    "KL divergence and entropy",
    shows=lambda a: _kl_shown(a) or _has(a.per_step, "entropy"),
    missing="KL or entropy metrics",
    ylabel="KL to reference",
)
def kl_entropy_figure(a: RunAnalysis, fig, ax) -> None:
    s = a.per_step
    if not _kl_shown(a):  # entropy alone, on the left axis
        ax.set_title("Entropy (no reference model: algorithm.kl_coef 0, so no KL)")
        ax.set_ylabel("entropy (nats / token)")
        ax.plot(s["step"], s["entropy"], color="C2", label="entropy")
        return
    ax.plot(s["step"], s["kl"], color="C1", label="KL")
    if _has(s, "entropy"):
        right = ax.twinx()
        right.plot(s["step"], s["entropy"], color="C2", label="entropy")
        right.set_ylabel("entropy (nats / token)")
        (kl_handles, kl_labels), (ent_handles, ent_labels) = (
            ax.get_legend_handles_labels(),
            right.get_legend_handles_labels(),
        )
        _legend(ax, kl_handles + ent_handles, kl_labels + ent_labels)


@_figure(
    "Throughput",
    shows=lambda a: _has(a.per_step, "tokens_per_s") or _has_rate_intervals(a.per_step),
    missing="throughput metrics",
    ylabel="tokens / s",
)
def throughput_figure(a: RunAnalysis, fig, ax) -> None:
    s = a.per_step
    if _has(s, "tokens_per_s"):
        ax.plot(s["step"], s["tokens_per_s"], label="reported by the trainer")
    if _has_rate_intervals(s):
        dt = np.diff(s["time"])
        with np.errstate(divide="ignore", invalid="ignore"):
            rate = np.where(dt > 0, s["tokens_mean"][1:] * s["samples"][1:] / dt, np.nan)
        ax.plot(s["step"][1:], rate, alpha=0.6, label="logged tokens / step interval")
    _legend(ax)


@_figure(
    "Staleness of trained trajectories",
    shows=lambda a: a.staleness_hist.sum() > 0,
    missing="trajectories",
    xlabel="policy versions behind the trainer",
    ylabel="trajectories",
)
def staleness_figure(a: RunAnalysis, fig, ax) -> None:
    hist = a.staleness_hist
    ax.bar(np.arange(len(hist)), hist, width=0.8)
    bound = a.summary["staleness"]["bound"]
    if bound is not None:
        ax.axvline(bound + 0.5, color="red", linestyle="--", linewidth=1, label=f"max_staleness = {bound}")
        _legend(ax)
    ax.set_xticks(np.arange(len(hist)))


def _time_parts(a: RunAnalysis) -> list[str]:
    """The timing metrics this log has values for."""
    return [p for p in TIME_PARTS if _has(a.per_step, p)]


@_figure(
    "Where the time went, per step", shows=lambda a: bool(_time_parts(a)), missing="timing metrics", ylabel="seconds"
)
def time_figure(a: RunAnalysis, fig, ax) -> None:
    parts, totals = _time_parts(a), a.summary["time_s"]
    ax.stackplot(
        a.per_step["step"],
        *[np.nan_to_num(a.per_step[p]) for p in parts],
        labels=[f"{p.removesuffix('_time')} ({totals.get(p, 0):.0f} s total)" for p in parts],
        alpha=0.8,
    )
    _legend(ax)


def _has_eval(a: RunAnalysis) -> bool:
    return bool(a.eval) and len(a.eval.get("step", ())) > 0


def _k_label(evals: dict) -> str:
    """pass@k with k filled in when the evals agree on it."""
    k = evals.get("k")
    if k is not None and len(k) and not np.isnan(k).any() and np.all(k == k[0]):
        return f"@{int(k[0])}"
    return "@k"


def _plot_eval(ax, evals: dict, label_prefix: str = "", color=None) -> None:
    """Accuracy (solid) and pass@k (dashed) against the policy version evaluated."""
    step = evals["step"]
    if _has(evals, "accuracy"):
        ax.plot(step, evals["accuracy"], marker="o", markersize=3, color=color, label=f"{label_prefix}accuracy")
    if _has(evals, "pass_at_k"):
        ax.plot(
            step,
            evals["pass_at_k"],
            marker="s",
            markersize=3,
            linestyle="--",
            color=color,
            label=f"{label_prefix}pass{_k_label(evals)}",
        )


@_figure("Validation during training (held-out split)", shows=_has_eval, missing="eval", ylabel="accuracy / pass@k")
def eval_figure(a: RunAnalysis, fig, ax) -> None:
    e = a.eval
    _plot_eval(ax, e)
    if not _has(e, "accuracy") and not _has(e, "pass_at_k"):  # an eval that reports neither: its rewards
        for key, label in (("mean_at_k", f"mean{_k_label(e)}"), ("mean_reward", "mean reward")):
            if _has(e, key):
                ax.plot(e["step"], e[key], marker="^", markersize=3, label=label)
    best = a.summary.get("eval_accuracy")
    if best:
        ax.scatter(
            [best["best_step"]],
            [best["best"]],
            s=60,
            facecolors="none",
            edgecolors="red",
            zorder=3,
            label=f"best {best['best']:.3g} (step {best['best_step']})",
        )
    if ax.get_legend_handles_labels()[0]:
        _legend(ax)


@_figure(
    "Reward per source (mixed dataset)",
    shows=lambda a: bool(a.domains),
    missing="mixture of sources",
    ylabel="mean reward / held-out accuracy",
)
def domains_figure(a: RunAnalysis, fig, ax) -> None:
    """Each source's mean reward per step (solid) and its held-out accuracy per eval (dashed, where there is one)."""
    for i, (name, d) in enumerate(a.domains.items()):
        ax.plot(d["step"], d["reward"], color=f"C{i}", label=f"{name} reward")
        if "accuracy" in d:
            ax.plot(
                d["eval_step"],
                d["accuracy"],
                color=f"C{i}",
                linestyle="--",
                marker="o",
                markersize=3,
                label=f"{name} eval accuracy",
            )
    _legend(ax)


@_figure(
    "Reward models (raw scores)",
    shows=lambda a: bool(a.summary.get("reward_models")),
    missing="rewards.models",
    ylabel="mean score ± std",
)
def reward_models_figure(a: RunAnalysis, fig, ax) -> None:
    """Each reward model's mean raw score per step with a ±std band; judge replies that did not parse on a second
    axis (where there are any)."""
    models = a.summary["reward_models"]
    failures = None
    for i, (name, d) in enumerate(models.items()):
        step, mean, std = (np.asarray(d[k], np.float64) for k in ("step", "mean", "std"))
        ax.plot(step, mean, color=f"C{i}", label=name)
        ax.fill_between(step, mean - std, mean + std, color=f"C{i}", alpha=0.15)
        if d["parse_failures_total"]:
            failures = failures or ax.twinx()
            failures.plot(step, d["parse_failures"], color=f"C{i}", linestyle=":", label=f"{name} unparsed replies")
            failures.set_ylabel("unparsed judge replies")
    _legend(ax)
    if failures is not None:
        _legend(failures)


FIGURES: dict[str, Callable[[RunAnalysis], plt.Figure]] = {
    "reward": reward_figure,
    "response_length": length_figure,
    "kl_entropy": kl_entropy_figure,
    "throughput": throughput_figure,
    "staleness": staleness_figure,
    "time_breakdown": time_figure,
    "eval": eval_figure,
    "domains": domains_figure,
    "reward_models": reward_models_figure,
}


def _write_and_close(fig, target, **savefig_args) -> None:
    fig.tight_layout()
    fig.savefig(target, dpi=DPI, **savefig_args)
    plt.close(fig)


def save_figure(fig, path: Path) -> Path:
    _write_and_close(fig, path)
    return path


def png_bytes(fig) -> bytes:
    buf = io.BytesIO()
    _write_and_close(fig, buf, format="png")
    return buf.getvalue()


def write_run_figures(a: RunAnalysis, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    return [save_figure(draw(a), out_dir / f"{name}.png") for name, draw in FIGURES.items()]


def compare_figure(runs: dict[str, RunAnalysis]):
    """Reward, response length, KL and throughput of several runs, overlaid (2 x 2 panels), plus a row with
    eval accuracy and pass@k when any of the runs evaluated during training."""
    evals = any(_has_eval(a) for a in runs.values())
    n_rows = 3 if evals else 2
    fig, axes = plt.subplots(n_rows, 2, figsize=(FIGSIZE[0] * 1.5, FIGSIZE[1] * 0.8 * n_rows), dpi=DPI, sharex=True)
    panels = [
        ("reward_mean", "mean reward"),
        ("response_len_mean", "mean response length (tokens)"),
        ("kl", "KL to reference"),
        ("tokens_per_s", "tokens / s"),
    ]
    for ax, (key, label) in zip(axes.flat, panels):
        for name, a in runs.items():
            if _has(a.per_step, key) and (key != "kl" or has_reference(a)):
                ax.plot(a.per_step["step"], a.per_step[key], label=name)
        if key == "kl" and not any(has_reference(a) for a in runs.values()):
            label += ": no reference model (algorithm.kl_coef 0)"
        ax.set_title(label)
        ax.grid(alpha=0.3)
    if evals:
        for ax, (key, label) in zip(axes[2], (("accuracy", "eval accuracy"), ("pass_at_k", "eval pass@k"))):
            for i, (name, a) in enumerate(runs.items()):
                if _has_eval(a) and _has(a.eval, key):
                    ax.plot(a.eval["step"], a.eval[key], marker="o", markersize=3, color=f"C{i}", label=name)
            ax.set_title(label)
            ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("train step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0][0].legend(loc="best", framealpha=0.85)  # lines only (no bands): the emptiest corner is free
    fig.suptitle("Runs compared")
    fig.tight_layout()
    return fig
