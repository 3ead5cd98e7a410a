"""rollout_hpc.process_exit.exit_now: a finished process ends at once with its code and its output flushed, unless
the interpreter's tear-down still has work (an open HDF5 file, a child process, a non-daemon thread)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import h5py
import pytest


def run(body: str, tmp_path) -> subprocess.CompletedProcess:
    code = "from rollout_hpc.process_exit import exit_now\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)


def test_a_finished_process_ends_with_its_code_and_its_output_flushed(tmp_path):
    done = run(
        """
        import sys, h5py
        with h5py.File("log.h5", "w") as f:
            f["x"] = [1, 2, 3]
        print("last line", end="")  # no newline: only an explicit flush writes it
        sys.stderr.write("to stderr")
        exit_now(75)
        print("not reached")
        """,
        tmp_path,
    )
    assert (done.returncode, done.stdout, done.stderr) == (75, "last line", "to stderr")
    with h5py.File(tmp_path / "log.h5") as f:
        assert list(f["x"][:]) == [1, 2, 3]


@pytest.mark.parametrize(
    "left_open",
    [
        "f = h5py.File('log.h5', 'w'); f['x'] = [1, 2, 3]",  # h5py closes it at exit
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1)'])",  # a worker still running
        "threading.Thread(target=time.sleep, args=(1,)).start()",  # the interpreter waits for it
    ],
)
def test_the_usual_exit_when_the_tear_down_has_work(tmp_path, left_open):
    done = run(
        f"""
        import subprocess, sys, threading, time, h5py
        {left_open}
        exit_now(3)
        print("returned")
        """,
        tmp_path,
    )
    assert done.returncode == 0 and done.stdout == "returned\n", done.stderr
    if "h5py.File" in left_open:  # closed by the tear-down: complete
        with h5py.File(tmp_path / "log.h5") as f:
            assert list(f["x"][:]) == [1, 2, 3]


def test_an_mpi_rank_finalizes_and_ends_without_the_tear_down(tmp_path):
    from rollout_hpc.launch.local import launch_env, require_mpirun

    code = textwrap.dedent(
        """
        import atexit, sys
        from rollout_hpc.process_exit import exit_now
        from rollout_hpc.runtime.world import _mpi
        MPI = _mpi()
        MPI.COMM_WORLD.Barrier()
        atexit.register(print, "tear-down ran")  # skipped by exit_now
        sys.stdout.write(f"rank {MPI.COMM_WORLD.Get_rank()} done\\n")  # one write: print may split it
        exit_now(0)
        """
    )
    done = subprocess.run(
        [require_mpirun(), "--oversubscribe", "-np", "2", sys.executable, "-c", code],
        cwd=tmp_path,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr  # mpirun reports a rank that exits without MPI_Finalize as an error
    assert sorted(done.stdout.splitlines()) == ["rank 0 done", "rank 1 done"], done.stdout + done.stderr
