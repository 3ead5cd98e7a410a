"""rollout-hpc watch RUN_DIR: a live terminal view of a run, from its files alone (login node, shared file system).

It reads what the trainer committed to RUN_DIR/trajectories.h5 (SWMR: also while it is written; the trainer commits
its metric rows every 10 steps and before each checkpoint), the checkpoints, and the manifest; it asks Slurm only
for the job's state and time left (`squeue`). Without a terminal, or with --once, it prints one frame.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
from rich.console import Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from rollout_hpc.commands import out
from rollout_hpc.config import UserError, load_config
from rollout_hpc.launch import rundir
from rollout_hpc.launch.status import ENDED, job_states, local_state
from rollout_hpc.rundir_layout import RESOLVED_CONFIG

BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: np.ndarray, width: int = 60) -> str:
    """The last `width` values as block characters, scaled to their own min..max (NaN: a gap)."""
    values = np.asarray(values, np.float64)[-width:]
    finite = values[np.isfinite(values)]
    if not len(finite):
        return ""
    lo, span = finite.min(), finite.max() - finite.min()
    return "".join(
        " " if not np.isfinite(v) else BARS[int((v - lo) / span * (len(BARS) - 1)) if span else len(BARS) // 2]
        for v in values
    )


def duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    days, rest = divmod(seconds, 86400)
    text = time.strftime("%H:%M:%S", time.gmtime(rest))
    return f"{days}-{text}" if days else text


def job_state(manifest: dict) -> tuple[str, bool, str | None, int]:
    """(state text, ended, Slurm job id while it runs, Slurm requeues) of the run's newest job or local run."""
    jobs, local = manifest.get("job_ids", []), manifest.get("local_runs", [])
    if jobs and (not local or manifest.get("launcher") == "slurm"):
        components = job_states(jobs[-1])
        states = [c.state for c in components]
        ended = all(s.split()[0] in ENDED for s in states)
        requeues = max((int(c.restarts) for c in components if c.restarts.isdigit()), default=0)
        return f"job {jobs[-1]} {'/'.join(dict.fromkeys(states))}", ended, None if ended else jobs[-1], requeues
    if local:
        state = local_state(local[-1])
        return f"local run {state}", state.startswith(("ENDED", "LOST")), None, 0
    return "nothing submitted", True, None, 0


def time_left(job_id: str) -> str | None:
    """The allocation's time left, as squeue prints it (%L), or None."""
    if shutil.which("squeue") is None:
        return None
    try:
        done = subprocess.run(["squeue", "-h", "-o", "%L", "-j", job_id], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return None
    lines = done.stdout.split()
    return lines[0] if done.returncode == 0 and lines else None


def frame(run_dir: Path, manifest: dict, job: tuple[str, bool, str | None, int]) -> Panel:
    from rollout_hpc.store.checkpoint import list_checkpoints  # in here: h5py (the CLI imports every command)
    from rollout_hpc.store.trajlog import TrajectoryLogError, TrajectoryReader, log_path

    state, ended, job_id, requeues = job
    cfg = load_config(run_dir / RESOLVED_CONFIG, [])
    total = cfg.total_steps
    rows = Table.grid(padding=(0, 2))
    rows.add_column(style="bold")
    rows.add_column()
    metrics: dict[str, np.ndarray] = {}
    evals: dict[str, np.ndarray] = {}
    status = ""
    if not log_path(run_dir).is_file():
        rows.add_row("log", "no trajectories.h5 yet (the job has not started training)")
    else:
        try:
            with TrajectoryReader(run_dir) as reader:
                metrics, evals, status = reader.metrics(), reader.eval_metrics(), reader.status_line()
        except (TrajectoryLogError, KeyError, OSError) as exc:  # caught while the trainer creates it: read it next time
            rows.add_row("log", f"{exc} (read again in the next frame)")
    steps = metrics.get("step", np.zeros(0))
    done = int(steps[-1]) + 1 if len(steps) else 0
    line = f"step {done}/{total}"
    times = metrics.get("time", np.zeros(0))[-20:]
    if len(times) >= 2 and done < total and not ended:
        per_step = float(np.median(np.diff(times)))  # the median: a gap (an interruption) does not count
        line += f"  ({done / max(total, 1):.0%}, ETA {duration(per_step * (total - done))}, {per_step:.2f} s/step)"
    rows.add_row("progress", line)
    for name, label, fmt in (
        ("reward_mean", "reward", "{:.3f}"),
        ("tokens_per_s", "tokens/s", "{:.0f}"),
        ("staleness_max", "staleness max", "{:.0f}"),
    ):
        values = metrics.get(name)
        if values is not None and np.isfinite(values).any():
            last = values[np.isfinite(values)][-1]
            rows.add_row(label, Text(fmt.format(last).ljust(8)) + Text(sparkline(values), style="cyan"))
    accuracy = evals.get("accuracy")
    if accuracy is not None and len(accuracy):
        last_eval = f"{accuracy[-1]:.3f} (step {int(evals['step'][-1])})".ljust(8)
        rows.add_row("eval accuracy", Text(last_eval + " ") + Text(sparkline(accuracy), style="green"))
    checkpoints = list_checkpoints(run_dir)
    if checkpoints:
        newest = checkpoints[-1]
        try:
            age = f", {duration(time.time() - newest.path.stat().st_mtime)} ago"
        except OSError:  # pruned by keep_last meanwhile
            age = ""
        rows.add_row("last checkpoint", f"step {newest.step}{age}")
    else:
        rows.add_row("last checkpoint", "none yet")
    left = time_left(job_id) if job_id else None
    if left:
        rows.add_row("allocation ends in", left)
    rows.add_row("restarts", str(len(manifest.get("resumes", [])) + requeues))  # `resume`s and Slurm requeues
    rows.add_row("job", state)
    if status:
        rows.add_row("log", status)
    title = f"[bold]{cfg.run.name}[/] {run_dir.resolve()}"
    return Panel(Group(rows), title=title, title_align="left", subtitle=time.strftime("%H:%M:%S"))


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if args.interval <= 0:
        raise UserError(f"--interval {args.interval}: give a number of seconds above 0 (e.g. --interval 5)")
    manifest = rundir.read_manifest(run_dir)

    def render() -> tuple[Panel, bool]:
        nonlocal manifest
        manifest = rundir.read_manifest(run_dir)  # resume and requeues add runs and jobs
        job = job_state(manifest)
        return frame(run_dir, manifest, job), job[1]

    view, ended = render()
    if args.once or ended or not out.is_terminal:
        out.print(view)
        return 0
    with Live(view, console=out, auto_refresh=False, transient=False) as live:
        while not ended:
            time.sleep(args.interval)
            view, ended = render()
            live.update(view, refresh=True)
    out.print("the job has ended")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "watch",
        help="a live view of a run: step and ETA, reward and eval sparklines, tokens/s, checkpoints, time left",
        description="Refreshes every --interval seconds from RUN_DIR's files (trajectories.h5, checkpoints, manifest) "
        "and Slurm's squeue, until the job ends; works from a login node on the shared file system.",
        epilog="examples:\n  rollout-hpc watch runs/quickstart\n  rollout-hpc watch runs/big --once",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory made by `rollout-hpc submit`")
    p.add_argument("--interval", type=float, default=5.0, metavar="S", help="seconds between refreshes (default 5)")
    p.add_argument("--once", action="store_true", help="print one frame and exit (scripts, tests)")
    p.set_defaults(func=run)
