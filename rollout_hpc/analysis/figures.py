"""Figures of a run (and of several runs side by side), drawn with matplotlib's Agg backend into PNGs."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Callable

import matplotlib

matplotlib.use("Agg")  # no display on cluster login nodes
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from rollout_hpc.analysis.summary import TIME_PARTS, RunAnalysis  # noqa: E402

FIGSIZE = (8.0, 4.5)  # inches; at DPI this is 800 x 450 pixels
DPI = 100


def _new(title: str, xlabel: str = "train step", ylabel: str = ""):
    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _has(per_step: dict, key: str) -> bool:
    """The metric was logged and at least one step has a value."""
    return key in per_step and not np.isnan(per_step[key]).all()


def _no_data(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in this log", ha="center", va="center", transform=ax.transAxes, color="gray")


def reward_figure(a: RunAnalysis):
    fig, ax = _new("Reward per step", ylabel="reward")
    s = a.per_step
    if len(s["step"]):
        ax.fill_between(s["step"], s["reward_min"], s["reward_max"], alpha=0.12, color="C0", label="min - max")
        ax.fill_between(s["step"], s["reward_mean"] - s["reward_std"], s["reward_mean"] + s["reward_std"],
                        alpha=0.3, color="C0", label="mean ± std")
        ax.plot(s["step"], s["reward_mean"], color="C0", label="mean")
        ax.legend(loc="best")
    else:
        _no_data(ax, "trajectories")
    return fig


def length_figure(a: RunAnalysis):
    fig, ax = _new("Response length per step", ylabel="tokens")
    s = a.per_step
    if len(s["step"]):
        ax.plot(s["step"], s["response_len_mean"], label="mean")
        ax.plot(s["step"], s["response_len_max"], label="max", alpha=0.7)
        limit = a.summary["response_length"]["max_new_tokens"]
        if limit:
            ax.axhline(limit, color="red", linestyle="--", linewidth=1, label=f"max_new_tokens = {limit}")
        ax.legend(loc="best")
    else:
        _no_data(ax, "trajectories")
    return fig


def kl_entropy_figure(a: RunAnalysis):
    fig, ax = _new("KL divergence and entropy", ylabel="KL to reference")
    s = a.per_step
    drawn = False
    if _has(s, "kl"):
        ax.plot(s["step"], s["kl"], color="C1", label="KL")
        drawn = True
    if _has(s, "entropy"):
        right = ax.twinx()
        right.plot(s["step"], s["entropy"], color="C2", label="entropy")
        right.set_ylabel("entropy (nats / token)")
        fig.legend(loc="upper right", bbox_to_anchor=(0.88, 0.88))
        drawn = True
    if not drawn:
        _no_data(ax, "KL or entropy metrics")
    return fig


def throughput_figure(a: RunAnalysis):
    fig, ax = _new("Throughput", ylabel="tokens / s")
    s = a.per_step
    if _has(s, "tokens_per_s"):
        ax.plot(s["step"], s["tokens_per_s"], label="reported by the trainer")
    if "time" in s and len(s["step"]) > 1:
        dt = np.diff(s["time"])
        with np.errstate(divide="ignore", invalid="ignore"):
            rate = np.where(dt > 0, s["tokens_mean"][1:] * s["samples"][1:] / dt, np.nan)
        ax.plot(s["step"][1:], rate, alpha=0.6, label="logged tokens / step interval")
    if ax.lines:
        ax.legend(loc="best")
    else:
        _no_data(ax, "throughput metrics")
    return fig


def staleness_figure(a: RunAnalysis):
    fig, ax = _new("Staleness of trained trajectories", xlabel="policy versions behind the trainer", ylabel="trajectories")
    hist = a.staleness_hist
    if hist.sum():
        ax.bar(np.arange(len(hist)), hist, width=0.8)
        bound = a.summary["staleness"]["bound"]
        if bound is not None:
            ax.axvline(bound + 0.5, color="red", linestyle="--", linewidth=1, label=f"max_staleness = {bound}")
            ax.legend(loc="best")
        ax.set_xticks(np.arange(len(hist)))
    else:
        _no_data(ax, "trajectories")
    return fig


def time_figure(a: RunAnalysis):
    fig, ax = _new("Where the time went, per step", ylabel="seconds")
    s = a.per_step
    parts = [p for p in TIME_PARTS if _has(s, p)]
    if parts:
        totals = a.summary["time_s"]
        ax.stackplot(s["step"], *[np.nan_to_num(s[p]) for p in parts],
                     labels=[f"{p.removesuffix('_time')} ({totals.get(p, 0):.0f} s total)" for p in parts], alpha=0.8)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    else:
        _no_data(ax, "timing metrics")
    return fig


FIGURES: dict[str, Callable[[RunAnalysis], plt.Figure]] = {
    "reward": reward_figure,
    "response_length": length_figure,
    "kl_entropy": kl_entropy_figure,
    "throughput": throughput_figure,
    "staleness": staleness_figure,
    "time_breakdown": time_figure,
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
    """Reward, response length, KL and throughput of several runs, overlaid (2 x 2 panels)."""
    fig, axes = plt.subplots(2, 2, figsize=(FIGSIZE[0] * 1.5, FIGSIZE[1] * 1.6), dpi=DPI, sharex=True)
    panels = [("reward_mean", "mean reward"), ("response_len_mean", "mean response length (tokens)"),
              ("kl", "KL to reference"), ("tokens_per_s", "tokens / s")]
    for ax, (key, label) in zip(axes.flat, panels):
        for name, a in runs.items():
            if _has(a.per_step, key):
                ax.plot(a.per_step["step"], a.per_step[key], label=name)
        ax.set_title(label)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("train step")
    axes[0][0].legend(loc="best")
    fig.suptitle("Runs compared")
    fig.tight_layout()
    return fig
