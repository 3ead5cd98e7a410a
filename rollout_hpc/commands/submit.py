"""rollout-hpc submit CONFIG: create the run directory and start the run (Slurm or local mpirun)."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from rollout_hpc.commands import add_config_arguments, config_path, doctor, load, out
from rollout_hpc.errors import UserError
from rollout_hpc.launch import rundir
from rollout_hpc.launch.local import record_mpirun_command, require_mpirun, run_local
from rollout_hpc.launch.submit import resolve_launcher, submit_slurm


def run(args: argparse.Namespace) -> int:
    cfg = load(args)
    launcher = resolve_launcher(cfg, force_local=args.local)
    if args.chain < 0:
        raise UserError(f"--chain {args.chain}: give the number of extra dependent jobs, 0 or more")
    if launcher == "local" and args.chain:
        raise UserError("--chain queues dependent Slurm jobs; it has no meaning with the local launcher (--local)")
    run_dir = Path(args.run_dir) if args.run_dir else None
    if args.doctor and not doctor.passes(cfg, run_dir or cfg.run.resolved_dir()):
        raise UserError(
            "rollout-hpc doctor found a problem (the table above): fix it, then submit again; nothing was submitted"
        )
    if launcher == "slurm":
        sub = submit_slurm(
            cfg, config_path(args), args.overrides, dry_run=args.dry_run, chain=args.chain, run_dir=run_dir
        )
        out.print(f"run directory: {sub.run_dir}")
        if sub.dry_run:
            out.print(f"dry run: job script {sub.script} (not submitted; `sbatch {sub.script}` would submit it)")
        else:
            out.print(f"submitted job{'s' if len(sub.job_ids) > 1 else ''}: {' '.join(sub.job_ids)}")
            out.print(f"follow it: rollout-hpc status {sub.run_dir}   logs: {sub.run_dir / rundir.LOGS}/")
        return 0

    require_mpirun()  # before anything is created
    run_dir = rundir.create_run_dir(
        run_dir or cfg.run.resolved_dir(),
        cfg,
        config_path(args),
        launcher="local",
        script=None,
        overrides=args.overrides,
        dry_run=args.dry_run,
    )
    command = record_mpirun_command(cfg, run_dir)
    out.print(f"run directory: {run_dir}")
    if args.dry_run:
        out.print(f"dry run: would run {shlex.join(command)}")
        return 0
    return run_local(cfg, run_dir, out)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "submit",
        help="create a run directory and submit the run (Slurm), or run it here (mpirun)",
        description="Validate CONFIG, create its run directory (config snapshot, resolved config, job script, "
        "manifest) and submit a heterogeneous Slurm job: component 0 = generator nodes, component 1 = trainer "
        "nodes, one MPI world. With --local (or launcher: local, or no sbatch on PATH with launcher: auto) the "
        "same rank layout runs here under mpirun, in the foreground.",
        epilog="examples:\n  rollout-hpc submit configs/quickstart.yaml           # local mpirun (launcher: local)\n"
        "  rollout-hpc submit my.yaml --set run.name=try2        # Slurm, new run name\n"
        "  rollout-hpc submit my.yaml --dry-run                  # write the run directory, do not submit\n"
        "  rollout-hpc submit my.yaml --chain 3                  # plus 3 jobs that continue it (afterany)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_arguments(p)
    p.add_argument("--dry-run", action="store_true", help="create the run directory and job script, but submit nothing")
    p.add_argument("--local", action="store_true", help="run here under mpirun instead of Slurm")
    p.add_argument(
        "--chain",
        type=int,
        default=0,
        metavar="K",
        help="also queue K jobs, each starting after the previous ends (--dependency=afterany), "
        "to continue a run longer than one allocation",
    )
    p.add_argument("--run-dir", metavar="DIR", help="run directory (default: run.dir or runs/<run.name>)")
    p.add_argument(
        "--doctor", action="store_true", help="run `rollout-hpc doctor` first; submit nothing if a check fails"
    )
    p.set_defaults(func=run)
