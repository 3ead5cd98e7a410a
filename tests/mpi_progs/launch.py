"""Run a program under real `mpirun` for the tests, with emulated nodes.

`blocks` is a list of (n_ranks, node_name or None, argv): each becomes one MPMD
block of `mpirun`, with ROLLOUT_NODE=node_name so ranks of different blocks
look like different nodes (the same trick the local launcher uses).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
PROGS = Path(__file__).resolve().parent


def mpi_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1")
    env.setdefault("PMIX_MCA_psec", "native")  # as the local launcher's (launch/local.py): no 2.3 s munge retries
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


def write_config(run_dir: Path, overrides: list[str]):
    """A resolved config in run_dir, as the launcher writes it; returns the Config."""
    from rollout_hpc.config import load_config

    cfg = load_config(None, [f"run.dir={run_dir}", *overrides])
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.resolved.yaml").write_text(yaml.safe_dump(cfg.resolved()))
    return cfg


def node_blocks(cfg, argv: list[str]) -> list[tuple[int, str, list[str]]]:
    """One MPMD block per node of the config: generators first, like the het job."""
    blocks = [(cfg.generator.tasks_per_node, f"gen{i}", argv) for i in range(cfg.generator.nodes)]
    blocks += [(cfg.trainer.tasks_per_node, f"train{i}", argv) for i in range(cfg.trainer.nodes)]
    return blocks


def mpirun(blocks, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = ["mpirun", "--oversubscribe"]
    for i, (n, node, argv) in enumerate(blocks):
        if i:
            cmd.append(":")
        cmd += ["-np", str(n)]
        if node:
            cmd += ["-x", f"ROLLOUT_NODE={node}"]
        cmd += [sys.executable, *argv]
    return subprocess.run(cmd, env=mpi_env(env), capture_output=True, text=True, timeout=timeout, cwd=REPO)
