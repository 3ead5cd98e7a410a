"""rollout-hpc analyze | plot | samples | export | compare | report: look at a run from its trajectory log.

Every command takes RUN_DIR (or the path of a trajectories.h5), works on a log
that is still being written (SWMR) and on a killed job's log (it reads what was
committed and says what was cut).

The analysis modules are imported inside each command: they pull h5py, matplotlib and pyarrow, and cli.py
imports every command module at start (`rollout-hpc --help` must stay fast).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from collections.abc import Callable
from pathlib import Path

from rich.table import Table

from rollout_hpc.commands import err, out


def _summary_table(summaries: dict[str, dict]) -> Table:
    table = Table(show_header=len(summaries) > 1)
    table.add_column("")
    for name in summaries:
        table.add_column(name, justify="right")
    rows = [
        ("steps", lambda s: s["steps"] if not s.get("sft") else f"{s['steps']} RL + {s['sft']['steps']} SFT"),
        ("trajectories", lambda s: s["samples"]),
        ("tokens", lambda s: s["tokens"]),
        ("wall time", lambda s: f"{s['wall_time_s'] / 60:.1f} min"),
        ("restarts", lambda s: s["restarts"]),
        ("reward mean ± std", lambda s: f"{s['reward']['mean']:.4g} ± {s['reward']['std']:.3g}"),
        ("reward min / max", lambda s: f"{s['reward']['min']:.4g} / {s['reward']['max']:.4g}"),
        (
            "reward first → last step",
            lambda s: f"{s['reward']['first_step_mean']:.4g} → {s['reward']['last_step_mean']:.4g}",
        ),
        ("reward trend / step", lambda s: f"{s['reward']['trend_per_step']:+.3g}"),
        (
            "response length mean (p50/p90/max)",
            lambda s: "{:.1f} ({:.0f}/{:.0f}/{})".format(
                s["response_length"]["mean"],
                s["response_length"]["p50"],
                s["response_length"]["p90"],
                s["response_length"]["max"],
            ),
        ),
        ("hit max_new_tokens", lambda s: f"{s['response_length']['truncated_fraction']:.1%}"),
        ("KL first → last", lambda s: "no reference model" if s.get("kl_coef") == 0 else _first_last(s["kl"])),
        ("entropy first → last", lambda s: _first_last(s["entropy"])),
        ("clip fraction mean", lambda s: f"{s['clip_fraction']['mean']:.3g}" if s["clip_fraction"] else "n/a"),
        ("staleness mean / max", lambda s: f"{s['staleness']['mean']:.2f} / {s['staleness']['max']}"),
        (
            "time gen / train / sync / idle",
            lambda s: " / ".join(
                f"{s['time_s'][k]:.0f}s" if k in s["time_s"] else "-"
                for k in ("gen_time", "train_time", "sync_time", "idle_time")
            ),
        ),
        ("tokens / s (wall)", lambda s: f"{s['tokens_per_s']:.4g}"),
    ]
    listed = list(summaries.values())
    if any(s.get("sft") for s in listed):  # an SFT warm-up before RL
        rows.insert(
            1, ("SFT loss first → last", lambda s: f"{s['sft']['loss_first']:.4g} → {s['sft']['loss_last']:.4g}")
        )
    if any(s.get("reward_errors") for s in listed):  # stand-in 0 rewards: shown only when there are some
        rows.append(("reward errors (timeouts)", lambda s: f"{s['reward_errors']} ({s['reward_timeouts']})"))
    if any(s.get("eval") for s in listed):  # validation during training
        rows += [
            ("evals", lambda s: len(s["eval"]["step"]) if s.get("eval") else 0),
            ("eval accuracy first → last", lambda s: _first_last(s["eval_accuracy"])),
            (
                "eval best (step)",
                lambda s: (
                    f"{s['eval_accuracy']['best']:.4g} (step {s['eval_accuracy']['best_step']})"
                    if s["eval_accuracy"]
                    else "n/a"
                ),
            ),
            ("eval pass@k last", lambda s: _last(s["eval"], "pass_at_k")),
        ]
    for label, get in rows:
        cells = []
        for s in summaries.values():
            try:
                cells.append(str(get(s)))
            except (KeyError, TypeError, ValueError, ZeroDivisionError):
                cells.append("n/a")
        table.add_row(label, *cells)
    return table


def _config_table(configs: dict[str, dict | None]) -> Table | str:
    """The config keys whose values differ between the runs (RUN_DIR/config.resolved.yaml), one column per run."""
    from rollout_hpc.analysis.run_info import config_differences  # in here: the analysis package pulls h5py

    missing = [label for label, c in configs.items() if c is None]
    note = f" ({', '.join(missing)}: no config.resolved.yaml)" if missing else ""
    rows = config_differences(configs)
    if not rows:
        return f"configs: no differences{note}"
    table = Table(title=f"config differences{note}", title_justify="left")
    table.add_column("key")
    for label, c in configs.items():
        if c is not None:
            table.add_column(label)
    for key, values in rows:
        table.add_row(key, *values)
    return table


def _first_last(stats: dict | None) -> str:
    return f"{stats['first']:.4g} → {stats['last']:.4g}" if stats else "n/a"


def _last(columns: dict | None, name: str) -> str:
    """The last reported value of an eval column, with its k for pass_at_k."""
    columns = columns or {}
    values = [(i, v) for i, v in enumerate(columns.get(name) or []) if v is not None and not math.isnan(v)]
    if not values:
        return "n/a"
    i, value = values[-1]
    k = (columns.get("k") or [None] * (i + 1))[i]
    at = f" (k={k:.0f})" if name == "pass_at_k" and k is not None and not math.isnan(k) else ""
    return f"{value:.4g}{at}"


def _clean(value):
    """JSON without NaN (not valid JSON): NaN becomes null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def export_provenance(directory: Path) -> dict:
    """Where an exported model directory came from (its rollout_hpc_export.json), checked against the disk now:
    its files unchanged since the export, the run directory and the checkpoint still there, the run's config."""
    from rollout_hpc.models.export import ExportError, read_export_info  # in here: torch
    from rollout_hpc.store.checkpoint import check_compatible

    info = read_export_info(directory)
    run_dir = Path(info["run_dir"])
    try:
        read_export_info(directory, verify=True)
        files = f"all {len(info['files'])} files match their SHA-256 at export"
    except ExportError as exc:
        files = f"CHANGED: {exc}"
    resolved = run_dir / "config.resolved.yaml"
    # what the run's config says now against the one the exported checkpoint was trained under (resume --set)
    changed = check_compatible(info, resolved.read_text(), force=True) if resolved.is_file() else None
    return {
        **{k: v for k, v in info.items() if k != "config"},
        "checks": {
            "files": files,
            "run_dir_exists": run_dir.is_dir(),
            "checkpoint_exists": Path(info["checkpoint"]).exists(),
            "run_config_changed_since": changed,
        },
    }


