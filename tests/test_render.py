"""The job script: slurm/rollout.sbatch (usable as is) and its rendering from a config."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from rollout_hpc.config import UserError, load_config
from rollout_hpc.launch.render import render_base, render_script

REPO = Path(__file__).resolve().parents[1]
BASE = REPO / "slurm" / "rollout.sbatch"


def bash_syntax_ok(script: str, tmp_path: Path) -> None:
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def directives(script: str) -> list[list[str]]:
    """#SBATCH options per het component, as sbatch reads them (up to the first command line)."""
    components: list[list[str]] = [[]]
    for line in script.splitlines():
        if line.strip() and not line.startswith("#"):
            break
        if line.startswith("#SBATCH"):
            option = line.split(None, 1)[1]
            if option == "hetjob":
                components.append([])
            else:
                components[-1].append(option)
    return components


def test_base_template_is_a_valid_script_as_is(tmp_path):
    bash_syntax_ok(BASE.read_text(), tmp_path)
    gen, train = directives(BASE.read_text())
    assert "--nodes=1" in gen and "--nodes=2" in train
    assert {"--requeue", "--open-mode=append"} <= set(gen)
    assert any(o.startswith("--signal=B:USR1@") for o in gen)


def test_base_rendered_without_overrides_equals_its_directives(tmp_path):
    rendered = render_base()
    bash_syntax_ok(rendered, tmp_path)
    assert not any(l.startswith("#%") for l in rendered.splitlines())
    assert directives(rendered) == directives(BASE.read_text())
    # The same program: every line of the file but the template statements survives rendering
    # (Jinja's line statements also swallow the blank lines after them).
    body = [l for l in BASE.read_text().splitlines() if l.strip() and not l.startswith("#%")]
    assert [l for l in rendered.splitlines() if l.strip()] == body


def test_rendered_script_has_both_het_components(tmp_path):
    cfg = load_config(REPO / "configs" / "examples" / "grpo-7b-vllm-deepspeed.yaml")
    script = render_script(cfg, tmp_path / "run")
    bash_syntax_ok(script, tmp_path)
    assert script.count("#SBATCH hetjob") == 1
    gen, train = directives(script)
    assert {
        "--nodes=2",
        "--ntasks-per-node=4",
        "--gpus-per-task=1",
        "--cpus-per-task=8",
        "--mem=480G",
        "--partition=gpu",
        "--account=my-project",
        "--time=1-00:00:00",
    } <= set(gen)
    assert {"--nodes=4", "--ntasks-per-node=8", "--gpus-per-task=1", "--mem=960G", "--partition=gpu"} <= set(train)
    assert {"--signal=B:USR1@600", "--requeue", "--open-mode=append", "--job-name=grpo-7b"} <= set(gen)
    assert f"--output={tmp_path}/run/logs/slurm-%j.out" in gen and f"--error={tmp_path}/run/logs/slurm-%j.err" in gen
    assert "export ROLLOUT_MPI=pmix" in script
    assert "module load cuda/12.4\nmodule load openmpi/4.1" in script
    assert "export NCCL_DEBUG=WARN" in script
    assert f"export ROLLOUT_RUN_DIR={tmp_path}/run" in script


def test_one_job_step_spans_both_groups():
    script = render_script(load_config(None), Path("/runs/x"))
    steps = [l for l in script.splitlines() if l.lstrip().startswith("srun ")]
    # every component of the allocation: 0-1, or 0-2 with a reward group (SLURM_HET_SIZE 3); none in a job of one
    # component (placement colocated)
    assert len(steps) == 1 and steps[0].startswith('srun "${het_args[@]}"')
    assert 'het_args=(--het-group="0-$((SLURM_HET_SIZE - 1))")' in script
    assert '--mpi="$ROLLOUT_MPI"' in steps[0]
    assert "rollout_hpc.runtime.entry --run-dir" in script


def test_signal_trap_and_requeue_hook():
    script = render_script(load_config(None, ["slurm.max_requeues=3"]), Path("/runs/x"))
    assert (
        "on_warning()" in script and "trap 'on_warning USR1' USR1" in script and "trap 'on_warning TERM' TERM" in script
    )
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script
    assert "export ROLLOUT_MAX_REQUEUES=3" in script
    # Open MPI's root switches are decided when the job runs, not when it is rendered.
    assert '[ "$(id -u)" = 0 ]' in script


