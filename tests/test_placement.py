"""placement: colocated. The generator and trainer ranks share the node (one emulated node under the local launcher),
take turns on-policy, and each uses all of the node's cores in its phase. A colocated run interrupted and resumed
ends with the same weights as one never interrupted, each sample trained once. Real mpirun ranks."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_resume_local import assert_exactly_once, cli, stop_and_resume, weights_digest, write_run_config
from test_resume_slurm import warned_once_checkpointed
from test_submit_slurm import submitted_job

from rollout_hpc.config import ConfigError, load_config
from rollout_hpc.launch.local import mpirun_command
from rollout_hpc.runtime.train_program import cpu_threads

COLOCATED = "placement: colocated"


STEPS = 8  # a stop at step 2 (checkpoints every 3) leaves steps to resume into
TWO_NODES = "generator: {nodes: 2}\ntrainer: {nodes: 2}"


def never_stopped(directory: Path, extra: str) -> Path:
    """A colocated run of STEPS steps under the local launcher, never interrupted: the reference."""
    whole = directory / "whole"
    config = write_run_config(directory / "w", "whole", steps=STEPS, sleep=0.0, extra=extra)
    done = cli("submit", config, "--local", "--run-dir", whole, cwd=directory)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return whole


def test_a_colocated_run_resumed_after_a_stop_matches_one_never_stopped(tmp_path):
    whole = never_stopped(tmp_path, COLOCATED)
    manifest = json.loads((whole / "manifest.json").read_text())
    assert manifest["local_command"].count("ROLLOUT_NODE=node0") == 2  # both groups on the one node

    cut = tmp_path / "cut"
    stop_and_resume(write_run_config(tmp_path, "cut", steps=STEPS, extra=COLOCATED), cut, 2, tmp_path, steps=STEPS)
    assert weights_digest(cut) == weights_digest(whole)
    assert_exactly_once(cut, STEPS)


@pytest.mark.slurm
def test_a_colocated_slurm_job_on_two_nodes_warned_and_requeued_matches_the_local_run(slurm_cluster, tmp_path):
    """Colocated under Slurm: one job of one component, two nodes each running a generator and a trainer task
    (srun --distribution=cyclic; with block distribution both generators would land on one node and the world
    refuses the layout). USR1 to the batch shell once a checkpoint exists -> checkpoint, exit 75, requeue -> the run
    ends with the weights of the same run under the local launcher, each sample trained once."""
    layout = f"{COLOCATED}\n{TWO_NODES}"
    whole = never_stopped(tmp_path, layout)
    # The local cluster's nodes are one host: with two tasks on each of two such "nodes", Open MPI's shared-memory
    # transport (btl vader) segfaulted in MPI start-up here, every time (MPI_Comm_split); TCP runs. A real cluster's
    # nodes are different hosts.
    tcp = "slurm: {env: {OMPI_MCA_btl: 'self,tcp'}}"
    config = write_run_config(tmp_path, "onslurm", steps=STEPS, launcher="slurm", extra=f"{layout}\n{tcp}")
    run_dir = tmp_path / "onslurm"
    job_id = submitted_job(cli("submit", config, "--run-dir", run_dir, cwd=tmp_path))
    script = (run_dir / "job.sbatch").read_text()
    assert "#SBATCH hetjob" not in script and "#SBATCH --nodes=2" in script and "--ntasks-per-node=2" in script
    warned_once_checkpointed(slurm_cluster, run_dir, job_id)
    records = slurm_cluster.job_records(int(job_id))
    assert (
        len(records) == 1
        and len(slurm_cluster.run("scontrol", "show", "hostnames", records[0]["NodeList"]).stdout.split()) == 2
    ), records
    assert weights_digest(run_dir) == weights_digest(whole)
    assert_exactly_once(run_dir, STEPS)
    status = json.loads(cli("status", run_dir, "--json", cwd=tmp_path).stdout)
    assert status["jobs"][-1]["components"][0]["role"] == "generator+trainer", status


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
        (["envs.nodes=1", "task.name=frozenlake"], "envs.nodes"),
    ],
)
def test_colocated_refuses_what_it_cannot_do(overrides, names):
    with pytest.raises(ConfigError, match=names):
        load_config(None, ["placement=colocated", *overrides])


def test_colocated_ranks_openmp_workers_spin_briefly_unless_the_user_chose(monkeypatch):
    """Colocated ranks get a short OpenMP spin (workers stay awake between a phase's ops and give the cores back
    within about a millisecond); disaggregated ranks keep the runtime's default; a user's own setting wins."""
    from rollout_hpc.launch.mpi_env import COLOCATED_SPINCOUNT, placement_env

    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"):
        monkeypatch.delenv(name, raising=False)
    colocated = load_config(None, ["placement=colocated"])
    assert placement_env(colocated) == {"GOMP_SPINCOUNT": str(COLOCATED_SPINCOUNT), "KMP_BLOCKTIME": "1"}
    assert placement_env(load_config(None, [])) == {}
    assert placement_env(load_config(None, ["run.program=profile"]))["GOMP_SPINCOUNT"] == str(COLOCATED_SPINCOUNT)
    for name, value in (("OMP_WAIT_POLICY", "PASSIVE"), ("GOMP_SPINCOUNT", "0"), ("KMP_BLOCKTIME", "200")):
        monkeypatch.setenv(name, value)
        assert placement_env(colocated) == {}
        monkeypatch.delenv(name)


def test_a_colocated_job_script_is_one_component_whose_step_deals_ranks_cyclically(tmp_path, monkeypatch):
    from rollout_hpc.launch.render import render_script

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("KMP_BLOCKTIME", raising=False)
    cfg = load_config(
        None,
        [
            "placement=colocated",
            "launcher=slurm",
            "generator.nodes=3",
            "trainer.nodes=3",
            "trainer.tasks_per_node=2",
            "generator.cpus_per_task=4",
            "trainer.cpus_per_task=2",
            "generator.mem=16G",
            "trainer.mem=512M",
        ],
    )
    script = render_script(cfg, tmp_path / "run")
    directives = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH hetjob" not in directives
    assert {"#SBATCH --nodes=3", "#SBATCH --ntasks-per-node=3", "#SBATCH --cpus-per-task=4"} <= set(directives)
    assert "#SBATCH --mem=16896M" in directives  # both groups' memory on each node
    assert "srun_args=(--distribution=cyclic --cpu-bind=none)" in script
    assert "export GOMP_SPINCOUNT=50000" in script
    assert "het_args=(--het-group=" in script  # only when Slurm says the job is heterogeneous
    disaggregated = render_script(load_config(None, ["launcher=slurm"]), tmp_path / "run")
    assert disaggregated.count("#SBATCH hetjob") == 1 and "--distribution=cyclic" not in disaggregated


def test_a_colocated_config_takes_its_node_count_from_a_one_component_allocation():
    from rollout_hpc.commands.prepare import colocated_layout
    from rollout_hpc.errors import UserError

    cfg = load_config(None, ["placement=colocated"])
    assert colocated_layout(cfg, {"SLURM_JOB_NUM_NODES": "4", "SLURM_NTASKS_PER_NODE": "2"}) == [
        "generator.nodes=4",
        "trainer.nodes=4",
    ]
    with pytest.raises(UserError, match="--ntasks-per-node=2"):
        colocated_layout(cfg, {"SLURM_JOB_NUM_NODES": "4", "SLURM_NTASKS_PER_NODE": "1"})
    with pytest.raises(UserError, match="heterogeneous"):
        colocated_layout(cfg, {"SLURM_HET_SIZE": "2", "SLURM_JOB_NUM_NODES": "2"})
