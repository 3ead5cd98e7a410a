"""Shared pytest fixtures: the local multi-node Slurm cluster, MPI-as-root environment, repo paths.

Other test files add their own fixtures locally; keep this file generic.

`slurm_cluster` (session): a real Slurm cluster (tools/slurm_cluster.sh) with nodes n1..n4 in partition `debug`.
It sets os.environ["SLURM_CONF"] for the session. Tests marked `@pytest.mark.slurm` get it automatically.
Several pytest sessions (helpers working in parallel) share one cluster: each holds a lease, and the last one to
leave stops it, unless it was started by hand (`tools/slurm_cluster.sh start` marks it `keep`), jobs are still
queued, or ROLLOUT_SLURM_KEEP=1 is set.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
CLUSTER_SCRIPT = REPO_ROOT / "tools" / "slurm_cluster.sh"

# Job states after which Slurm will not run the job again by itself (a requeued job goes back to PENDING).
TERMINAL_STATES = {
    "COMPLETED",
    "CANCELLED",
    "FAILED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
    "OUT_OF_MEMORY",
    "SPECIAL_EXIT",
}


class SlurmJobUnknown(LookupError):
    """Slurm has no record of the job (never submitted here, or purged and absent from the completion log)."""


@dataclass
class SlurmCluster:
    dir: Path
    conf: Path
    nodes: list[str]
    env: dict[str, str] = field(repr=False)

    def run(self, *argv: str, check: bool = True, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        """Runs a Slurm client command (sbatch, squeue, scontrol ...) against this cluster; text output."""
        return subprocess.run(
            argv, env=self.env, check=check, timeout=timeout, capture_output=True, text=True, **kwargs
        )

    def sbatch(self, script: str | os.PathLike, *args: str, cwd: str | os.PathLike | None = None) -> int:
        """Submits a batch script (a path) and returns the job id (for a het job: the leader's id)."""
        out = self.run("sbatch", "--parsable", *args, str(script), cwd=cwd)
        return int(out.stdout.strip().split(";")[0])

    def job_records(self, job_id: int) -> list[dict[str, str]]:
        """`scontrol show job` fields of the job, one dict per het component (offset order); [] if unknown."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id), check=False)
        if out.returncode != 0:
            return []
        records = [dict(re.findall(r"(\S+?)=(\S*)", line)) for line in out.stdout.splitlines() if line.strip()]
        return sorted(records, key=lambda r: int(r.get("HetJobOffset", 0)))

    def completion_records(self, job_id: int) -> list[dict[str, str]]:
        """The last completion-log entry of each component of the job (the log keeps jobs Slurm has purged)."""
        log = self.dir / "log" / "jobcomp.txt"
        latest: dict[str, dict[str, str]] = {}
        if log.exists():
            for line in log.read_text().splitlines():
                rec = dict(re.findall(r"(\S+?)=(\S*)", line))
                if str(job_id) in (rec.get("JobId"), rec.get("HetJobId")):
                    latest[rec["JobId"]] = rec
        return [latest[k] for k in sorted(latest, key=int)]

    def job_state(self, job_id: int) -> tuple[str, bool]:
        """(state, finished). A het job is finished when all its components are; its state is then the first
        component state that is not COMPLETED (or COMPLETED)."""
        records = self.job_records(job_id) or self.completion_records(job_id)
        if not records:
            raise SlurmJobUnknown(f"Slurm knows no job {job_id} (cluster {self.conf})")
        states = [r.get("JobState", "UNKNOWN") for r in records]
        finished = all(s in TERMINAL_STATES for s in states)
        failed = [s for s in states if s != "COMPLETED"]
        return (failed[0] if failed else "COMPLETED"), finished

    def wait_job(self, job_id: int, timeout: float = 120) -> str:
        """Waits until the job (all het components) has finished; returns its final state, e.g. "COMPLETED"."""
        deadline = time.monotonic() + timeout
        while True:
            state, finished = self.job_state(job_id)
            if finished:
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {state} after {timeout:.0f}s\n{self.log_tail()}")
            time.sleep(0.5)

    def wait_state(self, job_id: int, states: set[str], timeout: float = 60) -> str:
        """Waits until the job's state is one of `states` (e.g. {"RUNNING"}); returns it."""
        deadline = time.monotonic() + timeout
        while True:
            state, _ = self.job_state(job_id)
            if state in states:
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is {state}, not in {sorted(states)}, after {timeout:.0f}s")
            time.sleep(0.5)

    def log_tail(self, lines: int = 20) -> str:
        """The end of the controller log, for assertion messages."""
        log = self.dir / "log" / "slurmctld.log"
        if not log.exists():
            return f"(no {log})"
        return "--- slurmctld.log\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def _cluster_dir() -> Path:
    return Path(os.environ.get("ROLLOUT_SLURM_DIR", "/tmp/rollout-slurm"))


def _script(action: str, cluster_dir: Path, leased: bool = False) -> subprocess.CompletedProcess:
    env = dict(os.environ, ROLLOUT_SLURM_LEASED="1") if leased else None
    return subprocess.run(
        ["bash", str(CLUSTER_SCRIPT), action, str(cluster_dir)], capture_output=True, text=True, timeout=180, env=env
    )


@contextmanager
def _lease_lock(cluster_dir: Path):
    cluster_dir.mkdir(parents=True, exist_ok=True)
    with open(cluster_dir / ".lease-lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _live_leases(lease_dir: Path) -> list[Path]:
    live = []
    for lease in lease_dir.glob("pid-*"):
        if Path(f"/proc/{lease.name[4:]}").exists():
            live.append(lease)
        else:
            lease.unlink(missing_ok=True)  # a test session that died without cleaning up
    return live


@pytest.fixture(scope="session")
def slurm_cluster() -> SlurmCluster:
    if shutil.which("slurmctld") is None or shutil.which("slurmd") is None:
        pytest.skip("Slurm is not installed (no slurmctld/slurmd): run tools/setup.sh")
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster's daemons need root: run the tests as root")
    cluster_dir = _cluster_dir()
    lease_dir = cluster_dir / "leases"
    my_lease = lease_dir / f"pid-{os.getpid()}"
    with _lease_lock(cluster_dir):
        lease_dir.mkdir(exist_ok=True)
        if not _live_leases(lease_dir) and _script("status", cluster_dir).returncode != 0:
            # The tests start it, so the tests stop it (unless someone starts it by hand meanwhile: the
            # script then marks it `keep`).
            (lease_dir / "keep").unlink(missing_ok=True)
        started = _script("start", cluster_dir, leased=True)
        if started.returncode != 0:
            pytest.fail(f"tools/slurm_cluster.sh start failed:\n{started.stdout}{started.stderr}", pytrace=False)
        my_lease.touch()

    conf = cluster_dir / "slurm.conf"
    previous_conf = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(conf)
    # Slurm 22.05's srun sometimes hangs after a het pmix step has ended (docs/CONTRACTS.md, test cluster);
    # the job script's watchdog ends it. Check often and wait briefly here so a hang costs seconds, not a minute.
    os.environ.setdefault("ROLLOUT_STEP_POLL", "2")
    os.environ.setdefault("ROLLOUT_STEP_EXIT_GRACE", "20")
    nodes = sorted(re.findall(r"^NodeName=(\S+)", conf.read_text(), re.M), key=lambda n: int(n[1:]))
    yield SlurmCluster(dir=cluster_dir, conf=conf, nodes=nodes, env=dict(os.environ))

    if previous_conf is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = previous_conf
    with _lease_lock(cluster_dir):
        my_lease.unlink(missing_ok=True)
        keep = os.environ.get("ROLLOUT_SLURM_KEEP") == "1" or (lease_dir / "keep").exists()
        queue = subprocess.run(
            ["squeue", "-h", "-o", "%i"],
            capture_output=True,
            text=True,
            timeout=60,
            env=dict(os.environ, SLURM_CONF=str(conf)),
        )
        in_use = queue.returncode != 0 or queue.stdout.strip() != ""  # someone's jobs, submitted by hand
        if not _live_leases(lease_dir) and not keep and not in_use:
            _script("stop", cluster_dir)


def guarded_srun(srun_command: str) -> str:
    """Bash lines that run one `srun` step for a test's own batch script, ending srun if it outlives its step.

    Slurm 22.05's srun can hang in pmixp_abort_agent_stop after every task of a het pmix step exited (about
    2-3 % of steps on the local cluster). Like `watch_step` in slurm/rollout.sbatch, this ends srun once
    squeue has listed no step for 20 s; the script then fails only if srun had reported a failed task. The loop
    ends after the kill: a killed srun not yet reaped still answers `kill -0`, and a second `kill -KILL` of it, gone
    by then, failed under `set -e` and took the job down (a CI failure of test_exchange's het job).
    """
    return f"""
{srun_command} 2> >(tee "${{TMPDIR:-/tmp}}/srun-$SLURM_JOB_ID-$$.err" >&2) &
step=$!; missing=0
while kill -0 $step 2>/dev/null; do
    sleep 2
    if squeue -h -s -j $SLURM_JOB_ID -o %i | grep -q "^$SLURM_JOB_ID\\.[0-9]"; then missing=0; else missing=$((missing + 2)); fi
    if [ $missing -ge 20 ]; then touch "${{TMPDIR:-/tmp}}/srun-$SLURM_JOB_ID-$$.hung"; kill -KILL $step 2>/dev/null || true; break; fi
done
wait $step || {{ [ -e "${{TMPDIR:-/tmp}}/srun-$SLURM_JOB_ID-$$.hung" ] && ! grep -q ': task [0-9]*: ' "${{TMPDIR:-/tmp}}/srun-$SLURM_JOB_ID-$$.err"; }} || exit 1
rm -f "${{TMPDIR:-/tmp}}/srun-$SLURM_JOB_ID-$$.hung"
"""


def pytest_collection_modifyitems(config, items):
    """Tests marked `slurm` get the `slurm_cluster` fixture without naming it; tests marked `chaos` run last (a
    random round of faults on a machine that has run everything else: it twice failed as the first test of a full
    run while passing every standalone run, cause unknown)."""
    for item in items:
        if item.get_closest_marker("slurm") and "slurm_cluster" not in getattr(item, "fixturenames", ["slurm_cluster"]):
            item.fixturenames.append("slurm_cluster")
    items.sort(key=lambda item: item.get_closest_marker("chaos") is not None)  # stable: the rest keep their order


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory) -> Path:
    """A finished 4-step run of test_resume_local's tiny config (no pause in its reward), made once per session.
    Tests that damage or resume a finished run work on a copy: shutil.copytree(finished_run, tmp_path / "run")."""
    from test_resume_local import cli, write_run_config

    tmp = tmp_path_factory.mktemp("finished")
    done = cli("submit", write_run_config(tmp, "run", steps=4, sleep=0.0), "--local", "--run-dir", tmp / "run", cwd=tmp)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return tmp / "run"


@pytest.fixture(scope="session")
def zero2_run(tmp_path_factory) -> Path:
    """A finished 3-step run on DeepSpeed ZeRO-2 with two trainer ranks (a sharded checkpoint after every step), made
    once: test_loop checks the loop through it, test_export_model merges its shards."""
    from test_export_model import submit

    extra = "trainer: {backend: deepspeed, zero_stage: 2, tasks_per_node: 2}"
    return submit(tmp_path_factory.mktemp("zero2"), "zero2", steps=3, timeout=400, extra=extra)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def venv_python() -> Path:
    """The interpreter running the tests: the project's venv python (has mpi4py, torch, the ring extension)."""
    return Path(sys.executable)


@pytest.fixture
def mpi_env() -> dict[str, str]:
    """Environment for `mpirun` / `srun --mpi=pmix` as root on this small machine (a fresh copy per test):
    OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM)=1, OMPI_MCA_rmaps_base_oversubscribe=1, the repo on PYTHONPATH."""
    from mpi_progs.launch import mpi_env as environment_for_mpirun

    return environment_for_mpirun()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI (CI=true) a skipped test is a failure unless it is marked `gpu` (no GPU is lent to CI): a Slurm or MPI
    test that silently skips (not root, Slurm missing, a dependency not installed) would test nothing."""
    outcome = yield
    report = outcome.get_result()
    if (
        os.environ.get("CI", "").lower() in ("1", "true", "yes")
        and report.skipped
        and not item.get_closest_marker("gpu")
    ):
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI, which must run every non-GPU test: {reason}"
