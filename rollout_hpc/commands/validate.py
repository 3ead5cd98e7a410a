"""rollout-hpc validate CONFIG: check a config and summarize the job it describes."""

from __future__ import annotations

import argparse

from rich.table import Table

from rollout_hpc.commands import add_config_arguments, load, out
from rollout_hpc.config import Config
from rollout_hpc.envs.registry import check_task
from rollout_hpc.launch.rundir import check_init_from, check_model_path
from rollout_hpc.launch.submit import resolve_launcher


def summary_table(cfg: Config) -> Table:
    table = Table(title=f"run {cfg.run.name}  (digest {cfg.digest()[:12]})", show_header=True)
    for column in ("group", "nodes", "tasks/node", "ranks", "gpus/task", "cpus/task", "backend"):
        table.add_column(column)
    # the reward and environment groups (if any) have no backend of their own: the models' / the task's
    what = {"reward": "models", "env": f"{cfg.envs.workers} workers" if cfg.envs.workers else "threads"}
    for role, g, _ in cfg.het_groups:
        backend = getattr(g, "backend", what.get(role, ""))
        table.add_row(
            role, str(g.nodes), str(g.tasks_per_node), str(g.ranks), str(g.gpus_per_task), str(g.cpus_per_task), backend
        )
    return table


def run(args: argparse.Namespace) -> int:
    cfg = load(args)
    check_model_path(cfg.model.path)
    task = check_task(cfg)  # reads and checks a dataset's files, the reward, the eval split
    check_init_from(cfg.model.init_from)
    out.print(summary_table(cfg))
    if callable(getattr(task, "describe", None)):
        out.print(f"task {cfg.task.name}: {task.describe()}")
    out.print(
        f"[green]ok[/]: {args.config} is valid: {cfg.algorithm.name} on task {cfg.task.name}, "
        f"{cfg.algorithm.steps} steps, world of {cfg.world_size} ranks, launcher {cfg.launcher} "
        f"(here: {resolve_launcher(cfg)}), run directory {cfg.run.resolved_dir()}"
    )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "validate",
        help="check a config file and show the job it describes",
        description="Check a config (types, unknown keys, feasibility) with --set overrides applied; "
        "exit 0 when valid, 2 with the field, line and fix otherwise.",
        epilog="examples:\n  rollout-hpc validate configs/quickstart.yaml\n"
        "  rollout-hpc validate configs/examples/grpo-7b-vllm-deepspeed.yaml --set trainer.nodes=4",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_arguments(p)
    p.set_defaults(func=run)
