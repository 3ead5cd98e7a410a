"""The fault-injection suite on the local Slurm cluster (`tools/chaos.py --launcher slurm --quick`): one run hit by
every Slurm fault kind in turn, in a random order: scancel while a checkpoint is being written, a node of the job
failing mid-step (its slurmd, job steps and ranks killed with -9, the node set DOWN: Slurm requeues the job), kill -9
of the generator and of the trainer rank, a storm of time-limit warnings (USR1: checkpoint, the job requeues
itself); `rollout-hpc resume` (sbatch) after each fault that ends the job, until the run is done: exactly once, the
uninterrupted run's weights, no leftovers, each cause named in the job's log."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from chaos import SLURM_CAUSES

pytestmark = pytest.mark.slurm


def test_every_slurm_fault_kind_is_survived_with_nothing_lost(slurm_cluster, repo_root, tmp_path):
    done = subprocess.run(
        [sys.executable, str(repo_root / "tools" / "chaos.py"), "--launcher", "slurm", "--quick"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1200,
        env=slurm_cluster.env,
    )
    report = done.stdout + done.stderr[-4000:]
    assert done.stdout.strip(), report  # chaos.py ended before its summary line: its error is in the report
    result = json.loads(done.stdout.splitlines()[-1])
    assert set(result["by_fault"]) == set(SLURM_CAUSES), report
    assert result["faults_injected"] == result["survived"] == len(SLURM_CAUSES), report
    assert result["samples_lost"] == 0 and result["duplicates"] == 0 and result["hangs"] == 0, report
    assert done.returncode == 0, report
