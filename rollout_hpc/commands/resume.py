"""rollout-hpc resume RUN_DIR: continue a run from its newest valid checkpoint (new Slurm job, or here)."""

from __future__ import annotations

import argparse
import os
import shlex

from rollout_hpc.commands import err, out
from rollout_hpc.launch import rundir
from rollout_hpc.launch.local import record_mpirun_command, require_mpirun, run_local
from rollout_hpc.launch.resume import FORCE_ENV, ResumePlan, apply_plan, plan_resume
from rollout_hpc.launch.submit import resolve_launcher, sbatch


def run(args: argparse.Namespace) -> int:
    plan = plan_resume(
        args.run_dir, args.overrides, force=args.force, dry_run=args.dry_run, from_scratch=args.from_scratch
    )
    launcher = resolve_launcher(plan.cfg, force_local=args.local)
    if launcher == "local":
        require_mpirun()
    for line in plan.damaged:
        err.print(line, markup=False, highlight=False)
    _describe(plan)
    if plan.finished:
        out.print(
            f"the run already did all {plan.cfg.algorithm.steps} steps (algorithm.steps); nothing to resume. "
            f"To train longer: rollout-hpc resume {plan.run_dir} --set algorithm.steps=N",
            markup=False,
        )
        return 0
    if args.dry_run:
        out.print(f"dry run: nothing launched ({launcher})")
        return 0
    apply_plan(plan, launcher)
    if args.force:
        os.environ[FORCE_ENV] = "1"  # the ranks' own check of the checkpoint's config (launch_env / sbatch export it)
    if launcher == "slurm":
        job_id = sbatch(plan.run_dir / rundir.JOB_SCRIPT, export=f"ALL,{FORCE_ENV}=1" if args.force else None)
        rundir.add_job_ids(plan.run_dir, [job_id])
        out.print(f"submitted job: {job_id}")
        out.print(f"follow it: rollout-hpc status {plan.run_dir}   logs: {plan.run_dir / rundir.LOGS}/", markup=False)
        return 0
    command = record_mpirun_command(plan.cfg, plan.run_dir)
    out.print(f"running here: {shlex.join(command)}", markup=False, highlight=False)
    return run_local(plan.cfg, plan.run_dir, out)


def _describe(plan: ResumePlan) -> None:
    steps = plan.cfg.algorithm.steps
    if plan.checkpoint is None:
        out.print(f"no checkpoint in {plan.run_dir} yet: starting from step 0 of {steps}", markup=False)
    else:
        out.print(
            f"resuming from {plan.checkpoint.name}: step {plan.step} of {steps}, policy version {plan.policy_version}",
            markup=False,
        )
    if plan.config_changes:
        label = "--force: loading it despite config changes" if plan.force else "config changes since the checkpoint"
        out.print(f"{label}: {'; '.join(plan.config_changes)}", markup=False, highlight=False)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "resume",
        help="continue a run from its newest valid checkpoint (new Slurm job, or --local here)",
        description="Continue the run in RUN_DIR from its newest checkpoint that verifies (a damaged newer one is "
        "reported and moved aside). Submits RUN_DIR/job.sbatch as a new Slurm job (recorded in manifest.json), or "
        "with --local runs the same rank layout here under mpirun, in the foreground. A checkpoint written under a "
        "different model or algorithm config is refused unless --force. Steps replayed after the checkpoint are "
        "dropped from trajectories.h5 first, so every sample is trained on and logged exactly once.",
        epilog="examples:\n  rollout-hpc resume runs/quickstart --local\n"
        "  rollout-hpc resume runs/my-run --set slurm.time=04:00:00        # a longer allocation this time\n"
        "  rollout-hpc resume runs/my-run --set algorithm.steps=2000       # train longer than planned\n"
        "  rollout-hpc resume runs/my-run --dry-run                        # which checkpoint, what changed",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory made by `rollout-hpc submit`")
    p.add_argument("--local", action="store_true", help="run here under mpirun instead of submitting to Slurm")
    p.add_argument(
        "--force",
        action="store_true",
        help="load the checkpoint even if the model or algorithm config changed (the changes are listed)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="change one config value for this and later allocations (repeatable; VALUE is YAML)",
    )
    p.add_argument(
        "--from-scratch",
        action="store_true",
        help="with no valid checkpoint left, start again at step 0 (the old trajectory log is kept aside)",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="say which checkpoint and config would be used; launch nothing"
    )
    p.set_defaults(func=run)
