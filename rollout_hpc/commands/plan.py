"""rollout-hpc plan CONFIG --nodes N [--profile PROFILE.json]: which layout to run on N nodes, and what it will do.

Every candidate layout (generator/trainer node split, colocated or disaggregated, max_staleness 0..K) is simulated
from the profile (rollout_hpc.scale); the table is sorted by predicted samples/s, with the throughput once
allocation ends and node failures are counted beside it. Without --profile the costs come from the roofline model (model size and hardware figures).
`plan --check RUN_DIR --profile P` predicts a finished run's own layout from the profile alone and compares it
with the run's measured mean step time.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from rollout_hpc.commands import add_config_arguments, err, out
from rollout_hpc.config import load_config
from rollout_hpc.errors import UserError
from rollout_hpc.launch import rundir
from rollout_hpc.scale.profile import Profile
from rollout_hpc.scale.roofline import Hardware, roofline_profile


def run(args: argparse.Namespace) -> int:
    if args.check:
        return _check(args)
    if args.config is None or args.nodes is None:
        raise UserError("plan needs CONFIG and --nodes N (or --check RUN_DIR --profile PROFILE.json)")
    if args.nodes < 1:
        raise UserError(f"--nodes {args.nodes}: give the number of nodes of the allocation, 1 or more")
    from rollout_hpc.scale.plan import plan, recommended  # numpy and simpy: not at `rollout-hpc --help`

    cfg = load_config(args.config, args.overrides)
    profile = _profile(args, cfg)
    assumptions = {"requeue_wait_s": args.requeue_wait, "node_mtbf_h": args.node_mtbf}
    predictions = plan(profile, cfg, args.nodes, args.max_staleness, steps=args.steps, **assumptions)
    if not predictions:
        raise UserError(
            f"no layout fits {args.nodes} node(s): a disaggregated run needs 2 or more nodes, and colocated needs "
            "the generator and trainer ranks of a node to fit its GPUs (slurm.gpus_per_node)"
        )
    best = recommended(predictions)
    if args.json:
        print(
            json.dumps(
                {
                    "nodes": args.nodes,
                    "profile": profile.source,
                    "layouts": [p.row() for p in predictions],
                    "recommended": best,
                }
            )
        )
        return 0
    _table(predictions[: args.top], args.nodes, profile)
    sets = " ".join(f"--set {o}" for o in best["overrides"])
    out.print(
        f"recommended: {best['placement']}, {best['generator_nodes']} generator + {best['trainer_nodes']} "
        f"trainer nodes, max_staleness {best['max_staleness']}: {best['samples_per_s']:.1f} samples/s, "
        f"{best['step_s']:.3g} s a step"
    )
    out.print(f"apply it: rollout-hpc submit {args.config} {sets}")
    return 0


def _profile(args, cfg) -> Profile:
    if args.profile:
        return Profile.load(args.profile)
    if cfg.generator.gpus_per_task == 0 and cfg.trainer.gpus_per_task == 0 and not args.json:
        err.print(
            "plan: no --profile, so the costs are the roofline model's GPU figures (docs/scale.md), but this config "
            "runs on CPUs; measure it instead: rollout-hpc profile CONFIG --out P.json, then plan --profile P.json"
        )
    hw = Hardware(gpus_per_node=cfg.slurm.gpus_per_node)
    return roofline_profile(cfg, hw, params=args.params)


def _table(predictions, nodes: int, profile: Profile) -> None:
    t = Table(title=f"layouts on {nodes} nodes ({profile.source} profile), best first")
    for col in (
        "placement",
        "gen nodes",
        "train nodes",
        "staleness",
        "step s",
        "samples/s",
        "tokens/s",
        "with interruptions",
        "gen idle",
        "train idle",
        "ckpt s",
        "ring MiB/node",
    ):
        t.add_column(col, justify="right")
    for p in predictions:
        lay = p.layout
        t.add_row(
            lay.placement,
            str(lay.generator_nodes),
            str(lay.trainer_nodes),
            str(lay.max_staleness),
            f"{p.step_s:.3g}",
            f"{p.samples_per_s:.1f}",
            f"{p.tokens_per_s:.0f}",
            f"{p.effective_samples_per_s:.1f}",
            f"{p.gen_idle:.0%}",
            f"{p.train_idle:.0%}",
            f"{p.checkpoint_s:.3g}",
            f"{p.ring_bytes_needed / 2**20:.1f}",
        )
    # Piped or captured (width 80 by default), the 12 columns would be cut to a few letters each.
    Console(soft_wrap=True, width=None if out.is_terminal else 160).print(t)


def _check(args) -> int:
    run_dir = Path(args.check)
    if not args.profile:
        raise UserError("--check RUN_DIR needs --profile PROFILE.json (the prediction comes from the profile alone)")
    resolved = run_dir / rundir.RESOLVED_CONFIG
    if not resolved.is_file():
        raise UserError(f"{run_dir} is not a run directory (no {rundir.RESOLVED_CONFIG})")
    from rollout_hpc.analysis.step_times import mean_step_time  # h5py: not at `rollout-hpc --help`
    from rollout_hpc.scale.plan import predict_run  # numpy and simpy: not at `rollout-hpc --help`

    cfg = load_config(resolved)
    profile = Profile.load(args.profile)
    measured, n = mean_step_time(run_dir, cfg.warmup.sft_steps)
    predicted = predict_run(profile, cfg, steps=max(n, 50)).step_s
    result = {
        "run_dir": str(run_dir),
        "layout": predict_run(profile, cfg, steps=1).layout.overrides(),
        "predicted_step_s": predicted,
        "measured_step_s": measured,
        "relative_error": (predicted - measured) / measured,
        "steps_measured": n,
    }
    if args.json:
        print(json.dumps(result))
    else:
        out.print(
            f"{run_dir}: predicted {predicted:.4g} s a step, measured {measured:.4g} s (mean of {n} RL steps): "
            f"error {result['relative_error']:+.0%}"
        )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="predict step time and throughput of every node split on N nodes, and recommend one",
        description="Simulate CONFIG on N nodes for every candidate layout (generator/trainer split, colocated or "
        "disaggregated, max_staleness 0..K) from a profile of measured costs (`rollout-hpc profile`), or without "
        "one from the roofline model (model size, GPU and network figures: docs/scale.md), and print them sorted "
        "by predicted samples/s (and with expected allocation ends and node failures beside it), with the --set overrides "
        "of the best one. --check RUN_DIR compares a finished run with its prediction.",
        epilog="examples:\n  rollout-hpc profile my.yaml --out my.profile.json\n"
        "  rollout-hpc plan my.yaml --nodes 64 --profile my.profile.json\n"
        "  rollout-hpc plan configs/examples/grpo-7b-vllm-deepspeed.yaml --nodes 1000 --params 7.6e9 --json\n"
        "  rollout-hpc plan --check runs/my-run --profile my.profile.json --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_arguments(p, required=False)
    p.add_argument("--nodes", type=int, metavar="N", help="nodes of the allocation")
    p.add_argument("--profile", metavar="PROFILE.json", help="measured costs (default: the roofline model)")
    p.add_argument("--max-staleness", type=int, default=2, metavar="K", help="try exchange.max_staleness 0..K")
    p.add_argument("--steps", type=int, metavar="S", help="RL steps to simulate (default: algorithm.steps)")
    p.add_argument(
        "--params",
        type=float,
        metavar="P",
        help="model parameters for the roofline model when model.path has no config.json to count them",
    )
    p.add_argument(
        "--requeue-wait",
        type=float,
        default=300.0,
        metavar="S",
        help="queue wait of a requeued job, in seconds (default 300)",
    )
    p.add_argument(
        "--node-mtbf",
        type=float,
        default=50_000.0,
        metavar="H",
        help="mean time between failures of one node, in hours (default 50000)",
    )
    p.add_argument("--top", type=int, default=12, metavar="K", help="rows of the table (default 12)")
    p.add_argument("--json", action="store_true", help="print one JSON object: layouts, recommended")
    p.add_argument("--check", metavar="RUN_DIR", help="compare a finished run's mean step time with the prediction")
    p.set_defaults(func=run)
