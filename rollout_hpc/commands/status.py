"""rollout-hpc status RUN_DIR: the state of a run's jobs, per het component."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.table import Table

from rollout_hpc.commands import out
from rollout_hpc.launch import rundir
from rollout_hpc.launch.status import TrainingProgress, job_states, local_state, run_roles, training_progress


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    manifest = rundir.read_manifest(run_dir)
    roles = run_roles(run_dir)
    jobs = [
        {"job_id": j, "components": [c.to_dict() for c in job_states(j, roles)]} for j in manifest.get("job_ids", [])
    ]
    local = [dict(r, state=local_state(r)) for r in manifest.get("local_runs", [])]
    progress = training_progress(run_dir)
    if args.json:
        print(
            json.dumps(
                {
                    "run_dir": str(run_dir.resolve()),
                    "name": manifest.get("name"),
                    "launcher": manifest.get("launcher"),
                    "dry_run": manifest.get("dry_run"),
                    "jobs": jobs,
                    "local_runs": local,
                    "progress": progress.to_dict(),
                },
                indent=2,
            )
        )
        return 0
    out.print(
        f"run [bold]{manifest.get('name')}[/] in {run_dir.resolve()}  (launcher {manifest.get('launcher')}, "
        f"created {manifest.get('created')})"
    )
    if manifest.get("dry_run"):
        out.print(f"dry run: nothing submitted; the job script is {run_dir / rundir.JOB_SCRIPT}")
    if jobs:
        table = Table()
        for column in ("job", "group", "state", "nodes", "restarts", "reason"):
            table.add_column(column)
        for job in jobs:
            for c in job["components"]:
                table.add_row(c["job_id"], c["role"], c["state"], c["nodes"], c["restarts"], c["reason"])
        out.print(table)
    for i, record in enumerate(local):
        out.print(
            f"local run {i}: {record['state']}, started {record.get('started')}, pid {record.get('pid')}, "
            f"log {record.get('log')}"
        )
    out.print(_progress_line(progress))
    return 0


def _progress_line(p: TrainingProgress) -> str:
    total = "?" if p.total_steps is None else p.total_steps
    step = f"step {p.steps_done}/{total}" if p.steps_done is not None else f"step -/{total}"
    if p.checkpoint_step is None:
        checkpoint = "no checkpoint yet"
    else:
        age = f", {_ago(p.checkpoint_age_s)} ago" if p.checkpoint_age_s is not None else ""
        checkpoint = f"newest checkpoint step {p.checkpoint_step}{age}"
    return f"training: {step}, {checkpoint}  (log: {p.log})"


def _ago(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    if seconds < 120:
        return f"{seconds} s"
    return f"{seconds // 60} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "status",
        help="show the state of a run's jobs (each het component: state, nodes, restarts) and its training step",
        description="Read RUN_DIR/manifest.json and ask Slurm about every job of the run (scontrol, then sacct); "
        "then the last logged step of the total (RUN_DIR/trajectories.h5) and the newest checkpoint.",
        epilog="examples:\n  rollout-hpc status runs/quickstart\n  rollout-hpc status runs/big --json | jq .jobs",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory made by `rollout-hpc submit`")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)
