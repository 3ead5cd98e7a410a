"""placement: colocated. The generator and trainer ranks share the node (one emulated node under the local launcher),
take turns on-policy, and each uses all of the node's cores in its phase. A colocated run interrupted and resumed
ends with the same weights as one never interrupted, each sample trained once. Real mpirun ranks."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
from test_resume_local import assert_exactly_once, cli, stop_and_resume, weights_digest, write_run_config

from rollout_hpc.config import ConfigError, load_config
from rollout_hpc.launch.local import mpirun_command
from rollout_hpc.runtime.train_program import cpu_threads

COLOCATED = "placement: colocated"


def test_a_colocated_run_resumed_after_a_stop_matches_one_never_stopped(tmp_path):
    steps = 8  # a stop at step 2 (checkpoints every 3) leaves steps to resume into
    whole = tmp_path / "whole"
    config = write_run_config(tmp_path / "w", "whole", steps=steps, sleep=0.0, extra=COLOCATED)
    done = cli("submit", config, "--local", "--run-dir", whole, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    manifest = json.loads((whole / "manifest.json").read_text())
    assert manifest["local_command"].count("ROLLOUT_NODE=node0") == 2  # both groups on the one node

    cut = tmp_path / "cut"
    stop_and_resume(write_run_config(tmp_path, "cut", steps=steps, extra=COLOCATED), cut, 2, tmp_path, steps=steps)
    assert weights_digest(cut) == weights_digest(whole)
    assert_exactly_once(cut, steps)


def test_each_colocated_rank_has_the_nodes_cores_in_its_phase(monkeypatch):
    cfg = load_config(None, ["placement=colocated", "generator.cpus_per_task=1", "trainer.cpus_per_task=1"])
    monkeypatch.delenv("SLURM_CPUS_ON_NODE", raising=False)
    cores = len(os.sched_getaffinity(0))
    alone = SimpleNamespace(role="generator", local_size=1)
    assert cpu_threads(cfg, alone) == cores
    assert cpu_threads(cfg, SimpleNamespace(role="trainer", local_size=2)) == max(1, cores // 2)
    monkeypatch.setenv("SLURM_CPUS_ON_NODE", "48")
    assert cpu_threads(cfg, alone) == 48
    spread = load_config(None, ["generator.cpus_per_task=3"])  # disaggregated: the task's own CPUs
    monkeypatch.delenv("SLURM_CPUS_ON_NODE")
    assert cpu_threads(spread, alone) == 3
    grouped = load_config(
        None, ["rewards.models=[{name: rm, path: x, kind: judge, nodes: 1}]", "rewards.group.cpus_per_task=2"]
    )
    assert cpu_threads(grouped, SimpleNamespace(role="reward", local_size=1)) == 2


def test_colocated_layout_on_the_local_launcher(tmp_path):
    cfg = load_config(None, ["placement=colocated", "generator.nodes=2", "trainer.nodes=2", "trainer.tasks_per_node=2"])
    command = " ".join(mpirun_command(cfg, tmp_path))
    assert command.count("ROLLOUT_NODE=node0") == 2 and command.count("ROLLOUT_NODE=node1") == 2
    assert "gen0" not in command and "train0" not in command


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["exchange.max_staleness=1"], "exchange.max_staleness"),
        (["generator.nodes=2"], "generator.nodes"),
        (["launcher=slurm"], "launcher: local"),
    ],
)
def test_colocated_refuses_what_it_cannot_do(overrides, names):
    with pytest.raises(ConfigError, match=names):
        load_config(None, ["placement=colocated", *overrides])
