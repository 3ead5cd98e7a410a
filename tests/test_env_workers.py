"""Environment worker processes (envs.workers, envs/process_envs.py) and the environment group's layout
(envs.nodes): the same episodes as threads of the rank; an environment that segfaults, exits, hangs holding the
interpreter lock or raises ends its own episode with a counted error while the rank and the other episodes go on;
a new worker takes the next episodes; the group is a het component of its own in the script, the local launcher and
plain sbatch. The environment group through the real loop: tests/test_agentic_loop.py."""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import pytest
from test_agentic import generator, model, records  # noqa: F401 - model is a fixture

from rollout_hpc.config import TaskSection, load_config
from rollout_hpc.envs import load_task
from rollout_hpc.envs.process_envs import ProcessEnvs
from rollout_hpc.envs.registry import check_task
from rollout_hpc.errors import TaskError, UserError
from rollout_hpc.trajectory import EPISODE_ERROR, EPISODE_OK, EPISODE_TIMEOUT

# A countdown environment (episode of item i lasts i % 4 + 1 turns) whose items in MODES misbehave at their second
# step; its info carries a function, which cannot cross a process boundary (only the keys the loop reads do).
PLUGIN = """
import ctypes, os, signal, time

MODES = {modes}

class Env:
    max_turns = 6

    def reset(self, item):
        self.item, self.left, self.turn = int(item), int(item) % 4 + 1, 0
        return f"{{item}}="

    def step(self, text):
        self.turn += 1
        how = MODES.get(self.item) if self.turn >= 2 else None
        if how == "segfault":
            os.kill(os.getpid(), signal.SIGSEGV)
        if how == "exit":
            os._exit(3)
        if how == "gil":
            ctypes.PyDLL(None).sleep(60)  # hangs holding the interpreter lock: no thread deadline can end it
        if how == "raise":
            raise RuntimeError("the simulator crashed")
        self.left -= 1
        return f"{{text}}!", 0.5, self.left == 0, {{"success": self.left == 0, "callback": lambda: None}}

class Task:
    def prompts(self, seed):
        return [str(i) for i in range(16)]

    def make_env(self):
        return Env()
"""


def plugin_task(tmp_path: Path, modes: dict[int, str]) -> TaskSection:
    path = tmp_path / "countdown_env.py"
    path.write_text(PLUGIN.format(modes=modes))
    return TaskSection(name=f"{path}:Task")


def test_worker_processes_play_the_episodes_threads_play(model, tmp_path):  # noqa: F811
    task_cfg = plugin_task(tmp_path, {})
    task = load_task(task_cfg)
    threads = generator(model, task, parallel=5).rollout(task.prompts(0), list(range(8)), 2, 0, 0)
    gen = generator(model, task, parallel=5)
    gen.env_host = host = ProcessEnvs(task_cfg, None, workers=3, timeout=10)
    try:
        procs = gen.rollout(task.prompts(0), list(range(8)), 2, 0, 0)
        again = gen.rollout(task.prompts(0), list(range(8)), 2, 0, 0)  # the same workers serve the next step
        pids = [w.proc.pid for w in host.workers if w is not None]
    finally:
        host.close()
    assert len(pids) == 3 and host.deaths == 0
    assert set(threads.fixed["episode_status"]) == {EPISODE_OK}
    for other in (procs, again):
        for a, b in zip(records(threads), records(other)):
            np.testing.assert_allclose(a.pop("logprobs"), b.pop("logprobs"), atol=1e-5)
            assert a == b


def test_an_environment_process_that_dies_or_hangs_ends_its_episodes_not_the_rank(model, tmp_path, capsys):  # noqa: F811
    modes = {1: "segfault", 6: "exit", 7: "gil", 10: "raise"}
    task_cfg = plugin_task(tmp_path, modes)
    task = load_task(task_cfg)
    # as many workers as live episodes: each episode's environment has a worker of its own
    gen = generator(model, task, parallel=4, step_timeout=1.0)
    gen.env_host = host = ProcessEnvs(task_cfg, None, workers=4, timeout=1.0)
    try:
        t0 = time.monotonic()
        batch = gen.rollout(task.prompts(0), list(range(12)), 1, 0, 0)
        took = time.monotonic() - t0
    finally:
        host.close()
    f = batch.fixed
    status = dict(zip(f["prompt_id"].tolist(), f["episode_status"].tolist()))
    assert status == {
        i: {"gil": EPISODE_TIMEOUT}.get(modes.get(i, ""), EPISODE_ERROR if i in modes else EPISODE_OK)
        for i in range(12)
    }
    bad = f["episode_status"] != EPISODE_OK
    assert (f["reward"][bad] == 0).all() and (f["n_turns"][bad] == 2).all()
    for i in np.flatnonzero(bad):  # counted, never trained on
        assert batch.record(i)["loss_mask"].sum() == 0
    assert (f["success"][~bad]).all()  # the rest played to the end, on new workers where theirs had died
    assert host.deaths == 3 and took < 30  # segfault, exit, the GIL hang (killed after 1 + 1 s); raise: caught inside
    err = capsys.readouterr().err
    assert re.search(r"environment of prompt 1 sample 0, turn 2: .*worker process died \(exit code -11, SIGSEGV\)", err)
    assert re.search(r"prompt 6 sample 0, turn 2: .*worker process died \(exit code 3\)", err)
    assert re.search(
        r"prompt 7 sample 0, turn 2: .*did not answer within task.env.step_timeout=1s \+ 1s \(killed\)", err
    )
    assert re.search(r"prompt 10 sample 0, turn 2: .*raised RuntimeError: the simulator crashed", err)


