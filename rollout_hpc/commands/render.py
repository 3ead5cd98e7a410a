"""rollout-hpc render CONFIG: print the job script `submit` would hand to sbatch."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rollout_hpc.commands import add_config_arguments, config_path, load
from rollout_hpc.launch.render import render_script


def run(args: argparse.Namespace) -> int:
    cfg = load(args)
    run_dir = Path(args.run_dir) if args.run_dir else cfg.run.resolved_dir()
    script = render_script(cfg, run_dir, str(config_path(args)))
    if args.output:
        Path(args.output).write_text(script)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(script)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "render",
        help="print the sbatch script for a config (nothing is created or submitted)",
        description="Render slurm/directives.j2 over slurm/rollout.sbatch with the config's values: the exact "
        "job script `rollout-hpc submit` would write to RUN_DIR/job.sbatch.",
        epilog="examples:\n  rollout-hpc render configs/hello.yaml\n"
        "  rollout-hpc render my.yaml --set slurm.partition=gpu -o job.sbatch && bash -n job.sbatch",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_arguments(p)
    p.add_argument("-o", "--output", metavar="FILE", help="write the script to FILE instead of stdout")
    p.add_argument("--run-dir", metavar="DIR", help="run directory to render for (default: run.dir or runs/<run.name>)")
    p.set_defaults(func=run)
