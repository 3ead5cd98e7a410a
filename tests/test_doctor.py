"""`rollout-hpc doctor` and `submit --doctor` on this machine: the probe is a real mpirun of the run's rank layout
(one generator and one trainer block) that allreduces and reports each rank's facts. A sound config passes every
check and is submitted; a config whose rings do not fit /dev/shm, whose checkpoints do not fit the disk and whose
dataset file is missing is refused with each failure named and its fix, and nothing is created."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_hpc.commands.doctor import parameter_count
from rollout_hpc.config import load_config


def cli(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rollout_hpc", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "COLUMNS": "250"},
    )


def write_config(tmp: Path, extra: str = "") -> Path:
    path = tmp / "doc.yaml"
    path.write_text(f"""
run: {{name: doc, seed: 0}}
launcher: local
task: {{name: arithmetic, params: {{max_operand: 4, ops: "+"}}}}
algorithm: {{steps: 2, prompts_per_step: 2, group_size: 4, max_new_tokens: 1}}
checkpoint: {{every_steps: 1, keep_last: 2}}
{extra}""")
    return path


def rows(output: str) -> dict[str, str]:
    """check name -> 'ok' / 'FAILED' from the rich table."""
    found = {}
    for line in output.splitlines():
        cells = [c.strip() for c in line.strip("│┃ ").split("│")]
        if len(cells) >= 2 and cells[1] in ("ok", "FAILED"):
            found[cells[0]] = cells[1]
    return found


CHECKS = [
    "paths readable here",
    "checkpoint room",
    "MPI across the het groups",
    "versions agree",
    "ring room in /dev/shm",
    "run directory shared",
    "paths readable on every node",
]


def verdicts(failed: set[str]) -> dict[str, str]:
    return {name: "FAILED" if name in failed else "ok" for name in CHECKS}


def test_submit_doctor_passes_then_submits(tmp_path):
    done = cli("submit", write_config(tmp_path), "--doctor", "--dry-run", "--run-dir", tmp_path / "run", cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert rows(out) == verdicts(failed=set()), out
    assert "2 ranks on 2 node(s) (gen0, train0), allreduce over the world ok" in out
    assert f"Python {sys.version.split()[0]}, rollout-hpc" in out and "every check passed" in out
    assert (tmp_path / "run" / "manifest.json").is_file()  # then submitted (a dry run: the run directory)
    assert not list(tmp_path.glob("run/.rollout-doctor-*")) and not list(tmp_path.glob(".rollout-doctor-*"))


def test_doctor_names_each_failure_and_submit_creates_nothing(tmp_path):
    missing = "/nonexistent-rollout-doctor/train.jsonl"
    config = write_config(tmp_path, "exchange: {ring_bytes: 100000000000000}")
    config.write_text(
        config.read_text().replace(
            'task: {name: arithmetic, params: {max_operand: 4, ops: "+"}}',
            f'task: {{name: dataset, reward: math, params: {{train: "{missing}", prompt_key: q, answer_key: a}}}}',
        )
    )
    big = ["--set", "model.hidden_size=262144", "--set", "model.num_heads=4"]
    done = cli("submit", config, "--doctor", *big, "--run-dir", tmp_path / "run", cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out[-3000:]
    failed = {"paths readable here", "checkpoint room", "ring room in /dev/shm", "paths readable on every node"}
    assert rows(out) == verdicts(failed), out  # MPI, versions and the shared run directory still pass
    assert f"cannot read {missing}" in out and f"{missing} (on gen0, train0)" in out  # here, and on every node
    assert "lower checkpoint.keep_last" in out and "lower exchange.ring_bytes" in out
    assert "nothing was submitted" in out and not (tmp_path / "run").exists()


def test_checkpoint_estimate_matches_the_built_in_models_parameters():
    cfg = load_config(None, ["model.hidden_size=64", "model.num_heads=4"])
    from rollout_hpc.models import build_model, load_tokenizer  # torch: only this test

    real = sum(p.numel() for p in build_model(cfg.model, load_tokenizer(cfg.model).vocab_size).parameters())
    assert abs(parameter_count(cfg) - real) / real < 0.1, (parameter_count(cfg), real)


@pytest.mark.slurm
@pytest.mark.parametrize("where", ["login node", "in allocation"])
def test_doctor_on_the_slurm_cluster_probes_both_het_groups(slurm_cluster, tmp_path, where):
    """From the login node srun allocates the het layout (one node per group) for the probe; --in-allocation runs
    it inside a het job's allocation (here: salloc), as the first seconds of a job would."""
    doctor = [sys.executable, "-m", "rollout_hpc", "doctor", str(write_config(tmp_path)), "--set", "launcher=slurm"]
    if where == "in allocation":
        doctor = ["salloc", "-N1", "-n1", ":", "-N1", "-n1", *doctor, "--in-allocation"]
    done = subprocess.run(
        doctor, cwd=tmp_path, capture_output=True, text=True, timeout=240, env={**slurm_cluster.env, "COLUMNS": "250"}
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert rows(out) == verdicts(failed=set()), out
    nodes = re.search(r"2 ranks on 2 node\(s\) \((n\d), (n\d)\)", out)
    assert nodes and nodes[1] != nodes[2], out  # one rank per het group, each on its own node


@pytest.mark.slurm
def test_doctor_probes_a_colocated_layout_as_one_component_on_the_slurm_cluster(slurm_cluster, tmp_path):
    """placement colocated: the probe's srun asks for one component (both groups' tasks on each node, dealt out
    cyclically), so generator and trainer rank share the node."""
    doctor = [sys.executable, "-m", "rollout_hpc", "doctor", str(write_config(tmp_path)), "--set", "launcher=slurm"]
    done = subprocess.run(
        [*doctor, "--set", "placement=colocated"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        env={**slurm_cluster.env, "COLUMNS": "250"},
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert rows(out) == verdicts(failed=set()), out
    assert re.search(r"2 ranks on 1 node\(s\) \(n\d\)", out), out
