"""rollout-hpc cancel RUN_DIR: cancel every job of a run (and a local run still going)."""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

from rollout_hpc.commands import out
from rollout_hpc.errors import UserError
from rollout_hpc.launch import rundir
from rollout_hpc.launch.status import ENDED, job_states, local_state
from rollout_hpc.launch.submit import scancel


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    manifest = rundir.read_manifest(run_dir)
    job_ids = manifest.get("job_ids", [])
    if not job_ids and not manifest.get("local_runs"):
        raise UserError(f"run {run_dir} has no job to cancel (dry run, or never started)")
    live = []
    for job_id in job_ids:
        states = {c.state for c in job_states(job_id)}
        if states <= ENDED:
            out.print(f"job {job_id}: already ended ({', '.join(sorted(states))})")
        else:
            live.append(job_id)
            out.print(f"job {job_id}: cancelling (was {', '.join(sorted(states))})")
    if live:
        done = scancel(live)
        if done.returncode != 0:
            raise UserError(f"scancel {' '.join(live)} failed: {done.stderr.strip() or done.stdout.strip()}")
    for record in manifest.get("local_runs", []):
        if local_state(record) == "RUNNING":
            os.kill(record["pid"], signal.SIGTERM)  # mpirun ends its ranks
            out.print(f"local run: sent SIGTERM to mpirun (pid {record['pid']})")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "cancel",
        help="cancel every job of a run",
        description="scancel every Slurm job recorded in RUN_DIR/manifest.json (a --chain too), "
        "or stop a local run still going. The run directory stays; resume continues from its last checkpoint.",
        epilog="example:\n  rollout-hpc cancel runs/quickstart",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory made by `rollout-hpc submit`")
    p.set_defaults(func=run)