def test_pyxis_container_goes_on_srun(tmp_path):
    cfg = load_config(None, ["slurm.container={image: 'nvcr.io#nvidia/pytorch:24.07', mounts: [/data:/data, /m:/m]}"])
    script = render_script(cfg, tmp_path)
    bash_syntax_ok(script, tmp_path)
    assert "srun_args=('--container-image=nvcr.io#nvidia/pytorch:24.07' --container-mounts=/data:/data,/m:/m)" in script
    assert "export ROLLOUT_PYTHON=python3" in script  # the container's interpreter, not the submit host's


def test_apptainer_container_prefixes_python(tmp_path):
    cfg = load_config(
        None,
        ["slurm.container={image: /img/r.sif, runtime: apptainer, mounts: [/scratch]}", "generator.gpus_per_task=1"],
    )
    script = render_script(cfg, tmp_path)
    bash_syntax_ok(script, tmp_path)
    assert "exec_prefix=(apptainer exec --nv --bind /scratch /img/r.sif)" in script


def test_extra_lines_env_and_gres(tmp_path):
    cfg = load_config(
        None,
        [
            "slurm.extra_sbatch=[--mail-type=END, --exclusive]",
            "slurm.gpu_request=gres",
            "trainer.gpus_per_task=2",
            "trainer.tasks_per_node=4",
            "slurm.qos=high",
            "slurm.env={MSG: 'it''s $HOME'}",
            "trainer.partition=big",
        ],
    )
    script = render_script(cfg, tmp_path)
    bash_syntax_ok(script, tmp_path)
    gen, train = directives(script)
    assert {"--mail-type=END", "--exclusive", "--qos=high"} <= set(gen)
    assert "--gres=gpu:8" in train and "--partition=big" in train and "--qos=high" in train
    assert "export MSG='it'\"'\"'s $HOME'" in script  # quoted: no expansion, no injection


def test_run_dir_with_space_is_refused(tmp_path):
    with pytest.raises(UserError, match="space"):
        render_script(load_config(None), tmp_path / "my run")


def test_rendered_script_keeps_base_body(tmp_path):
    """The rendered script runs the base template's body: only the blocks differ."""
    script = render_script(load_config(REPO / "configs" / "hello.yaml"), tmp_path)
    for marker in ("wait_step()", "requeue_if_asked()", "rollout_hpc prepare", 'exit "$rc"'):
        assert marker in script
    assert re.search(r"^#!/bin/bash\n", script)


@pytest.mark.slurm  # scontrol expands the node lists with the cluster's slurm.conf
@pytest.mark.parametrize(("gen_nodes", "train_nodes", "shared"), [("n2", "n2", "n2"), ("n[1-2]", "n[2-3]", "n2")])
def test_the_job_script_refuses_het_groups_placed_on_one_node(slurm_cluster, tmp_path, gen_nodes, train_nodes, shared):
    """After requeueing a job around a failed batch host, Slurm placed both het groups on the node left (tools/chaos.py
    node-fail); srun cannot start one step across them and MPI start-up hung. The script (run as Slurm would, with the
    allocation's variables) ends at once, naming the node and the fix, before any srun."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.resolved.yaml").write_text("{}\n")  # a run directory submit made: no prepare step
    script = tmp_path / "job.sbatch"
    script.write_text(render_script(load_config(None), run_dir))
    env = {
        "PATH": "/usr/bin:/bin",
        "SLURM_CONF": str(slurm_cluster.conf),
        "ROLLOUT_RUN_DIR": str(run_dir),
        "SLURM_JOB_ID": "41",
        "SLURM_HET_SIZE": "2",
        "SLURM_JOB_NODELIST_HET_GROUP_0": gen_nodes,
        "SLURM_JOB_NODELIST_HET_GROUP_1": train_nodes,
    }
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"placed two het groups of job 41 on the same node(s): {shared} " in done.stderr, done.stderr
    assert f"rollout-hpc resume {run_dir}" in done.stderr and "--exclusive" in done.stderr
    assert "srun" not in done.stderr and "job step exited" not in done.stderr
