"""A run started from a process that has initialised MPI itself (mpi4py imported in a notebook, a test session, a
driver script): its children inherit that MPI job's variables, and an mpirun that sees them exits 1 without a word.
The launchers start the new job without them. Real MPI singleton, real mpirun."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from test_resume_local import write_run_config

from rollout_hpc.launch.local import launch_env, require_mpirun
from rollout_hpc.launch.mpi_env import fresh_job_env, inherited_rank_vars
from rollout_hpc.store.trajlog import read_metrics

PARENT = textwrap.dedent("""
    import subprocess, sys
    from mpi4py import MPI
    assert MPI.COMM_WORLD.Get_size() == 1  # an Open MPI singleton: it sets OMPI_MCA_ess, PMIX_* in the C environ
    done = subprocess.run([sys.executable, "-m", "rollout_hpc", *sys.argv[1:]])  # inherits them, as Popen does
    sys.exit(done.returncode)
""")


def test_submit_local_from_a_process_that_initialised_mpi(tmp_path):
    config = write_run_config(tmp_path, "child", steps=3, sleep=0)
    run_dir = tmp_path / "child"
    done = subprocess.run(
        [sys.executable, "-c", PARENT, "submit", str(config), "--local", "--run-dir", str(run_dir)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [m["step"] for m in read_metrics(run_dir / "trajectories.h5")] == [0, 1, 2]


def test_only_the_running_jobs_variables_are_left_out():
    # What a child of an MPI singleton inherits: `env -0` run by a process that has initialised MPI.
    probe = "from mpi4py import MPI; import subprocess; MPI.COMM_WORLD.Get_rank(); subprocess.run(['env', '-0'])"
    child = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=60)
    inherited = dict(item.split("=", 1) for item in child.stdout.decode().split("\0") if "=" in item)
    leftover = inherited_rank_vars(inherited)
    assert "OMPI_MCA_ess" in leftover and any(name.startswith("PMIX_SERVER_URI") for name in leftover)
    user = {"OMPI_MCA_btl": "self,vader", "OMPI_MCA_pml": "ob1", "PATH": "/usr/bin", "SLURM_JOB_ID": "7"}
    assert fresh_job_env({**inherited, **user}).items() >= user.items()
    assert inherited_rank_vars(fresh_job_env(inherited)) == []


def test_local_jobs_authenticate_with_socket_credentials_unless_the_user_says_otherwise(monkeypatch):
    """Without a munged to answer, Open MPI's PMIx retried munge for ~2.3 s at every mpirun (launch/local.py)."""
    monkeypatch.delenv("PMIX_MCA_psec", raising=False)
    assert launch_env()["PMIX_MCA_psec"] == "native"
    monkeypatch.setenv("PMIX_MCA_psec", "munge")
    assert launch_env()["PMIX_MCA_psec"] == "munge"
    # A real mpirun under that environment starts and runs its processes.
    monkeypatch.delenv("PMIX_MCA_psec")
    done = subprocess.run(
        [
            require_mpirun(),
            "--oversubscribe",
            "-np",
            "2",
            sys.executable,
            "-c",
            # one write a line: print() under PYTHONUNBUFFERED writes in pieces, which mpirun interleaves
            "import os; from mpi4py import MPI; c = MPI.COMM_WORLD; os.write(1, f'{c.Get_rank()} {c.Get_size()}\\n'.encode())",
        ],
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(done.stdout.splitlines()) == ["0 2", "1 2"], done.stdout
