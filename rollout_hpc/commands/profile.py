"""rollout-hpc profile CONFIG --out PROFILE.json: measure the costs `rollout-hpc plan` predicts from.

Runs run.program 'profile' (runtime/profile_program.py) as a short job of its own: one generator node and one
trainer node of the config's shape (tasks per node, CPUs, GPUs, backends, model, task), under mpirun here or as a
small Slurm het job with --set launcher=slurm (this command then waits for it). The profile lands in the job's run
directory and is copied to --out.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from rollout_hpc.commands import add_config_arguments, config_path, out
from rollout_hpc.config import load_config
from rollout_hpc.errors import UserError
from rollout_hpc.launch import rundir
from rollout_hpc.launch.local import record_mpirun_command, require_mpirun, run_local
from rollout_hpc.launch.mpi_env import placement_env
from rollout_hpc.launch.status import ENDED, job_states
from rollout_hpc.launch.submit import resolve_launcher, submit_slurm
from rollout_hpc.scale.profile import PROFILE_FILE, Profile

# One node of each group, disaggregated: per-node costs, and the MPI link between two nodes.
CALIBRATION_WARMUP = 3  # the calibration run's first steps (first calls, allocator, caches) are not averaged
PROFILE_LAYOUT = ["generator.nodes=1", "trainer.nodes=1", "placement=disaggregated"]


def run(args: argparse.Namespace) -> int:
    base = load_config(args.config, args.overrides)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    root = Path(args.run_dir) if args.run_dir else base.run.resolved_dir().parent / f"{base.run.name}-profile-{stamp}"
    target = Path(args.out)
    if target.is_dir():
        raise UserError(f"--out {target} is a directory; give a file name, e.g. --out {target / 'profile.json'}")
    measure = [*args.overrides, *PROFILE_LAYOUT, "run.program=profile", f"run.name={base.run.name}-profile"]
    cfg = load_config(args.config, measure)
    launcher = resolve_launcher(cfg, force_local=args.local)
    out.print(
        f"profiling {args.config or '(defaults)'} in {root} ({launcher} launcher): 1 generator node x "
        f"{cfg.generator.tasks_per_node} ranks, 1 trainer node x {cfg.trainer.tasks_per_node} ranks"
    )
    run_dir = _run_job(args, cfg, measure, root / "measure", launcher)
    made = run_dir / PROFILE_FILE
    if not made.is_file():
        raise UserError(f"the profiling job ended without writing {made}; see {run_dir / rundir.LOGS}/ for why")
    profile = Profile.load(made)
    if args.calibration_steps:
        _calibrate(args, profile, root / "calibrate", launcher)
    target.parent.mkdir(parents=True, exist_ok=True)
    profile.save(target)
    _summary(profile)
    out.print(f"profile: {target}   next: rollout-hpc plan {args.config or 'CONFIG'} --nodes N --profile {target}")
    return 0


def _run_job(args, cfg, overrides: list[str], run_dir: Path, launcher: str) -> Path:
    """Run `cfg` to its end with the launcher (waiting for a Slurm job); returns its run directory."""
    if launcher == "slurm":
        # The job inherits this environment (sbatch --export=ALL): the ranks' OpenMP waits as colocated ranks'.
        os.environ.update(placement_env(cfg))
        sub = submit_slurm(cfg, config_path(args), overrides, run_dir=run_dir)
        out.print(f"submitted job {sub.job_ids[0]}; waiting for it (logs: {sub.run_dir / rundir.LOGS}/)")
        _wait(sub.job_ids[0], args.timeout)
        return sub.run_dir
    require_mpirun()
    run_dir = rundir.create_run_dir(run_dir, cfg, config_path(args), launcher="local", script=None, overrides=overrides)
    record_mpirun_command(cfg, run_dir)
    code = run_local(cfg, run_dir, out)
    if code != 0:
        raise UserError(f"the profiling job failed (exit {code}); its output is in {run_dir / rundir.LOGS}/")
    return run_dir


def _calibrate(args, profile: Profile, run_dir: Path, launcher: str) -> None:
    """A short real run of the profile's own layout (on-policy, no eval, no checkpoints), split by the trainer's
    timing of each step: what the generators' part (the trainer's wait) and the trainers' part (the rest) take
    beyond the model's parts become the profile's generator and per-step overheads (batch building, sorting,
    metrics, the exchange's bookkeeping). Only this run is used, never a run `plan --check` is later asked about."""
    from rollout_hpc.analysis.step_times import mean_phase_times  # h5py: not at `rollout-hpc --help`
    from rollout_hpc.scale.plan import predict_run  # numpy and simpy: not at `rollout-hpc --help`

    steps = args.calibration_steps
    overrides = [
        *args.overrides,
        *PROFILE_LAYOUT,
        "exchange.max_staleness=0",
        f"algorithm.steps={steps}",
        "warmup.sft_steps=0",
        "eval=null",
        "checkpoint.every_steps=0",
        "checkpoint.every_minutes=0",
    ]
    cfg = load_config(args.config, [*overrides, f"run.name={load_config(args.config, args.overrides).run.name}-cal"])
    out.print(f"calibration: {steps} real steps of that layout")
    done = _run_job(args, cfg, overrides, run_dir, launcher)
    measured, n = mean_phase_times(done, 0, skip=CALIBRATION_WARMUP)
    model = predict_run(profile, cfg, steps=steps)
    c = profile.costs
    rows = -(-cfg.algorithm.prompts_per_step // cfg.generator.ranks) * cfg.algorithm.group_size
    c.gen_row_overhead_s = max(0.0, measured["idle_time"] - model.gen_s - model.handoff_s) / rows
    trainer_part = measured["step_time"] - measured["idle_time"]
    c.step_overhead_s = max(0.0, trainer_part - model.train_s - model.sync_s)
    profile.measurements["calibration"] = {"steps": n, "measured": measured, "model_step_s": model.step_s}


def _wait(job_id: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        states = job_states(job_id)
        now = " ".join(sorted({s.state for s in states}))
        if now != last:
            out.print(f"  job {job_id}: {now}")
            last = now
        if all(s.state.split()[0] in ENDED for s in states):
            bad = [s for s in states if s.state.split()[0] != "COMPLETED"]
            if bad:
                raise UserError(f"the profiling job {job_id} ended {bad[0].state} ({bad[0].reason or 'no reason'})")
            return
        if time.monotonic() > deadline:
            raise UserError(
                f"the profiling job {job_id} has not ended after {timeout_s:g}s; raise --timeout, or "
                f"`rollout-hpc cancel` it"
            )
        time.sleep(2)


def _summary(p: Profile) -> None:
    c, w, m = p.costs, p.workload, p.machine
    lengths = sorted(w.response_lengths)
    out.print(
        f"  generation: {c.gen_fixed_s * 1e3:.1f} ms + n x {c.gen_row_s * 1e3:.2f} ms + L x ({c.gen_token_s * 1e3:.2f} ms + n x "
        f"{c.gen_token_row_s * 1e3:.3f} ms)   responses: median {lengths[len(lengths) // 2]} tokens, "
        f"max {lengths[-1]} of {w.max_new_tokens}"
    )
    out.print(f"  training:   {c.train_fixed_s * 1e3:.1f} ms + {c.train_token_s * 1e6:.1f} us x tokens per rank")
    out.print(
        f"  rewards {c.reward_s_per_sample * 1e3:.2f} ms/sample; log {c.log_s_per_sample * 1e6:.0f} us/sample; "
        f"MPI {c.mpi_gb_per_s:.2f} GB/s; broadcast stage {c.bcast_gb_per_s:.2f} GB/s; ring {c.ring_gb_per_s:.2f} "
        f"GB/s; checkpoint write {c.fs_write_gb_per_s:.2f} GB/s read {c.fs_read_gb_per_s:.2f} GB/s; "
        f"start-up {c.startup_s:.1f} s"
    )
    out.print(
        f"  overhead (calibration run): generators {c.gen_row_overhead_s * 1e6:.0f} us a row, trainers "
        f"{c.step_overhead_s * 1e3:.1f} ms a step"
    )
    out.print(
        f"  machine: {m.hostname}, {m.cores_per_node} cores/node, {m.gpus_per_node} GPUs/node"
        f"{', all nodes on this one host' if m.shared_host else ''}"
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "profile",
        help="measure generation, training, links and storage for `rollout-hpc plan`",
        description="Run a short profiling job with CONFIG's model, task and backends on one generator node and "
        "one trainer node, and write what it measured (generation and training speed by batch size and length, "
        "the response-length distribution, reward and logging cost, MPI, ring and broadcast bandwidth, checkpoint "
        "write and read bandwidth, start-up time, machine, versions, config digest) to --out as JSON.",
        epilog="examples:\n  rollout-hpc profile configs/quickstart.yaml --out quickstart.profile.json\n"
        "  rollout-hpc profile my.yaml --set launcher=slurm --out my.profile.json   # a small Slurm job\n"
        "  rollout-hpc plan my.yaml --nodes 64 --profile my.profile.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_arguments(p)
    p.add_argument("--out", required=True, metavar="PROFILE.json", help="where to write the profile")
    p.add_argument("--local", action="store_true", help="run here under mpirun whatever launcher the config names")
    p.add_argument(
        "--run-dir", metavar="DIR", help="directory of the profiling jobs' run directories (default: next to run.dir)"
    )
    p.add_argument(
        "--calibration-steps",
        type=int,
        default=20,
        metavar="S",
        help="steps of the short real run that measures the per-step overhead (0: none; default 20)",
    )
    p.add_argument(
        "--timeout", type=float, default=3600, metavar="S", help="give up waiting for a Slurm job after S seconds"
    )
    p.set_defaults(func=run)