def test_a_task_the_worker_cannot_build_ends_the_run_with_its_message(model, tmp_path):  # noqa: F811
    task_cfg = plugin_task(tmp_path, {})
    task = load_task(task_cfg)
    (tmp_path / "countdown_env.py").write_text("raise ImportError('no simulator on this node')\n")
    gen = generator(model, task)
    gen.env_host = host = ProcessEnvs(task_cfg, None, workers=1, timeout=5)
    with pytest.raises(TaskError, match="worker process could not build the task: .*no simulator on this node"):
        gen.rollout(task.prompts(0), [0], 1, 0, 0)
    host.close()


def test_the_environment_group_is_a_het_component_of_its_own(tmp_path):
    from rollout_hpc.commands.prepare import allocation_layout, extra_components
    from rollout_hpc.launch.local import mpirun_command
    from rollout_hpc.launch.render import render_script

    sets = ["task.name=sokoban", "envs.nodes=2", "envs.tasks_per_node=4", "envs.workers=3", "envs.cpus_per_task=8"]
    sets += ["generator.nodes=2", "generator.tasks_per_node=4"]
    cfg = load_config(None, [*sets, "envs.partition=cpu"])
    assert cfg.env_group is not None and cfg.env_group.ranks == 8
    assert cfg.world_size == 8 + 1 + 8
    script = render_script(cfg, tmp_path / "run")
    assert script.count("#SBATCH hetjob") == 2 and "# het component 2: env nodes" in script
    env_lines = script.split("# het component 2: env nodes")[1]
    assert "#SBATCH --nodes=2" in env_lines and "#SBATCH --ntasks-per-node=4" in env_lines
    assert "#SBATCH --cpus-per-task=8" in env_lines and "#SBATCH --partition=cpu" in env_lines
    assert "gpus" not in env_lines
    nodes = [w.split("=", 1)[1] for w in mpirun_command(cfg, tmp_path / "run") if w.startswith("ROLLOUT_NODE=")]
    assert nodes == ["gen0", "gen1", "train0", "env0", "env1"]
    env = {"SLURM_HET_SIZE": "3"} | {
        f"SLURM_{k}_HET_GROUP_{i}": v
        for i, (n, t) in enumerate([("1", "1"), ("1", "2"), ("3", "5(x3)")])
        for k, v in (("JOB_NUM_NODES", n), ("TASKS_PER_NODE", t))
    }
    assert allocation_layout(env, extra_components(cfg))[-2:] == ["envs.nodes=3", "envs.tasks_per_node=5"]
    with pytest.raises(UserError, match=r"3 components .*set envs.nodes > 0 to 0"):
        allocation_layout(dict(env, SLURM_HET_SIZE="2"), extra_components(cfg))
    # with a reward group as well: generators, trainers, reward ranks, environment ranks, in that order
    both = load_config(None, [*sets, f"rewards.models=[{{name: j, path: {tmp_path}, kind: judge, nodes: 1}}]"])
    assert [role for role, _, _ in both.het_groups] == ["generator", "trainer", "reward", "env"]
    assert "# het component 3: env nodes" in render_script(both, tmp_path / "run2")


def test_more_environment_ranks_than_generator_ranks_is_refused():
    with pytest.raises(UserError, match="3 environment ranks .* for 2 generator rank.*envs.workers"):
        load_config(None, ["envs.nodes=3", "generator.nodes=2"])


def test_envs_on_a_single_turn_task_is_refused():
    with pytest.raises(TaskError, match="envs places a multi-turn task's environments.*single-turn"):
        check_task(load_config(None, ["envs.workers=2"]))
    check_task(load_config(None, ["task.name=sokoban", "envs.workers=2"]))
