"""The fault-injection suite on the local Slurm cluster: `rollout-hpc cancel` (scancel) while a checkpoint is being
written, then `rollout-hpc resume` (sbatch) until the run is done: exactly once, the uninterrupted run's weights,
no leftovers, the stop named in the job's log."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slurm


def test_scancel_during_a_checkpoint_is_survived(slurm_cluster, repo_root, tmp_path):
    done = subprocess.run(
        [sys.executable, str(repo_root / "tools" / "chaos.py"), "--launcher", "slurm", "--rounds", "1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1200,
        env=slurm_cluster.env,
    )
    report = done.stdout + done.stderr[-4000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["faults_injected"] == result["survived"] == 1, report
    assert result["samples_lost"] == 0 and result["duplicates"] == 0 and result["hangs"] == 0, report
    assert done.returncode == 0, report
