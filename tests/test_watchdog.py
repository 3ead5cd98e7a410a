"""The hang watchdog (issue 18, item 10): a generator wedged in a custom task's prompt source stops making progress;
after run.hang_timeout the job writes every rank's Python stacks into its logs/, checkpoints what the trainer has,
and ends with a message naming the rank, its last step and where the stacks are. A real run under mpirun."""

from __future__ import annotations

import subprocess
import sys
import time

from mpi_progs.launch import mpirun, node_blocks
from mpi_progs.launch import write_config as write_run_dir
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


def test_a_rank_whose_peer_never_joins_mpi_ends_after_hang_timeout(tmp_path):
    """MPI start-up waits for every rank in C, holding the GIL: a peer that never starts (a het step srun could not
    launch on one node) must not hold the others until the time limit. Here the trainer's process never calls
    MPI_Init; with run.hang_timeout 4 the generator prints where it waits and exits 1, and mpirun ends the job."""
    cfg = write_run_dir(tmp_path / "run", ["run.program=hello", "run.hang_timeout=4"])
    blocks = node_blocks(cfg, ["-m", "rollout_hpc.runtime.entry", "--run-dir", str(tmp_path / "run")])
    blocks[1] = (1, "train0", ["-c", "import time; time.sleep(120)"])  # started, but never joins the world
    started = time.monotonic()
    done = mpirun(blocks, timeout=100)
    out = done.stdout + done.stderr
    assert done.returncode != 0 and time.monotonic() - started < 60, out[-3000:]
    assert "Timeout (0:00:04)!" in out and "in init_world" in out, out[-3000:]