def _print_provenance(directory: Path, p: dict) -> None:
    checks, model = p["checks"], p.get("model", {})
    gone = "" if checks["run_dir_exists"] else "  [red](no longer there)[/]"
    kept = "" if checks["checkpoint_exists"] else "  [yellow](since removed: checkpoint.keep_last)[/]"
    style = "red" if checks["files"].startswith("CHANGED") else "green"
    rows = [
        ("run", f"{p.get('run_name')}  {p['run_dir']}{gone}"),
        ("step / policy version", f"{p['step']} / {p.get('policy_version')}"),
        ("checkpoint", f"{p['checkpoint']}{kept}"),
        ("config digest", str(p.get("config_digest"))),
        ("weights sha256", f"{p.get('weights_sha256')}  (as `rollout-hpc ckpt RUN_DIR` prints it)"),
        ("model", f"{model.get('architecture')} from {model.get('base')}, {model.get('dtype')}"),
        ("exported", f"{p.get('exported')} by rollout-hpc {p.get('rollout_hpc')}"),
        ("files", f"[{style}]{checks['files']}[/]"),
    ]
    if checks["run_config_changed_since"]:
        rows.append(("run config since", "[yellow]" + "; ".join(checks["run_config_changed_since"]) + "[/]"))
    out.print(f"[bold]{directory}[/]: a model exported by `rollout-hpc export-model`")
    for label, value in rows:  # lines, not a table: digests and paths stay whole for copying
        out.print(f"  {label:<22} {value}")


