"""`rollout-hpc resume` with the local launcher: a run interrupted several ways, at random steps, and resumed
each time ends exactly where an uninterrupted run ends (same weights digest), with every prompt sample trained
on and logged exactly once. Real runs: `rollout-hpc submit --local` / `resume --local` (mpirun, 2 ranks)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_loop import _rank_pid

from rollout_hpc.store.trajlog import TrajectoryReader

STEPS, PROMPTS, GROUP = 14, 2, 4

# The arithmetic task's reward, a little slow (0.4 s a step with 2 reward threads), so that an interruption
# sent after step k lands within a step or two of k.
SLOW_REWARD = """
import time
from rollout_hpc.envs.arithmetic import ArithmeticTask
_task = ArithmeticTask(max_operand=4, ops="+")
def reward(prompt, text):
    time.sleep({sleep})
    return _task.reward(prompt, text)
"""


def write_run_config(
    directory: Path, name: str, steps: int = STEPS, sleep: float = 0.1, launcher: str = "local", extra: str = ""
) -> Path:
    """A tiny run: 1 generator + 1 trainer rank, `steps` steps of PROMPTS x GROUP samples, checkpoints every 3."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "slow_reward.py").write_text(SLOW_REWARD.format(sleep=sleep))
    path = directory / f"{name}.yaml"
    path.write_text(f"""
run: {{name: {name}, seed: 0}}
launcher: {launcher}
task: {{name: arithmetic, params: {{max_operand: 4, ops: "+"}}, reward: "{directory / "slow_reward.py"}:reward"}}
algorithm: {{steps: {steps}, prompts_per_step: {PROMPTS}, group_size: {GROUP}, max_new_tokens: 1}}
checkpoint: {{every_steps: 3, keep_last: 3}}
{extra}""")
    return path


