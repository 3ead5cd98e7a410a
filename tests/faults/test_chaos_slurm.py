"""The fault-injection suite on the local Slurm cluster (`tools/chaos.py --launcher slurm --quick`): one round of each
Slurm fault kind: scancel while a checkpoint is being written, and a node of the job failing mid-step (its slurmd,
job steps and ranks killed with -9, the node set DOWN: Slurm requeues the job); then `rollout-hpc resume` (sbatch)
until the run is done: exactly once, the uninterrupted run's weights, no leftovers, the cause named in the job's
log."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from chaos import SLURM_CAUSES

pytestmark = pytest.mark.slurm


def test_scancel_during_a_checkpoint_and_a_failed_node_are_survived(slurm_cluster, repo_root, tmp_path):
    done = subprocess.run(
        [sys.executable, str(repo_root / "tools" / "chaos.py"), "--launcher", "slurm", "--quick"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1200,
        env=slurm_cluster.env,
    )
    report = done.stdout + done.stderr[-4000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert set(result["by_fault"]) == set(SLURM_CAUSES), report
    assert result["faults_injected"] == result["survived"] == len(SLURM_CAUSES), report
    assert result["samples_lost"] == 0 and result["duplicates"] == 0 and result["hangs"] == 0, report
    assert done.returncode == 0, report
