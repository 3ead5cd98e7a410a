"""The local launcher's answers to a user stopping a run: Ctrl-C checkpoints and stops like Slurm's warning (exit 75,
a resume hint; a second Ctrl-C would end it at once), and a rank killed with -9 ends the run with a message that
says `resume` continues it from the newest checkpoint. Real runs under mpirun."""

from __future__ import annotations

import json
import os
import signal

from test_loop import _rank_pid
from test_resume_local import Interruptible, write_run_config


def test_ctrl_c_checkpoints_and_a_killed_rank_says_how_to_continue(tmp_path):
    run_dir = tmp_path / "run"
    config = write_run_config(tmp_path, "run", steps=40)
    run = Interruptible("submit", config, "--local", "--run-dir", run_dir, cwd=tmp_path)
    run.wait_for_step(2)
    run.proc.send_signal(signal.SIGINT)  # what Ctrl-C in the terminal sends the launcher
    assert run.finish() == 75, run.output[-3000:]
    assert "stopping after the current step" in run.output and "stop requested" in run.output
    assert f"continue it with `rollout-hpc resume {run_dir}`" in run.output

    run = Interruptible("resume", run_dir, "--local", cwd=tmp_path)
    run.wait_for_step(8)
    mpirun_pid = json.loads((run_dir / "manifest.json").read_text())["local_runs"][-1]["pid"]
    os.kill(_rank_pid(mpirun_pid, "train0"), signal.SIGKILL)
    code = run.finish()
    assert code not in (0, 75), run.output[-3000:]
    assert f"`rollout-hpc resume {run_dir}` continues it from its newest checkpoint (step-" in run.output
