"""The hang watchdog (issue 18, item 10): a generator wedged in a custom task's prompt source stops making progress;
after run.hang_timeout the job writes every rank's Python stacks into its logs/, checkpoints what the trainer has,
and ends with a message naming the rank, its last step and where the stacks are. A real run under mpirun."""

from __future__ import annotations

import subprocess
import sys

from test_no_hangs import submit, write_config
from test_resume_local import cli


def test_a_wedged_generator_ends_the_job_with_every_ranks_stacks(tmp_path):
    config = write_config(
        tmp_path,
        "hung",
        task=f'{{name: "{tmp_path / "stuck.py"}:Stuck", params: {{hang_at: 4}}}}',
        steps=6,
        run=", hang_timeout: 5",
        extra="trainer: {nodes: 1, tasks_per_node: 2}",  # the trainers agree to checkpoint before the job ends
    )
    done = submit(config, tmp_path)
    out = done.stdout + done.stderr
    run, logs = tmp_path / "run", tmp_path / "run" / "logs"
    assert done.returncode == 3, out[-3000:]  # watchdog.EXIT_HANG
    assert "rollout-hpc: hang: rank 0 (generator, node gen0) made no progress for 5s after step 2" in out, out[-3000:]
    assert f"its main thread is in {tmp_path / 'stuck.py'}:" in out and "in __getitem__" in out
    assert f"Every rank's Python stacks are in {logs}/stacks-rank*.txt" in out
    assert "raise run.hang_timeout" in out
    assert "saved the checkpoint after step 2 before ending the hung job" in out
    assert f"`rollout-hpc resume {run}` continues it from its newest checkpoint (step-00000002.h5)" in out

    generator = (logs / "stacks-rank0.txt").read_text()
    assert generator.startswith("=== rank 0 (generator, node gen0") and 'stuck.py", line' in generator
    assert "in __getitem__" in generator and "in run_generator" in generator  # the main thread's whole stack
    for rank in (1, 2):
        trainer = (logs / f"stacks-rank{rank}.txt").read_text()
        assert trainer.startswith(f"=== rank {rank} (trainer, node train0")
        # asked by the hung rank, or (told of the hang by the other trainer first) written before the job ends
        told = ("stacks asked for by rank 0", "the trainers end the job after a hang: rank 0 (generator, node gen0)")
        assert any(why in trainer for why in told), trainer[:400]
        # waiting for the step's experience, or (told of the hang by the other trainer first) already checkpointing
        assert "in run_trainer" in trainer and ("in _wait_for" in trainer or "in _stop_waiting" in trainer)
    assert "stop requested" not in out
    assert '"step": 2' in cli("ckpt", run, "--json", cwd=tmp_path).stdout


def test_hang_timeout_is_checked_and_zero_disables_it(tmp_path):
    config = write_config(tmp_path, "bad", task="{name: arithmetic}", steps=1, run=", hang_timeout: -5")
    done = subprocess.run(
        [sys.executable, "-m", "rollout_hpc", "validate", str(config)], capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 2 and "run.hang_timeout" in done.stdout + done.stderr, done.stdout + done.stderr
    config.write_text(config.read_text().replace("hang_timeout: -5", "hang_timeout: 0"))
    done = subprocess.run(
        [sys.executable, "-m", "rollout_hpc", "validate", str(config)], capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout + done.stderr
