"""The local launcher's answers to a user stopping a run: Ctrl-C checkpoints and stops like Slurm's warning (exit 75,
a resume hint; a second Ctrl-C would end it at once), a killed launcher leaves no orphans. (A rank killed with -9
ends the run with a message that says `resume` continues it: test_resume_local checks it.) Real runs under mpirun."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from test_cli import _processes_mentioning
from test_resume_local import STEPS, Interruptible, assert_exactly_once, cli, write_run_config

from rollout_hpc.launch.status import local_state


def test_ctrl_c_checkpoints_and_says_how_to_continue(tmp_path):
    """(A rank killed with -9 saying how to continue: test_resume_local's third interruption checks it.)"""
    run_dir = tmp_path / "run"
    config = write_run_config(tmp_path, "run")
    run = Interruptible("submit", config, "--local", "--run-dir", run_dir, cwd=tmp_path)
    run.wait_for_step(2)
    run.proc.send_signal(signal.SIGINT)  # what Ctrl-C in the terminal sends the launcher
    assert run.finish() == 75, run.output[-3000:]
    assert "stopping after the current step" in run.output and "stop requested" in run.output
    assert f"continue it with `rollout-hpc resume {run_dir}`" in run.output


def test_a_killed_launcher_leaves_no_orphans_and_resume_continues(tmp_path):
    """kill -9 of the launcher alone (not its mpirun): mpirun's next write to the launcher's closed pipe ends it and
    the ranks, so nothing runs on orphaned; `resume` then finishes the run from the newest checkpoint, each sample
    once."""
    run_dir = tmp_path / "run"
    config = write_run_config(tmp_path, "run", steps=STEPS)
    run = Interruptible("submit", config, "--local", "--run-dir", run_dir, cwd=tmp_path)
    run.wait_for_step(2)
    mpirun_pid = json.loads((run_dir / "manifest.json").read_text())["local_runs"][-1]["pid"]
    os.kill(run.proc.pid, signal.SIGKILL)
    run.finish()
    deadline = time.monotonic() + 120
    while _processes_mentioning(str(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _processes_mentioning(str(run_dir)) == [], "mpirun or ranks outlived their launcher"
    status = Path(f"/proc/{mpirun_pid}/status")
    assert not status.exists() or "State:\tZ" in status.read_text(), "mpirun outlived its launcher"
    done = cli("resume", run_dir, "--local", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert_exactly_once(run_dir)


def test_a_zombie_mpirun_is_not_a_running_run():
    """After kill -9 of a whole local job, its mpirun can linger as a zombie until something reaps it: status and
    resume must see the run as ended (LOST), not RUNNING (resume would refuse to start)."""
    child = os.fork()
    if child == 0:
        os._exit(0)
    try:
        deadline = time.monotonic() + 10
        while "State:\tZ" not in Path(f"/proc/{child}/status").read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        record = {"pid": child, "host": os.uname().nodename, "exit_code": None}
        assert local_state(record).startswith("LOST")
        assert local_state({**record, "pid": os.getpid()}) == "RUNNING"
    finally:
        os.waitpid(child, 0)


def _caught(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (SigCgt in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(mask >> (sig - 1) & 1)


def _torch_loaded(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return True


def test_a_warning_that_reaches_the_ranks_while_they_start_checkpoints_instead_of_killing_them(tmp_path):
    """Slurm sends the time-limit warning (USR1) to every task of the step, whenever it comes: a rank still importing
    (torch takes seconds) used to die of it (USR1's default action; exit 138, no requeue). Each rank is signalled
    as soon as its entry point holds the signal, before torch is loaded: the run starts anyway, stops at the first
    step boundary with a checkpoint, and exits 75 (continue)."""
    run_dir = tmp_path / "run"
    config = write_run_config(tmp_path, "run")
    run = Interruptible("submit", config, "--local", "--run-dir", run_dir, cwd=tmp_path)
    signalled: dict[int, bool] = {}  # rank pid -> torch was not loaded yet when it got USR1
    deadline = time.monotonic() + 60
    while len(signalled) < 2:
        assert time.monotonic() < deadline and run.proc.poll() is None, signalled
        for pid in _processes_mentioning(str(run_dir)):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
            except OSError:
                continue
            if pid in signalled or "python" not in argv[0] or "rollout_hpc.runtime.entry" not in argv:
                continue  # mpirun and the launcher mention the run directory too
            if _caught(pid, signal.SIGUSR1):
                early = not _torch_loaded(pid)
                os.kill(pid, signal.SIGUSR1)
                signalled[pid] = early
        time.sleep(0.005)
    assert any(signalled.values()), "no rank was signalled before it loaded torch: the start-up window was missed"
    assert run.finish() == 75, run.output[-3000:]
    assert "User defined signal" not in run.output
    assert json.loads(cli("ckpt", run_dir, "--json", cwd=tmp_path).stdout)["step"] >= 1