def cli(*args, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rollout_hpc", *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def weights_digest(run_dir: Path) -> str:
    """The newest valid checkpoint's weights SHA-256, as `rollout-hpc ckpt --json` computes it (in this process: a
    CLI start costs seconds of imports, and the suite compares digests some twenty times)."""
    from rollout_hpc.store import checkpoint

    saved = checkpoint.list_checkpoints(run_dir)
    found = checkpoint.load_latest_valid(run_dir, shard=0 if saved and saved[-1].sharded else None)
    assert found is not None, f"no valid checkpoint in {run_dir}"
    return checkpoint.weights_digest(found[1])


def logged_uids(run_dir: Path) -> list[tuple[int, int, int]]:
    """(step, prompt_id, sample_idx) of every row of trajectories.h5."""
    with TrajectoryReader(run_dir) as r:
        return list(zip(*(r.column(n).tolist() for n in ("step", "prompt_id", "sample_idx"))))


def assert_exactly_once(run_dir: Path, steps: int = STEPS) -> None:
    rows = logged_uids(run_dir)
    expected = [(p // PROMPTS, p, k) for p in range(steps * PROMPTS) for k in range(GROUP)]
    assert len(rows) == len(set(rows)), "a sample is logged twice"
    assert sorted(rows) == expected  # each sample of the stream once, trained at the step its prompt belongs to


class Interruptible:
    """A foreground `rollout-hpc submit/resume --local` whose output is read until a given step has been printed."""

    def __init__(self, *args, cwd: Path):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rollout_hpc", *map(str, args)],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []

    def wait_for_step(self, step: int) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("step ") and int(line.split()[1].split("/")[0]) >= step:
                return
        raise AssertionError(f"the run ended before step {step}:\n{self.output}")

    def finish(self, timeout: float = 180) -> int:
        rest, _ = self.proc.communicate(timeout=timeout)
        self.lines.append(rest)
        return self.proc.returncode

    @property
    def output(self) -> str:
        return "".join(self.lines)


def stop_and_resume(config: Path, run_dir: Path, at_step: int, cwd: Path, steps: int = STEPS) -> int:
    """`submit --local` of `config`, SIGUSR1 once step `at_step` is printed (checkpoint, exit 75), then `resume
    --local` to the end; returns the step the stop checkpointed."""
    run = Interruptible("submit", config, "--local", "--run-dir", run_dir, cwd=cwd)
    run.wait_for_step(at_step)
    run.proc.send_signal(signal.SIGUSR1)
    assert run.finish() == 75, run.output[-3000:]
    stopped = json.loads(cli("ckpt", run_dir, "--json", cwd=cwd).stdout)["step"]
    assert at_step <= stopped < steps
    done = cli("resume", run_dir, "--local", cwd=cwd)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return stopped


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The same run, never interrupted."""
    tmp = tmp_path_factory.mktemp("reference")
    config = write_run_config(tmp, "ref", sleep=0.0)  # the reward's pause only paces interruptions
    done = cli("submit", config, "--local", "--run-dir", tmp / "ref", cwd=tmp)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert_exactly_once(tmp / "ref")
    return tmp / "ref"


def test_interrupted_three_ways_then_resumed_matches_an_uninterrupted_run(tmp_path, reference):
    """SIGUSR1, then SIGTERM, to the foreground launcher at random steps (each: checkpoint, exit 75); then kill -9 of
    the trainer rank between the log's periodic flushes, with the newest checkpoint truncated afterwards."""
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    run_dir = tmp_path / "cut"
    config = write_run_config(tmp_path, "cut")
    start_args = ("submit", config, "--local", "--run-dir", run_dir)
    done_steps, expect = 0, None
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        run = Interruptible(*start_args, cwd=tmp_path)
        at = done_steps + rng.randint(1, 2)  # the stop comes at the next step boundary: leave room for the rest
        run.wait_for_step(at)
        assert expect is None or expect in run.output  # resume said where it continues from
        run.proc.send_signal(sig)
        code = run.finish()
        assert code == 75, f"seed {seed}, {sig.name} after step {at}:\n{run.output[-3000:]}"
        assert "stop requested" in run.output and "continue it with `rollout-hpc resume" in run.output
        stopped = json.loads(cli("ckpt", run_dir, "--json", cwd=tmp_path).stdout)["step"]
        assert at <= stopped < STEPS
        start_args = ("resume", run_dir, "--local")
        expect = f"resuming from step-{stopped:08d}.h5: step {stopped} of {STEPS}, policy version {stopped}"
        done_steps = stopped

    # The third interruption gives no warning: the trainer rank is SIGKILLed right after a periodic checkpoint
    # (every 3 steps) that the log's own flush (every 10) has not reached: the checkpoint must cover its log.
    run = Interruptible(*start_args, cwd=tmp_path)
    at = next(s for s in range(done_steps + 2, STEPS) if (s - 1) % 3 == 0)  # right after checkpoint s - 1
    run.wait_for_step(at)
    assert expect in run.output
    mpirun_pid = json.loads((run_dir / "manifest.json").read_text())["local_runs"][-1]["pid"]
    os.kill(_rank_pid(mpirun_pid, "train0"), signal.SIGKILL)
    assert run.finish() not in (0, 75), run.output[-3000:]
    # The launcher says how to continue (a killed rank gives mpirun's bare exit code otherwise).
    assert f"`rollout-hpc resume {run_dir}` continues it from its newest checkpoint (step-" in run.output
    checkpoints = sorted((run_dir / "checkpoints").glob("step-*.h5"))
    newest, previous = checkpoints[-1], checkpoints[-2]
    with open(newest, "r+b") as f:  # torn by a failing disk after it was written
        f.truncate(newest.stat().st_size // 2)

    done = cli("resume", run_dir, "--local", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    damaged = [line for line in done.stderr.splitlines() if newest.name in line]
    assert len(damaged) == 1 and "damaged" in damaged[0], done.stderr  # one clear line
    assert f"resuming from {previous.name}" in done.stdout
    assert (newest.parent / f"{newest.name}.damaged").exists()
    assert weights_digest(run_dir) == weights_digest(reference), f"seed {seed}"
    assert_exactly_once(run_dir)
    assert set(logged_uids(run_dir)) == set(logged_uids(reference))
    resumes = json.loads((run_dir / "manifest.json").read_text())["resumes"]
    assert [r["from_step"] for r in resumes][-1] == int(previous.name[5:13]) and len(resumes) == 3


def test_refusals_and_force(tmp_path, reference):
    # Not a run directory.
    done = cli("resume", tmp_path, "--local", cwd=tmp_path)
    assert done.returncode == 2 and "manifest.json" in done.stderr and "Traceback" not in done.stderr

    run_dir = tmp_path / "copy"
    shutil.copytree(reference, run_dir)
    # A finished run has nothing to resume.
    done = cli("resume", run_dir, "--local", cwd=tmp_path)
    assert done.returncode == 0 and f"already did all {STEPS} steps" in done.stdout, done.stdout + done.stderr

    # A changed model or algorithm is refused, naming what differs; nothing is changed in the run directory.
    resolved = (run_dir / "config.resolved.yaml").read_text()
    done = cli(
        "resume",
        run_dir,
        "--local",
        "--set",
        "model.hidden_size=32",
        "--set",
        f"algorithm.steps={STEPS + 2}",
        cwd=tmp_path,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "model.hidden_size: 64 -> 32" in done.stderr and "--force" in done.stderr, done.stderr
    assert (run_dir / "config.resolved.yaml").read_text() == resolved

    # --force names the change, and the ranks accept the checkpoint too: the run continues to the new end.
    done = cli(
        "resume",
        run_dir,
        "--local",
        "--force",
        "--set",
        "algorithm.lr=0.002",
        "--set",
        f"algorithm.steps={STEPS + 2}",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "--force" in done.stdout and "algorithm.lr: 0.001 -> 0.002" in done.stdout
    assert f"resuming from step-{STEPS:08d}.h5: step {STEPS} of {STEPS + 2}" in done.stdout
    assert json.loads(cli("ckpt", run_dir, "--json", cwd=tmp_path).stdout)["step"] == STEPS + 2
    assert_exactly_once(run_dir, STEPS + 2)
