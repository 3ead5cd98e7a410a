"""SFT warm-up in the same run as RL (warmup.sft_steps): interrupted during warm-up and again during RL, resumed,
it ends with the weights of an uninterrupted run, every RL sample logged once and every SFT step's metrics once.
Real runs under mpirun (`rollout-hpc submit/resume --local`)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
from test_resume_local import SLOW_REWARD, cli, weights_digest

from rollout_hpc.store.trajlog import TrajectoryReader

WARMUP, STEPS, PROMPTS, GROUP = 30, 6, 2, 4


def write_config(directory: Path, name: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "slow_reward.py").write_text(SLOW_REWARD.format(sleep=0.1))
    path = directory / f"{name}.yaml"
    path.write_text(f"""
run: {{name: {name}, seed: 0}}
launcher: local
task: {{name: arithmetic, params: {{max_operand: 4, ops: "+"}}, reward: "{directory / "slow_reward.py"}:reward"}}
algorithm: {{steps: {STEPS}, prompts_per_step: {PROMPTS}, group_size: {GROUP}, max_new_tokens: 2}}
warmup: {{sft_steps: {WARMUP}, batch_size: 64}}
eval: {{every_steps: 0, at_start: true}}
checkpoint: {{every_steps: 3, keep_last: 3}}
""")
    return path


def run_until(args, cwd: Path, marker: str) -> subprocess.Popen:
    """Start a foreground run and read its output until a line starts with `marker` (kept in proc.seen)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout_hpc", *map(str, args)],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(marker):
            proc.seen = "".join(seen)
            return proc
    raise AssertionError(f"the run ended before '{marker}':\n{''.join(seen)[-3000:]}")


def stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 75, out[-3000:]
    return proc.seen + out


def test_warmup_then_rl_interrupted_in_both_phases_matches_an_uninterrupted_run(tmp_path):
    ref = tmp_path / "ref"
    done = cli("submit", write_config(tmp_path, "ref"), "--run-dir", ref, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "sft step 1/36" in done.stdout and "step 36/36" in done.stdout

    run_dir = tmp_path / "cut"
    config = write_config(tmp_path, "cut")
    stop(run_until(("submit", config, "--run-dir", run_dir), tmp_path, "sft step 4/"))
    stopped = json.loads(cli("ckpt", run_dir, "--json", cwd=tmp_path).stdout)["step"]
    assert stopped < WARMUP  # stopped during the warm-up ...
    out = stop(run_until(("resume", run_dir), tmp_path, f"step {WARMUP + 2}/"))
    assert "resuming from" in out and f"sft step {stopped + 1}/" in out  # ... resumed in warm-up, stopped in RL
    stopped = json.loads(cli("ckpt", run_dir, "--json", cwd=tmp_path).stdout)["step"]
    assert WARMUP < stopped < WARMUP + STEPS
    done = cli("resume", run_dir, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    assert weights_digest(run_dir) == weights_digest(ref)
    for run in (run_dir, ref):
        with TrajectoryReader(run) as r:
            rows = list(zip(*(r.column(n).tolist() for n in ("step", "prompt_id", "sample_idx"))))
            metrics = r.metrics()
        # RL steps train prompts 0.. of their own stream, each sample once, at global steps WARMUP..
        assert sorted(rows) == [(WARMUP + p // PROMPTS, p, k) for p in range(STEPS * PROMPTS) for k in range(GROUP)]
        assert metrics["step"].tolist() == list(range(WARMUP + STEPS))  # one metrics row per step, SFT ones too
        sft_loss = metrics["sft_loss"][:WARMUP]
        assert np.all(np.isfinite(sft_loss)) and sft_loss[-1] < sft_loss[0]  # the warm-up learns
        summary = json.loads(cli("analyze", run, "--json", cwd=tmp_path).stdout)
        ev = summary["eval"]
        assert ev["step"] == [0, WARMUP, WARMUP + STEPS]  # before SFT, before the first RL update, at the end
        assert summary["steps"] == STEPS and summary["sft"]["steps"] == WARMUP
        assert summary["sft"]["loss_last"] < summary["sft"]["loss_first"]


def test_an_sft_run_then_rl_from_it_with_model_init_from(tmp_path):
    """run.program sft trains the warm-up only; model.init_from starts another run from its newest checkpoint. With a
    learning rate too small to move a float32 weight, the RL run's final weights are the SFT run's, bit for bit."""
    config = write_config(tmp_path, "pair")
    sft_run, rl_run = tmp_path / "sft", tmp_path / "rl"
    done = cli(
        "submit", config, "--run-dir", sft_run, "--set", "run.program=sft", "--set", "warmup.sft_steps=6", cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "sft step 6/6" in done.stdout and "\nstep " not in done.stdout  # no RL step in an SFT run
    done = cli(
        "submit",
        config,
        "--run-dir",
        rl_run,
        "--set",
        "warmup.sft_steps=0",
        "--set",
        "algorithm.steps=1",
        "--set",
        "algorithm.lr=1e-30",
        "--set",
        f"model.init_from={sft_run}",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert weights_digest(rl_run) == weights_digest(sft_run)
    bad = cli("validate", config, "--set", f"model.init_from={tmp_path / 'nope'}", cwd=tmp_path)
    assert bad.returncode == 2 and "model.init_from" in bad.stderr and "nope" in bad.stderr