def _salvaging(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Runs the command again, once, when reading found a damaged chunk in the log's data: the second run
    reads every step before the damage (store.trajlog.TrajectoryReader) and warns once."""

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        from rollout_hpc.store.trajlog import TrajectoryLogDamaged  # in here: h5py

        try:
            return command(args)
        except TrajectoryLogDamaged as exc:
            if not exc.found_while_reading:
                raise
            return command(args)

    return run


@_salvaging
def cmd_analyze(args: argparse.Namespace) -> int:
    from rollout_hpc.analysis.summary import summarize  # in here: h5py; the CLI imports every command at start

    # models.export.EXPORT_INFO, not imported for this test: it pulls torch
    if (Path(args.run_dir) / "rollout_hpc_export.json").is_file():  # an exported model: where it came from
        provenance = export_provenance(Path(args.run_dir))
        if args.json:
            print(json.dumps(provenance, indent=2))
        else:
            _print_provenance(Path(args.run_dir), provenance)
        return 1 if provenance["checks"]["files"].startswith("CHANGED") else 0
    summary = summarize(args.run_dir)
    if args.json:
        print(json.dumps(_clean(summary), indent=2))
        return 0
    out.print(f"[bold]{summary.get('run_name') or args.run_dir}[/]: {summary['log']}")
    out.print(_summary_table({"": summary}))
    for warning in summary["warnings"]:
        out.print(f"[yellow]warning:[/] {warning}")
    return 0


@_salvaging
def cmd_plot(args: argparse.Namespace) -> int:
    from rollout_hpc.analysis.figures import write_run_figures  # in here: matplotlib, h5py (slow to import)
    from rollout_hpc.analysis.summary import analyze_run
    from rollout_hpc.store.trajlog import log_path

    out_dir = Path(args.out) if args.out else log_path(args.run_dir).parent / "plots"
    for path in write_run_figures(analyze_run(args.run_dir), out_dir):
        out.print(str(path))
    return 0


@_salvaging
def cmd_samples(args: argparse.Namespace) -> int:
    from rollout_hpc.analysis import samples  # in here: h5py
    from rollout_hpc.store.trajlog import TrajectoryReader, log_path

    mode, k = next(((m, getattr(args, m)) for m in ("best", "worst", "random") if getattr(args, m)), ("best", 3))
    decode = samples.load_decoder(log_path(args.run_dir).parent)
    answer = samples.load_answers(log_path(args.run_dir).parent)
    with TrajectoryReader(args.run_dir) as reader:
        step = args.step if args.step is not None else (None if args.prompt is not None else samples.last_step(reader))
        rows = samples.select_rows(reader, step=step, prompt=args.prompt, mode=mode, k=k, seed=args.seed)
        if not len(rows):
            err.print(f"no trajectories match (step {step}, prompt {args.prompt}) in {reader.path}")
            return 1
        if decode is None:
            err.print("no tokenizer for this run (RUN_DIR/config.resolved.yaml): showing token ids")
        for sample in samples.load_samples(reader, rows):
            out.print(samples.render_sample(sample, decode, answer), markup=False, highlight=False)
            out.print()
    return 0


@_salvaging
def cmd_export(args: argparse.Namespace) -> int:
    from rollout_hpc.analysis.export import export_run  # in here: h5py, pyarrow (slow to import)
    from rollout_hpc.analysis.samples import load_decoder
    from rollout_hpc.store.trajlog import log_path

    columns = [c for part in args.columns for c in part.split(",") if c] if args.columns else None
    decode = None if args.no_text else load_decoder(log_path(args.run_dir).parent)
    if decode is None and not args.no_text:
        err.print("no tokenizer for this run (RUN_DIR/config.resolved.yaml): no prompt_text / response_text columns")
    for table, (path, rows) in export_run(args.run_dir, args.format, args.out, columns, decode=decode).items():
        out.print(f"{table}: {rows} rows -> {path}")
    return 0


@_salvaging
def cmd_compare(args: argparse.Namespace) -> int:
    from rollout_hpc.analysis.figures import compare_figure, save_figure  # in here: matplotlib, h5py (slow to import)
    from rollout_hpc.analysis.run_info import resolved_config, run_dir_of, run_labels
    from rollout_hpc.analysis.summary import analyze_run

    labels = run_labels(args.runs)
    runs = {label: analyze_run(run) for label, run in zip(labels, args.runs)}
    configs = {label: resolved_config(run_dir_of(run)) for label, run in zip(labels, args.runs)}
    for label, run in zip(labels, args.runs):
        out.print(f"[bold]{label}[/]: {run_dir_of(run)}")
    out.print(_summary_table({name: a.summary for name, a in runs.items()}))
    out.print(_config_table(configs))
    figure = Path(args.out)
    figure.parent.mkdir(parents=True, exist_ok=True)
    save_figure(compare_figure(runs), figure)
    out.print(f"curves: {figure}")
    return 0


@_salvaging
def cmd_report(args: argparse.Namespace) -> int:
    from rollout_hpc.analysis.report import write_report  # in here: matplotlib, h5py (slow to import)

    out.print(str(write_report(args.run_dir, args.out)))
    return 0


def register(subparsers) -> None:
    run_help = "run directory (or its trajectories.h5)"
    p = subparsers.add_parser(
        "analyze",
        help="summary of a run from its trajectory log",
        description="Steps, samples, tokens, reward trend, lengths, KL, entropy, staleness, "
        "time breakdown, reward errors, the eval curve (validation during training) and "
        "warnings, streamed from RUN_DIR/trajectories.h5. On a directory made by `rollout-hpc export-model`: "
        "the run, step and config digest it came from, and whether its files are unchanged.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help=run_help + ", or a model directory made by export-model")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_analyze)

    p = subparsers.add_parser(
        "plot", help="PNG figures of a run (reward, length, KL/entropy, throughput, staleness, time, eval)"
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help=run_help)
    p.add_argument("--out", metavar="DIR", help="where to write the PNGs (default RUN_DIR/plots)")
    p.set_defaults(func=cmd_plot)

    p = subparsers.add_parser("samples", help="show trajectories as text (best, worst or random; by step or prompt)")
    p.add_argument("run_dir", metavar="RUN_DIR", help=run_help)
    p.add_argument("--step", type=int, help="train step (default: the last one, unless --prompt is given)")
    p.add_argument("--prompt", type=int, metavar="ID", help="only trajectories of this prompt id")
    pick = p.add_mutually_exclusive_group()
    for mode in ("best", "worst", "random"):
        pick.add_argument(
            f"--{mode}", type=int, metavar="K", help=f"the K {mode} by reward" if mode != "random" else "K at random"
        )
    p.add_argument("--seed", type=int, default=0, help="seed of --random")
    p.set_defaults(func=cmd_samples)

    p = subparsers.add_parser("export", help="per-trajectory and per-step tables as Parquet or CSV")
    p.add_argument("run_dir", metavar="RUN_DIR", help=run_help)
    p.add_argument("--format", choices=("parquet", "csv"), default="parquet")
    p.add_argument(
        "--columns",
        nargs="+",
        metavar="COL",
        help="trajectory columns (default: all fixed ones; "
        "add response_ids, prompt_ids, logprobs, loss_mask or turn_starts for token lists, Parquet only)",
    )
    p.add_argument("--out", metavar="DIR", help="output directory (default RUN_DIR/export)")
    p.add_argument(
        "--no-text",
        action="store_true",
        help="leave out the prompt_text / response_text columns (decoded with the run's tokenizer; "
        "decoding every trajectory takes a while on a large log)",
    )
    p.set_defaults(func=cmd_export)

    p = subparsers.add_parser("compare", help="several runs side by side: table and overlaid curves")
    p.add_argument("runs", metavar="RUN_DIR", nargs="+", help="two or more run directories")
    p.add_argument("--out", default="compare.png", metavar="PNG", help="curves figure (default ./compare.png)")
    p.set_defaults(func=cmd_compare)

    p = subparsers.add_parser("report", help="one self-contained HTML report (summary, figures, samples)")
    p.add_argument("run_dir", metavar="RUN_DIR", help=run_help)
    p.add_argument("--out", metavar="HTML", help="report file (default RUN_DIR/report.html)")
    p.set_defaults(func=cmd_report)
