"""rollout-hpc prepare CONFIG: make (or reuse) a run directory inside a job started with plain sbatch.

slurm/rollout.sbatch calls this when it runs without `rollout-hpc submit`: then the allocation's
#SBATCH lines decide the layout, so the group sizes are taken from Slurm's environment.
Prints the run directory's absolute path (the only stdout output).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from rollout_hpc.commands import add_config_arguments, config_path
from rollout_hpc.config import load_config
from rollout_hpc.errors import UserError
from rollout_hpc.launch import rundir

GROUPS = ("generator", "trainer")


def _tasks_per_node(spec: str) -> int:
    """SLURM_TASKS_PER_NODE style '2(x3)' or '2' -> 2; uneven layouts ('2(x2),1') are refused."""
    counts = {int(m.group(1)) for m in re.finditer(r"(\d+)(?:\(x\d+\))?", spec)}
    if len(counts) != 1:
        raise UserError(
            f"the allocation has uneven tasks per node ({spec}); use --ntasks-per-node in the #SBATCH lines"
        )
    return counts.pop()


def extra_components(cfg) -> list[tuple[str, list[str]]]:
    """The het components after the generators and trainers that cfg asks for: (role, the config keys their size
    sets): the reward group (every rewards.models entry with nodes > 0), the environment group (envs)."""
    out = []
    grouped = [f"rewards.models[{m}]" for m, spec in enumerate(cfg.rewards.models) if spec.nodes > 0]
    if grouped:
        out.append(("reward", grouped))
    if cfg.envs.nodes:
        out.append(("env", ["envs"]))
    return out


_HOW = {"reward": "rewards.models with nodes > 0", "env": "envs.nodes > 0"}


def allocation_layout(env: Mapping[str, str] = os.environ, extra: Sequence[tuple[str, list[str]]] = ()) -> list[str]:
    """--set overrides giving each group the nodes and tasks per node of this het allocation. `extra`: the components
    after the trainers (extra_components of the config), each sized by the allocation's component of its index."""
    groups = [(g, [g]) for g in GROUPS] + list(extra)
    want = str(len(groups))
    if env.get("SLURM_HET_SIZE") != want:
        roles = ", ".join(f"{role}s" for role, _ in groups)
        got = env.get("SLURM_HET_SIZE", "unset")
        hint = (
            f"; a component after the trainers needs {' or '.join(_HOW.values())} in the config"
            if got.isdigit() and int(got) > len(groups)
            else f", one before each group after the first, or set {' and '.join(_HOW[r] for r, _ in extra)} to 0"
            if extra
            else ""
        )
        raise UserError(
            f"this job is not a heterogeneous job of {want} components ({roles}): SLURM_HET_SIZE is {got}. "
            f"Keep the '#SBATCH hetjob' lines of slurm/rollout.sbatch{hint}."
        )
    overrides = []
    for index, (group, keys) in enumerate(groups):
        nodes = env.get(f"SLURM_JOB_NUM_NODES_HET_GROUP_{index}") or env.get(f"SLURM_NNODES_HET_GROUP_{index}")
        per_node = env.get(f"SLURM_NTASKS_PER_NODE_HET_GROUP_{index}") or env.get(
            f"SLURM_TASKS_PER_NODE_HET_GROUP_{index}"
        )
        if not nodes or not per_node:
            raise UserError(f"Slurm did not say the size of het group {index} ({group}s); is this a Slurm job?")
        for key in keys:
            overrides += [f"{key}.nodes={int(nodes)}", f"{key}.tasks_per_node={_tasks_per_node(per_node)}"]
    return overrides


def colocated_layout(cfg, env: Mapping[str, str] = os.environ) -> list[str]:
    """--set overrides giving a colocated run (one component, each node running both groups) this allocation's node
    count; its tasks per node must be the config's generator plus trainer tasks."""
    if env.get("SLURM_HET_SIZE"):
        raise UserError(
            f"placement 'colocated' runs as a job of one component, each node running generator and trainer tasks, but "
            f"this job is heterogeneous ({env['SLURM_HET_SIZE']} components): submit it with `rollout-hpc submit "
            "CONFIG`, or sbatch the script `rollout-hpc render CONFIG` writes"
        )
    nodes, per_node = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES"), env.get("SLURM_NTASKS_PER_NODE")
    if not nodes:
        raise UserError("Slurm did not say how many nodes this job has (SLURM_JOB_NUM_NODES); is this a Slurm job?")
    want = cfg.generator.tasks_per_node + cfg.trainer.tasks_per_node
    if per_node and _tasks_per_node(per_node) != want:
        raise UserError(
            f"placement 'colocated' needs generator.tasks_per_node + trainer.tasks_per_node = {want} tasks on each "
            f"node, but this job has {per_node} (#SBATCH --ntasks-per-node={want}, or change the config)"
        )
    return [f"generator.nodes={int(nodes)}", f"trainer.nodes={int(nodes)}"]


def run(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.from_allocation:
        asked = load_config(args.config, overrides)
        layout = (
            colocated_layout(asked)
            if asked.placement == "colocated"
            else allocation_layout(extra=extra_components(asked))
        )
        print(f"rollout-hpc prepare: layout from the allocation: {' '.join(layout)}", file=sys.stderr)
        overrides += layout
    cfg = load_config(args.config, overrides)
    run_dir = Path(args.run_dir or cfg.run.resolved_dir()).absolute()
    job_id = os.environ.get("SLURM_JOB_ID")
    if not (run_dir / rundir.MANIFEST).exists():
        script = Path(args.script).read_text() if args.script else None
        try:
            rundir.create_run_dir(run_dir, cfg, config_path(args), launcher="slurm", script=script, overrides=overrides)
        except UserError:
            if not (run_dir / rundir.MANIFEST).exists():  # not a concurrent job of the same run
                raise
    manifest = rundir.read_manifest(run_dir)
    if manifest.get("config_digest") != cfg.digest():
        raise UserError(
            f"run directory {run_dir} holds a run with a different config (digest {manifest.get('config_digest', '?')[:12]}, "
            f"this one {cfg.digest()[:12]}); set ROLLOUT_RUN_DIR or run.name for a new run"
        )
    if job_id:
        rundir.add_job_ids(run_dir, [job_id])
    print(run_dir)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "prepare",
        help="(used by slurm/rollout.sbatch) make or reuse a run directory inside a job",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_arguments(p)
    p.add_argument("--run-dir", metavar="DIR", help="run directory (default: run.dir or runs/<run.name>)")
    p.add_argument(
        "--from-allocation",
        action="store_true",
        help="take each group's nodes and tasks per node from the Slurm het allocation",
    )
    p.add_argument("--script", metavar="FILE", help="job script to keep as RUN_DIR/job.sbatch")
    p.set_defaults(func=run)
