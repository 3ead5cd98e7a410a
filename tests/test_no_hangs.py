"""No silent hangs (issue 18, item 1), with the default exchange.max_staleness 0, in real runs (`rollout-hpc submit
--local`: mpirun, one generator and one trainer rank): a reward that raises on every sample after its first 50
calls ends the job naming the plugin; a reward that never returns costs each sample a timeout, never the run; an
exception in a background thread of a generator rank (weight sync) or of a trainer rank (exchange receiver) ends
the job with the error; one SIGTERM ends a run whose generator is wedged in user code, with a checkpoint.
Threads fail on demand through ROLLOUT_INJECT_FAULT (rollout_hpc/exchange/faults.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_resume_local import Interruptible, cli

from rollout_hpc.store.trajlog import TrajectoryReader

REWARDS = """
import time
from rollout_hpc.envs.arithmetic import ArithmeticTask

_task = ArithmeticTask(max_operand=4, ops="+")
_calls = 0

def fails_after_50(prompt, text):
    global _calls
    _calls += 1
    if _calls > 50:
        raise ConnectionError("the reward server went away")
    return _task.reward(prompt, text)

def never_returns(prompt, text):
    while True:
        time.sleep(60)

def fine(prompt, text):
    return _task.reward(prompt, text)
"""

# A custom task whose prompt source wedges the generator from prompt HANG_AT on (in the rank only: its reward
# workers build the same task and must not hang).
STUCK_TASK = """
import sys, time
from rollout_hpc.envs.arithmetic import ArithmeticTask

class Stuck:
    def __init__(self, hang_at):
        self.inner, self.hang_at = ArithmeticTask(max_operand=4, ops="+"), hang_at

    def prompts(self, seed):
        return StuckPrompts(self.inner.prompts(seed), self.hang_at)

    def reward(self, item, text):
        return self.inner.reward(item, text)

class StuckPrompts:
    def __init__(self, inner, hang_at):
        self.inner, self.hang_at = inner, hang_at

    def __getitem__(self, i):
        if i >= self.hang_at and "mpi4py" in sys.modules:
            while True:
                time.sleep(1)
        return self.inner[i]
"""


def write_config(
    tmp: Path, name: str, *, task: str, steps: int, prompts: int = 2, run: str = "", extra: str = ""
) -> Path:
    (tmp / "rewards.py").write_text(REWARDS)
    (tmp / "stuck.py").write_text(STUCK_TASK)
    path = tmp / f"{name}.yaml"
    path.write_text(f"""
run: {{name: {name}, seed: 0{run}}}
launcher: local
task: {task}
algorithm: {{steps: {steps}, prompts_per_step: {prompts}, group_size: 4, max_new_tokens: 1}}
checkpoint: {{every_steps: 50, keep_last: 2}}
{extra}""")
    return path


def reward_task(tmp: Path, fn: str, timeout: float = 10.0) -> str:
    return f'{{name: arithmetic, params: {{max_operand: 4, ops: "+"}}, reward: "{tmp / "rewards.py"}:{fn}", reward_timeout: {timeout}}}'


def submit(config: Path, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rollout_hpc", "submit", str(config), "--local", "--run-dir", str(cwd / "run")],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **(env or {})},
    )


def test_a_reward_that_starts_raising_ends_the_run_naming_it(tmp_path):
    """50 good calls per reward worker (about 12 steps of 8 samples), then every call raises: the run trains while
    the reward works, then ends with exit 2 and the plugin's name once 64 samples in a row raised."""
    config = write_config(tmp_path, "raising", task=reward_task(tmp_path, "fails_after_50"), steps=200)
    done = submit(config, tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out[-3000:]
    assert "step 10/200" in out  # it trained while the reward worked
    assert f"task.reward '{tmp_path / 'rewards.py'}:fails_after_50' raised on the last 64 samples in a row" in out
    assert "ConnectionError: the reward server went away" in out and "fix it and resume" in out


def test_a_reward_that_never_returns_costs_samples_not_the_run(tmp_path):
    config = write_config(
        tmp_path, "sleepy", task=reward_task(tmp_path, "never_returns", timeout=0.5), steps=1, prompts=1
    )
    done = submit(config, tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "step 1/1" in done.stdout and "reward errors 4" in done.stdout
    with TrajectoryReader(tmp_path / "run") as r:
        assert r.column("reward_status").tolist() == [2] * 4  # REWARD_TIMEOUT, every sample logged


@pytest.mark.parametrize(
    "point, role",
    [("weight-sync@3", "generator rank's weight receiver"), ("receiver@3", "trainer node's exchange receiver")],
)
def test_an_exception_in_a_background_thread_ends_the_job(tmp_path, point, role):
    config = write_config(tmp_path, "thread", task=reward_task(tmp_path, "fine"), steps=30)
    done = submit(config, tmp_path, env={"ROLLOUT_INJECT_FAULT": point})
    out = done.stdout + done.stderr
    assert done.returncode not in (0, 75), f"{role}: {out[-3000:]}"
    assert f"injected fault at '{point.split('@')[0]}' (pass 3" in out, f"{role}: {out[-3000:]}"
    assert "step 30/30" not in out
    assert "the run ended early" in out  # the launcher's closing line: it did not hang


def test_one_sigterm_ends_a_run_whose_generator_is_wedged(tmp_path):
    """The generator hangs inside the task's dataset at step 2 and never comes back; the hang watchdog is off. One
    SIGTERM (what scancel and Slurm's time limit send) checkpoints what the trainer has and ends the job (exit 75)."""
    config = write_config(
        tmp_path,
        "wedged",
        task=f'{{name: "{tmp_path / "stuck.py"}:Stuck", params: {{hang_at: 4}}}}',
        steps=6,
        run=", hang_timeout: 0",
    )
    run = Interruptible("submit", config, "--local", "--run-dir", tmp_path / "run", cwd=tmp_path)
    run.wait_for_step(2)
    run.proc.send_signal(signal.SIGTERM)
    code = run.finish(timeout=60)
    assert code == 75, run.output[-3000:]
    assert "stop requested: saved" in run.output and "step-00000002.h5 after step 2" in run.output
    assert "a generator did not finish its step within 10s; ending the job" in run.output
    assert f"continue it with `rollout-hpc resume {tmp_path / 'run'}`" in run.output
    ckpt = cli("ckpt", tmp_path / "run", "--json", cwd=tmp_path)
    assert '"step": 2' in ckpt.stdout, ckpt.stdout + ckpt.stderr
