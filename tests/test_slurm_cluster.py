"""The local multi-node Slurm cluster (tools/slurm_cluster.sh) does what rollout-hpc relies on: batch jobs,
heterogeneous jobs with one MPI world across their groups, cancellation, and the time-limit warning signal
followed by a requeue."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from conftest import guarded_srun

pytestmark = pytest.mark.slurm

MPI_AS_ROOT = "export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"


def write_script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/bash\n" + body.lstrip())
    return path


def wait_until(condition, timeout: float) -> bool:
    """Polls `condition` until it holds or `timeout` seconds pass; returns whether it held."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def expand_hostlist(cluster, hostlist: str) -> list[str]:
    return cluster.run("scontrol", "show", "hostnames", hostlist).stdout.split()


def test_batch_job_runs_on_a_cluster_node_and_writes_output(slurm_cluster, tmp_path):
    script = write_script(
        tmp_path / "plain.sh",
        f"""
#SBATCH --output={tmp_path}/plain.out
echo "job=$SLURM_JOB_ID node=$SLURMD_NODENAME"
{sys.executable} -c 'import sys; print("python", sys.version_info[0])'
""",
    )
    job = slurm_cluster.sbatch(script, cwd=tmp_path)
    assert slurm_cluster.wait_job(job, timeout=120) == "COMPLETED"
    out = (tmp_path / "plain.out").read_text().split()
    assert out[0] == f"job={job}"
    assert out[1].removeprefix("node=") in slurm_cluster.nodes
    assert out[2:] == ["python", "3"]


MPI_PROGRAM = """
import json, os, sys
from mpi4py import MPI

world = MPI.COMM_WORLD
node = os.environ["SLURMD_NODENAME"]
everyone = world.allgather((world.rank, node))  # a collective over the whole world: one world, not three
with open(os.path.join(sys.argv[1], f"rank-{world.rank}.json"), "w") as f:
    json.dump({"rank": world.rank, "size": world.size, "node": node, "gathered": everyone}, f)
"""


def test_het_job_step_spans_both_groups_in_one_mpi_world(slurm_cluster, tmp_path):
    program = tmp_path / "world.py"
    program.write_text(MPI_PROGRAM)
    script = write_script(
        tmp_path / "het.sh",
        f"""
#SBATCH --output={tmp_path}/het.out
#SBATCH --nodes=1 --ntasks=1
#SBATCH hetjob
#SBATCH --nodes=2 --ntasks=2 --ntasks-per-node=1
{MPI_AS_ROOT}
{guarded_srun(f"srun --het-group=0,1 --mpi=pmix {sys.executable} {program} {tmp_path}")}
""",
    )
    job = slurm_cluster.sbatch(script, cwd=tmp_path)
    state = slurm_cluster.wait_job(job, timeout=180)
    assert state == "COMPLETED", (tmp_path / "het.out").read_text()

    group0, group1 = slurm_cluster.job_records(job)
    group0_nodes = expand_hostlist(slurm_cluster, group0["NodeList"])
    group1_nodes = expand_hostlist(slurm_cluster, group1["NodeList"])
    assert len(group0_nodes) == 1 and len(group1_nodes) == 2
    assert set(group0_nodes).isdisjoint(group1_nodes)

    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(3)]
    assert [r["size"] for r in ranks] == [3, 3, 3]
    # Group 0's task is world rank 0, on group 0's node; group 1's tasks follow, one on each of its nodes.
    assert ranks[0]["node"] == group0_nodes[0]
    assert sorted(r["node"] for r in ranks[1:]) == sorted(group1_nodes)
    expected = [[r["rank"], r["node"]] for r in ranks]
    assert all(r["gathered"] == expected for r in ranks)


def test_scancel_ends_a_running_job(slurm_cluster, tmp_path):
    pid_file = tmp_path / "pid"
    script = write_script(
        tmp_path / "sleeper.sh",
        f"""
#SBATCH --output={tmp_path}/sleeper.out
echo $$ > {pid_file}.tmp && mv {pid_file}.tmp {pid_file}
sleep 600
""",
    )
    job = slurm_cluster.sbatch(script, cwd=tmp_path)
    slurm_cluster.wait_state(job, {"RUNNING"}, timeout=120)
    # RUNNING comes a moment before the script itself runs.
    assert wait_until(pid_file.exists, timeout=60), "the batch script of a RUNNING job never ran"
    pid = int(pid_file.read_text())
    slurm_cluster.run("scancel", str(job))
    assert slurm_cluster.wait_job(job, timeout=60) == "CANCELLED"

    # The batch script's process is gone once Slurm has finished cleaning up the job.
    gone = wait_until(lambda: not os.path.exists(f"/proc/{pid}"), timeout=60)
    assert gone, f"batch script pid {pid} outlived its cancelled job"


def test_time_limit_warning_signal_reaches_batch_script_and_requeue_restarts_it(slurm_cluster, tmp_path):
    # USR1 is due 50 s before the 1-minute limit: Slurm checks limits periodically, so it arrives within ~40 s.
    # The trap records it and requeues, the way a run checkpoints and continues in a new allocation.
    script = write_script(
        tmp_path / "warned.sh",
        f"""
#SBATCH --output={tmp_path}/warned.out --open-mode=append
#SBATCH --time=1 --signal=B:USR1@50 --requeue
if [ "${{SLURM_RESTART_COUNT:-0}}" -ge 1 ]; then
    echo "$SLURM_RESTART_COUNT" > {tmp_path}/restarted
    exit 0
fi
trap 'echo USR1 > {tmp_path}/signalled; scontrol requeue $SLURM_JOB_ID; exit 0' USR1
sleep 300 &
wait
""",
    )
    job = slurm_cluster.sbatch(script, cwd=tmp_path)
    state = slurm_cluster.wait_job(job, timeout=240)
    log = (tmp_path / "warned.out").read_text()
    assert (tmp_path / "signalled").read_text().strip() == "USR1", log
    assert state == "COMPLETED", log
    assert (tmp_path / "restarted").read_text().strip() == "1", log
    assert slurm_cluster.job_records(job)[0]["Restarts"] == "1"
