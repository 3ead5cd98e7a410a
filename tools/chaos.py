#!/usr/bin/env python
"""Fault injection (issue 18, item 9): real local runs are hit by faults at random steps, resumed with
`rollout-hpc resume` until they finish, and checked: every (step, prompt_id, sample_idx) logged exactly once, the
final weights digest equal to an uninterrupted run's (on-policy, same seed), no leftover temp files, ring segments,
Open MPI shared-memory segments or processes, every message naming its cause, and no phase past its time bound.

    tools/chaos.py --rounds N [--seed S] [--launcher local|slurm] [--quick] [--faults KIND,...]

A round is one run and the faults injected into it one after another (one fault each, or with --quick every
local fault kind: two runs in all; on Slurm one run with every Slurm fault kind). The last line printed is one JSON
line; exit 0 only if nothing was lost, nothing hung and every fault was survived. The run helpers are the resume
tests' own (tests/test_resume_local.py).
With --launcher slurm (a running cluster, SLURM_CONF set; as root: a failed node is rebooted) the faults are scancel
during a checkpoint write, one node of the job failing mid-step (Slurm requeues the job onto the other nodes),
kill -9 of the generator or the trainer rank, and a storm of time-limit warnings (USR1: checkpoint and requeue).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import h5py

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from conftest import TERMINAL_STATES, SlurmCluster  # noqa: E402
from test_damaged_log import _chunk  # noqa: E402
from test_disk_full import fill  # noqa: E402
from test_loop import _rank_pid  # noqa: E402
from test_resume_local import (  # noqa: E402
    GROUP,
    PROMPTS,
    SLOW_REWARD,
    Interruptible,
    cli,
    logged_uids,
    weights_digest,
    write_run_config,
)
from test_resume_slurm import submitted_job  # noqa: E402

from rollout_hpc.exchange.ring import DEFAULT_RING_DIR  # noqa: E402
from rollout_hpc.rundir_layout import TRAJECTORY_LOG  # noqa: E402
from rollout_hpc.store.checkpoint import list_checkpoints  # noqa: E402
from rollout_hpc.store.trajlog import TrajectoryReader  # noqa: E402

# A reward that varies (so every step has a gradient and the digest means something), slowed like the resume
# tests', and that faults once when chaos arms it: the first call to take the flag file raises, hangs or is NaN.
FAULTY_REWARD = """
import os, time
_FLAG = {flag!r}

def reward(prompt, text):
    try:
        os.rename(_FLAG, _FLAG + ".taken")  # exactly one call, in any reward worker, takes the fault
    except FileNotFoundError:
        time.sleep({sleep})
        return (sum(map(ord, text)) % 7) / 6
    kind = open(_FLAG + ".taken").read()
    if kind == "raise":
        raise ConnectionError("chaos: injected reward failure")
    if kind == "hang":
        time.sleep(3600)
    return float("nan")
"""
assert "def reward(prompt, text)" in SLOW_REWARD  # the plugin spec write_run_config names stays valid

# Every local fault kind, and the words its output must contain (the cause named).
CAUSES = {
    "kill9-generator": "continues it from its newest checkpoint",
    "kill9-trainer": "continues it from its newest checkpoint",
    "kill9-job": "resuming from step-",  # nothing of the run lives to speak: resume says where it continues
    "signal-storm": "rollout-hpc resume",
    "reward-raise": "reward errors 1",
    "reward-hang": "reward errors 1",
    "reward-nan": "returned nan",
    "ckpt-truncate": "skipping damaged checkpoint",
    "ckpt-flip": "skipping damaged checkpoint",
    "log-truncate": "was damaged",
    "log-flip": "was damaged",
    "disk-full": "Nothing partial is left",  # the checkpoint refused (not the earlier low-space warning)
}
SLURM_CAUSES = {  # the job script's lines (or the runtime's, in the job's log)
    "scancel-in-checkpoint": "stopped by SIGTERM (scancel",
    "node-fail": "restarted by Slurm",
    "slurm-kill9-generator": "continues the run from its newest checkpoint",
    "slurm-kill9-trainer": "continues the run from its newest checkpoint",
    "slurm-usr1-storm": "requeueing job",
}
COST_A_SAMPLE = {"reward-raise", "reward-hang"}  # by design: the run goes on, that sample scores 0
NEEDS_ROOT = {"disk-full", "node-fail"}  # mounts a tmpfs; restarts a slurmd
PHASE_BOUND_S = 300  # one start of the run, until it exits: anything longer is a hang
CHECKPOINT_EVERY = 2


@dataclass
class Round:
    faults: list[str]
    root: Path
    steps: int
    rng: random.Random
    notes: list[str] = field(default_factory=list)
    hangs: int = 0
    declared_lost: set = field(default_factory=set)  # log rows a repair line said were lost
    rows: list = field(default_factory=list)  # (step, prompt_id, sample_idx) of the finished run's log
    failed: dict[str, list[str]] = field(default_factory=dict)
    disk_full: tuple[threading.Event, threading.Thread] | None = None  # disk-full: set it to stop keep_full

    @property
    def run_dir(self) -> Path:
        return self.root / ("fs" if "disk-full" in self.faults else "") / "run"

    @property
    def flag(self) -> Path:
        return self.root / "reward.fault"

    def fail(self, fault: str, why: str) -> None:
        self.failed.setdefault(fault, []).append(why)


def config_for(directory: Path, name: str, steps: int, flag: Path, sleep: float = 0.05) -> Path:
    config = write_run_config(directory, name, steps=steps, sleep=sleep)
    (directory / "slow_reward.py").write_text(FAULTY_REWARD.format(flag=str(flag), sleep=sleep))
    return config


# run.hang_timeout also bounds MPI start-up: a start Slurm could not launch on a node costs a minute, not five.
SETS = (
    *("--set", f"checkpoint.every_steps={CHECKPOINT_EVERY}"),
    *("--set", "task.reward_timeout=2"),
    *("--set", "run.hang_timeout=60"),
)


def reference_digest(work: Path, steps: int) -> str:
    ref = work / "reference"
    config = config_for(ref, "ref", steps, ref / "never", sleep=0.0)  # the pause only paces the injections
    done = cli("submit", config, "--local", "--run-dir", ref / "run", *SETS, cwd=ref, timeout=PHASE_BOUND_S)
    if done.returncode != 0:
        sys.exit(f"chaos: the uninterrupted reference run failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return weights_digest(ref / "run")


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        children = subprocess.run(["pgrep", "-P", str(todo.pop())], capture_output=True, text=True).stdout.split()
        out += map(int, children)
        todo += map(int, children)
    return out


def shm_segments(pids: list[int]) -> set[str]:
    """/dev/shm files (Open MPI vader segments, rings) the processes have mapped."""
    found = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        found |= {line.split(None, 5)[5] for line in maps.splitlines() if " /dev/shm/" in line}
    return found


def dump_stacks(pids: list[int], path: Path) -> None:
    """A hang's evidence: each process's command line, kernel wait channel and (py-spy where installed) stacks."""
    with open(path, "a") as f:
        for pid in pids:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                wchan = Path(f"/proc/{pid}/wchan").read_text()
            except OSError:
                continue
            f.write(f"=== pid {pid} wchan {wchan}: {cmd}\n")
            spy = subprocess.run(["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True, check=False)
            f.write(spy.stdout)


def hung(rnd: Round, run: Interruptible) -> None:
    """A start of the run past its time bound: its processes' stacks dumped, then all of them killed."""
    tree = [run.proc.pid, *descendants(run.proc.pid)]
    dump_stacks(tree, rnd.root / "hang-stacks.txt")
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    rnd.hangs += 1
    rnd.notes.append(f"hang: stacks in {rnd.root / 'hang-stacks.txt'}")


def finish(rnd: Round, run: Interruptible) -> tuple[int | None, str]:
    """Wait for a start of the run to exit; past the bound it is a hang (None)."""
    try:
        code = run.finish(timeout=PHASE_BOUND_S)
    except subprocess.TimeoutExpired:
        hung(rnd, run)
        run.proc.wait()
        return None, run.output
    return code, run.output


def wait_for_step(rnd: Round, run: Interruptible, step: int, seen: set[int], segments: set[str]) -> bool:
    """Read the run's output up to step `step` (within the time bound), noting its processes and shm segments."""
    timer = threading.Timer(PHASE_BOUND_S, hung, (rnd, run))
    timer.start()
    try:
        run.wait_for_step(step)
    except AssertionError:
        return False
    finally:
        timer.cancel()
    tree = [run.proc.pid, *descendants(run.proc.pid)]
    seen.update(tree)
    segments.update(shm_segments(tree))
    return True


def damage(path: Path, how: str, rng: random.Random) -> None:
    """Cut a file at a random point, or flip 16 bytes of it where a read meets them: in a data chunk of the log, in
    one dataset's stored bytes of a checkpoint."""
    data = bytearray(path.read_bytes())
    if how == "truncate":
        data = data[: int(len(data) * rng.uniform(0.3, 0.9))]
    else:
        if path.name == TRAJECTORY_LOG:
            dataset = rng.choice(["traj/reward", "traj/step", "traj/response_ids"])
            with h5py.File(path, "r", libver="latest", swmr=True, locking=False) as f:
                chunks = f[dataset].id.get_num_chunks()
            offset, size = _chunk(path, dataset, rng.randrange(chunks))
            at = offset + size // 2 - 8
        else:
            at = _dataset_byte(path, rng)
        data[at : at + 16] = bytes(b ^ 0xFF for b in data[at : at + 16])
    path.write_bytes(bytes(data))


def _dataset_byte(path: Path, rng: random.Random) -> int:
    """A random offset 16 bytes inside one of the file's contiguous datasets. Not any byte of the file: ~2% of a
    checkpoint's back half is free space or padding that no read touches (measured: 9 of 400 flips there went
    unnoticed, rightly), and a flip there is no damage, so no message would name it."""
    spans: list[tuple[int, int]] = []

    def visit(_name, obj) -> None:
        if isinstance(obj, h5py.Dataset) and obj.id.get_offset() is not None and obj.id.get_storage_size() >= 16:
            spans.append((obj.id.get_offset(), obj.id.get_storage_size()))

    with h5py.File(path, "r", locking=False) as f:
        f.visititems(visit)
    offset, size = rng.choice(sorted(spans))
    return offset + rng.randrange(size - 15)


def inject(rnd: Round, fault: str, run: Interruptible) -> str:
    """Inject `fault` into the running `run` (already past a random step); returns what to do next."""
    run_dir = rnd.run_dir
    if fault in ("kill9-generator", "kill9-trainer"):
        mpirun = json.loads((run_dir / "manifest.json").read_text())["local_runs"][-1]["pid"]
        os.kill(_rank_pid(mpirun, "gen0" if fault == "kill9-generator" else "train0"), signal.SIGKILL)
    elif fault == "kill9-job":
        for pid in [run.proc.pid, *descendants(run.proc.pid)]:  # every process of the run at once
            os.kill(pid, signal.SIGKILL)
    elif fault == "signal-storm":
        for sig in rnd.rng.choices([signal.SIGUSR1, signal.SIGTERM], weights=[3, 1], k=rnd.rng.randint(3, 6)):
            run.proc.send_signal(sig)
            time.sleep(rnd.rng.uniform(0.0, 0.1))
    elif fault.startswith("reward-"):
        (rnd.flag.parent / (rnd.flag.name + ".taken")).unlink(missing_ok=True)
        rnd.flag.write_text(fault.split("-")[1])
    elif fault.startswith(("ckpt-", "log-")):
        run.proc.send_signal(signal.SIGUSR1)  # stopped first: the damage is done to files at rest
    elif fault == "disk-full":
        newest = max((run_dir / "checkpoints").glob("step-*.h5"))
        until = threading.Event()
        holder = threading.Thread(
            target=keep_full, args=(run_dir.parent, newest.stat().st_size // 2, until), daemon=True
        )
        holder.start()
        rnd.disk_full = (until, holder)
    return fault


def keep_full(mount: Path, leave: int, until: threading.Event) -> None:
    """Hold the file system full until the run has stopped: so the next checkpoint cannot fit. Space the run frees
    after the first fill (a checkpoint in flight published, then the oldest one deleted: keep_last) is taken again,
    as other users of a full file system would."""
    while True:
        fill(mount, leave)
        if until.wait(0.05):
            return


def after_stop(rnd: Round, fault: str) -> None:
    """Damage done while the run is stopped, and freeing the disk before the resume."""
    if fault.startswith("ckpt-"):
        damage(max((rnd.run_dir / "checkpoints").glob("step-*.h5")), fault.split("-")[1], rnd.rng)
    elif fault.startswith("log-"):
        damage(rnd.run_dir / TRAJECTORY_LOG, fault.split("-")[1], rnd.rng)
    elif fault == "disk-full":
        if rnd.disk_full is not None:
            rnd.disk_full[0].set()
            rnd.disk_full[1].join()
        (rnd.run_dir.parent / "filler").unlink(missing_ok=True)


def play(rnd: Round, reference: str) -> None:
    """One run: start it, inject each fault at a random later step, resume after each until the run is done."""
    config = config_for(rnd.root, "chaos" + rnd.root.name, rnd.steps, rnd.flag)
    start = ("submit", config, "--local", "--run-dir", rnd.run_dir, *SETS)
    seen: dict[str, set[int]] = {}  # per fault: the run's processes and shm segments while it was injected
    segments: dict[str, set[str]] = {}
    outputs: dict[str, str] = {}
    faults = list(rnd.faults)
    done_step = CHECKPOINT_EVERY  # the first fault comes once a checkpoint exists
    finished, previous = False, None
    for _ in range(3 * len(rnd.faults) + 3):
        run = Interruptible(*start, cwd=rnd.root)
        injected, at = [], done_step
        while faults:  # faults that cost a sample leave the run going: the next one joins it
            at = min(at + rnd.rng.randint(1, 2), rnd.steps - 1)
            if not wait_for_step(
                rnd, run, at, seen.setdefault(faults[0], set()), segments.setdefault(faults[0], set())
            ):
                tail = " | ".join(line.strip() for line in run.output.splitlines()[-6:])
                rnd.fail(faults.pop(0), f"the run ended before step {at} (its last lines: {tail})")
                break
            injected.append(inject(rnd, faults.pop(0), run))
            if injected[-1] not in COST_A_SAMPLE or not faults or faults[0] not in COST_A_SAMPLE:
                break
        code, out = finish(rnd, run)
        note_repair(rnd, out)
        for fault in [*injected, *([previous] if previous else [])]:  # the resume after a fault speaks of it too
            outputs[fault] = outputs.get(fault, "") + out
        for fault in injected:
            if fault in COST_A_SAMPLE and code != 0:
                rnd.fail(fault, f"exit {code}: a reward that {fault[7:]}s must cost a sample, not the run")
        finished = code == 0 and not faults
        if code is None or finished:
            break
        for fault in injected:
            after_stop(rnd, fault)
        previous = injected[-1] if injected else None
        # A process killed with -9 holds its flocks (the log's one-writer lock) until the kernel has torn it down,
        # which takes a moment for a rank with a GB of memory on a loaded machine: resume once it is gone, as a
        # user would after seeing the job end (a resume while it is still there is refused, by design).
        _wait_until_gone(rnd.run_dir, bound_s=60)
        start = ("resume", rnd.run_dir, "--local")
        saved = list_checkpoints(rnd.run_dir)  # in-process: a CLI start per resume would double the CPU time
        done_step = saved[-1].step if saved else 0
    check(rnd, reference, outputs, seen, segments, finished)


def play_slurm(rnd: Round, reference: str, cluster: SlurmCluster) -> None:
    """A run on the local Slurm cluster hit by each of the round's faults in turn, each once a checkpoint newer than
    the previous fault's exists. A fault that ends the job is followed by `rollout-hpc resume` (sbatch); after one
    that Slurm answers by restarting the job (a failed node; a time-limit warning, which requeues), the next fault
    comes in the restarted job. Then `rollout-hpc resume` until the run says it is done."""
    config = config_for(rnd.root, "chaos" + rnd.root.name, rnd.steps, rnd.flag)
    run_dir = rnd.run_dir
    job = submitted_job(cli("submit", config, "--run-dir", run_dir, *SETS, "--set", "launcher=slurm", cwd=rnd.root))
    outputs = {fault: "" for fault in rnd.faults}
    logs = LogCursor(run_dir / "logs")
    after, hung_job = 0, False  # `after`: the newest checkpoint's step when the previous fault came
    done_early = False
    for i, fault in enumerate(rnd.faults):
        placed = None
        for _ in range(3):
            if cluster.job_state(int(job))[1]:  # the last fault ended the job (or Slurm's restart of it): resume
                resumed = cli("resume", run_dir, cwd=rnd.root)
                outputs[rnd.faults[max(i - 1, 0)]] += logs.new_text() + resumed.stdout + resumed.stderr
                if done_early := "already did all" in resumed.stdout:
                    break
                job = submitted_job(resumed)
            restarts = max((int(r.get("Restarts", 0)) for r in cluster.job_records(int(job))), default=0)
            try:
                placed = SLURM_FAULTS[fault](rnd, cluster, job, fault, after)
                break
            except JobEnded:  # before this fault's moment (a restart that failed to launch): resume, then try again
                continue
        else:
            rnd.fail(fault, "the job ended three times before this fault's moment")
        if done_early:
            for late in rnd.faults[i:]:
                rnd.fail(late, "the run was done before this fault's turn")
            break
        if placed is None:  # it could not be placed (its failure is recorded)
            for late in rnd.faults[i + 1 :]:
                rnd.fail(late, f"not injected: {fault} could not be")
            break
        hung_job = settle(cluster, job, restarts) is None
        # the newest checkpoint once the fault has settled, not the one it was placed after: a checkpoint written
        # in the fault's moment (scancel during a write that completed) would otherwise let the next fault's
        # checkpoint wait end at once, before the resumed job has started its ranks (ci22's 'no rank 0')
        after = max(placed, newest_checkpoint(run_dir))
        outputs[fault] += logs.new_text()
        if hung_job:
            break
    finished = False
    for _ in range(4):
        if hung_job:
            break
        try:
            cluster.wait_job(int(job), timeout=PHASE_BOUND_S)
        except TimeoutError:
            hung_job = True
            break
        resumed = cli("resume", run_dir, cwd=rnd.root)
        outputs[rnd.faults[-1]] += logs.new_text() + resumed.stdout + resumed.stderr
        if "already did all" in resumed.stdout:
            finished = True
            break
        job = submitted_job(resumed)
    if hung_job:
        rnd.hangs += 1
        rnd.notes.append(f"hang: job {job} still running after {PHASE_BOUND_S}s")
        cli("cancel", run_dir, cwd=rnd.root)
    check(rnd, reference, outputs, {}, {}, finished)


class LogCursor:
    """The text added to a run's Slurm job logs (logs/slurm-*.out|err) since the last call."""

    def __init__(self, logs: Path):
        self.logs, self.seen = logs, dict[Path, int]()

    def new_text(self) -> str:
        text = []
        for path in sorted(self.logs.glob("slurm-*")):
            data = path.read_bytes()
            text.append(data[self.seen.get(path, 0) :].decode(errors="replace"))
            self.seen[path] = len(data)
        return "".join(text)


def settle(cluster: SlurmCluster, job: str, restarts: int) -> str | None:
    """After a fault: "ended" once the job has ended, "restarted" once Slurm runs it again (requeued; it may still
    end soon after), None if neither within the time bound."""
    deadline = time.monotonic() + PHASE_BOUND_S
    while time.monotonic() < deadline:
        records = cluster.job_records(int(job))
        states = {r.get("JobState") for r in records}
        if not records or states <= TERMINAL_STATES:
            return "ended"
        if states == {"RUNNING"} and all(int(r.get("Restarts", 0)) > restarts for r in records):
            return "restarted"
        time.sleep(0.5)
    return None


class JobEnded(Exception):
    """The job ended while a fault waited for its moment."""


_CHECKPOINT = re.compile(r"^step-(\d+)(\.h5)?$")  # a committed checkpoint (a temp file or a set-aside one has more)


def newest_checkpoint(run_dir: Path) -> int:
    names = os.listdir(run_dir / "checkpoints") if (run_dir / "checkpoints").is_dir() else []
    return max((int(m[1]) for n in names if (m := _CHECKPOINT.match(n))), default=0)


def checkpoint_after(rnd: Round, cluster: SlurmCluster, job: str, fault: str, after: int) -> int | None:
    """Wait (within the time bound) for a checkpoint 1-2 checkpoints past step `after`; its step, or None (none
    came: recorded as the fault's failure). JobEnded if the job ends first."""
    target = after + CHECKPOINT_EVERY * rnd.rng.randint(1, 2)
    deadline, next_look = time.monotonic() + PHASE_BOUND_S, 0.0
    while (newest := newest_checkpoint(rnd.run_dir)) < target:
        if time.monotonic() > deadline:
            rnd.fail(fault, f"no checkpoint past step {target - 1} within {PHASE_BOUND_S}s")
            return None
        if time.monotonic() > next_look:  # scontrol is slow: a checkpoint must not be missed while it runs
            if cluster.job_state(int(job))[1]:
                raise JobEnded(job)
            next_look = time.monotonic() + 1
        time.sleep(0.05)
    return newest


def scancel_in_checkpoint(rnd: Round, cluster: SlurmCluster, job: str, fault: str, after: int) -> int | None:
    """scancel while a checkpoint is being written (its temp file exists), one or two checkpoints past `after`."""
    done = checkpoint_after(rnd, cluster, job, fault, after)
    if done is None:
        return None
    checkpoints, deadline, next_look = rnd.run_dir / "checkpoints", time.monotonic() + PHASE_BOUND_S, 0.0
    while time.monotonic() < deadline:  # no sleep: a write takes milliseconds
        writing = [n for n in os.listdir(checkpoints) if ".tmp-" in n]  # step-XXXXXXXX.h5.tmp-PID
        if writing:
            cluster.run("scancel", job, check=False)  # at once: a CLI start would miss the write
            if not (checkpoints / writing[0]).exists():
                rnd.notes.append(f"{fault}: the checkpoint write was done before scancel returned")
            return done
        if time.monotonic() > next_look:
            if cluster.job_state(int(job))[1]:
                break
            next_look = time.monotonic() + 1
    rnd.fail(fault, "never saw a checkpoint being written")
    return None


def kill9_rank(rnd: Round, cluster: SlurmCluster, job: str, fault: str, after: int) -> int | None:
    """kill -9 of the generator (world rank 0) or the trainer (rank 1) in the middle of a step."""
    done = checkpoint_after(rnd, cluster, job, fault, after)
    if done is None:
        return None
    time.sleep(rnd.rng.uniform(0.0, 0.5))
    rank = "0" if fault.endswith("generator") else "1"
    deadline = time.monotonic() + PHASE_BOUND_S
    while time.monotonic() < deadline:  # a job just requeued or resubmitted has not launched its ranks yet
        for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
            if "rollout_hpc.runtime.entry" in _cmdline(pid) and str(rnd.run_dir) in _cmdline(pid):
                if _environ(pid).get("PMIX_RANK") == rank:
                    os.kill(pid, signal.SIGKILL)
                    return done
        if cluster.job_state(int(job))[1]:
            raise JobEnded(job)
        time.sleep(0.2)
    rnd.fail(fault, f"no rank {rank} of the job to kill within {PHASE_BOUND_S}s")
    return None


def usr1_storm(rnd: Round, cluster: SlurmCluster, job: str, fault: str, after: int) -> int | None:
    """3-6 time-limit warnings (USR1 to the batch shell, as --signal=B:USR1 sends it) within half a second."""
    done = checkpoint_after(rnd, cluster, job, fault, after)
    if done is None:
        return None
    for _ in range(rnd.rng.randint(3, 6)):
        cluster.run("scancel", "--signal=USR1", "--batch", job, check=False)
        time.sleep(rnd.rng.uniform(0.0, 0.1))
    return done


def fail_a_node(rnd: Round, cluster: SlurmCluster, job: str, fault: str, after: int) -> int | None:
    """A node of the job crashes in the middle of a step: its slurmd, job steps and their processes are killed with
    -9 at once, and the node is set DOWN, as slurmctld does once the node has missed SlurmdTimeout (not waited for:
    60 s a fault). Slurm requeues the job (--requeue) onto the nodes left; once it runs again (or has ended) the node
    reboots (reboot()), back in service (ReturnToService=2)."""
    done = checkpoint_after(rnd, cluster, job, fault, after)
    if done is None:
        return None
    time.sleep(rnd.rng.uniform(0.0, 0.5))  # somewhere in a step
    records = cluster.job_records(int(job))
    owner = {r["JobId"]: hostnames(cluster, r["NodeList"]) for r in records}
    nodes_now = sorted({n for nodes in owner.values() for n in nodes})
    if not nodes_now:  # the job ended after that checkpoint (a slow machine's scontrol): resume, then try again
        raise JobEnded(job)
    node = rnd.rng.choice(nodes_now)
    restarts = max(int(r.get("Restarts", 0)) for r in records)
    crash(cluster, node, owner)
    cluster.run("scontrol", "update", f"nodename={node}", "state=down", "reason=chaos: node failure")
    rnd.notes.append(f"{fault}: {node} of {sorted(owner.values())} crashed")
    settle(cluster, job, restarts)  # the node stays down until Slurm has placed the job again (or it ended)
    reboot(cluster, node)
    return done


# The Slurm fault kinds: each waits for its moment (a checkpoint past the previous fault's), injects, and returns the
# newest checkpoint's step then (None: it could not, recorded as its failure).
SLURM_FAULTS = {
    "scancel-in-checkpoint": scancel_in_checkpoint,
    "node-fail": fail_a_node,
    "slurm-kill9-generator": kill9_rank,
    "slurm-kill9-trainer": kill9_rank,
    "slurm-usr1-storm": usr1_storm,
}


def hostnames(cluster: SlurmCluster, nodelist: str) -> list[str]:
    return cluster.run("scontrol", "show", "hostnames", nodelist).stdout.split()


def crash(cluster: SlurmCluster, node: str, owner: dict[str, list[str]]) -> None:
    """kill -9 of everything of `node`: its slurmd, and each slurmstepd of a job component on that node alone or
    with a process of that node below it, with all its descendants."""
    victims = [int((cluster.dir / "run" / f"slurmd.{node}.pid").read_text())]
    stepds = subprocess.run(["pgrep", "-f", "^slurmstepd: "], capture_output=True, text=True).stdout.split()
    for pid in map(int, stepds):
        tree = descendants(pid)
        job = re.search(r"\[(\d+)\.", _cmdline(pid))
        if (job and owner.get(job[1]) == [node]) or any(_environ(p).get("SLURMD_NODENAME") == node for p in tree):
            victims += [pid, *tree]
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def reboot(cluster: SlurmCluster, node: str) -> None:
    """What a reboot clears of the killed steps: their PMIx sockets and job directories in the node's spool, and
    its TmpFS (PMIx app directories: a restart of the same job on this node fails with "File exists" otherwise)."""
    spool, tmpfs = cluster.dir / "spool" / node, cluster.dir / "tmp" / node
    leftovers = [p for p in spool.iterdir() if p.name.startswith(("pmix.", "stepd.", "job"))]
    for leftover in leftovers + (list(tmpfs.iterdir()) if tmpfs.is_dir() else []):
        subprocess.run(["rm", "-rf", str(leftover)], check=False)
    subprocess.run(["slurmd", "-N", node, "-f", str(cluster.conf)], env=cluster.env, check=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state = cluster.run("sinfo", "-h", "-n", node, "-o", "%T", check=False).stdout.strip()
        if state and not state.startswith(("down", "drain", "fail")):
            return
        time.sleep(0.5)
    raise RuntimeError(f"chaos: node {node} did not come back after its reboot (sinfo: {state})")


def note_repair(rnd: Round, text: str) -> None:
    for a, b in re.findall(r"lost: the log rows of steps (\d+)\.\.(\d+)", text):
        rnd.declared_lost |= {
            (p // PROMPTS, p, k) for p in range(int(a) * PROMPTS, (int(b) + 1) * PROMPTS) for k in range(GROUP)
        }


def check(rnd: Round, reference: str, outputs: dict, seen: dict, segments: dict, finished: bool) -> None:
    run_dir = rnd.run_dir
    status: Counter = Counter()
    try:
        rnd.rows = logged_uids(run_dir)
        with TrajectoryReader(run_dir) as r:
            status = Counter(r.column("reward_status").tolist())
    except Exception as exc:  # noqa: BLE001 (an unreadable log loses everything: a finding)
        rnd.notes.append(f"cannot read the log: {exc}")
    for fault in rnd.faults:
        cause = {**CAUSES, **SLURM_CAUSES}[fault]
        if cause not in outputs.get(fault, ""):
            rnd.fail(fault, f"the output does not name the cause ({cause!r})")
    if not finished:
        for fault in rnd.faults:
            rnd.fail(fault, "the run did not finish")
        return
    if not set(rnd.faults) & COST_A_SAMPLE and weights_digest(run_dir) != reference:
        for fault in rnd.faults:
            rnd.fail(fault, "final weights differ from the uninterrupted run's")
    expected_errors = sum(f in COST_A_SAMPLE for f in rnd.faults)
    if sum(v for k, v in status.items() if k != 0) != expected_errors:
        rnd.notes.append(f"reward statuses {dict(status)}, expected {expected_errors} errors")
        for fault in rnd.faults:
            rnd.fail(fault, "unexpected reward errors in the log")
    temp = [str(p) for p in run_dir.rglob("*") if ".tmp" in p.name]
    rings = [str(p) for p in Path(DEFAULT_RING_DIR).glob(f"rollout-hpc.chaos{rnd.root.name}.*")]
    for fault in rnd.faults:
        left = temp + rings + sorted(s for s in segments.get(fault, ()) if Path(s).exists())
        alive = {pid for pid in seen.get(fault, ()) if "python" in _cmdline(pid) or "mpirun" in _cmdline(pid)}
        alive |= {pid for pid in map(int, filter(str.isdigit, os.listdir("/proc"))) if str(run_dir) in _cmdline(pid)}
        if left or alive:
            rnd.notes.append(f"{fault}: leftovers: files {left}, processes {sorted(alive)}")
            rnd.fail(fault, "leftover files or processes")


def _wait_until_gone(run_dir: Path, bound_s: float) -> None:
    """Until no process names the run directory on its command line (a previous start's ranks), at most bound_s."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if not any(str(run_dir) in _cmdline(pid) for pid in map(int, filter(str.isdigit, os.listdir("/proc")))):
            return
        time.sleep(0.2)


def _environ(pid: int) -> dict[str, str]:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(e.decode(errors="replace").split("=", 1) for e in env if b"=" in e)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--launcher", choices=["local", "slurm"], default="local")
    parser.add_argument(
        "--quick", action="store_true", help="every fault kind of the launcher in one run (local: two runs; CI)"
    )
    parser.add_argument("--faults", help="only these fault kinds (comma-separated; default: all of the launcher's)")
    parser.add_argument("--keep", action="store_true", help="keep the runs' directories")
    args = parser.parse_args(argv)
    cluster = None
    if args.launcher == "slurm":
        conf = os.environ.get("SLURM_CONF")
        if not conf or subprocess.run(["squeue", "-h"], capture_output=True).returncode != 0:
            print(
                "chaos: --launcher slurm needs a running Slurm cluster and SLURM_CONF naming its slurm.conf "
                "(the local one: tools/slurm_cluster.sh start, SLURM_CONF=/tmp/rollout-slurm/slurm.conf)",
                file=sys.stderr,
            )
            return 2
        cluster = SlurmCluster(dir=Path(conf).parent, conf=Path(conf), nodes=[], env=dict(os.environ))
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    kinds = [k for k in (SLURM_CAUSES if cluster else CAUSES) if os.geteuid() == 0 or k not in NEEDS_ROOT]
    if args.faults:
        unknown = set(args.faults.split(",")) - set(kinds)
        if unknown:
            parser.error(f"--faults: {sorted(unknown)} not among this launcher's kinds {kinds}")
        kinds = [k for k in kinds if k in args.faults.split(",")]
    if args.quick and cluster is not None:  # every Slurm kind, one after another in one run
        rng.shuffle(kinds)
        plans = [kinds]
    elif args.quick:  # everything that keeps the digest in one run, the sample-costing rewards in another
        rng.shuffle(kinds)
        plans = [[k for k in kinds if k not in COST_A_SAMPLE], [k for k in kinds if k in COST_A_SAMPLE]]
    else:
        plans = [[rng.choice(kinds)] for _ in range(args.rounds)]
    # enough steps for each fault's random step (1..2 past the last checkpoint) and the step lost to each stop; on
    # Slurm each fault waits for 1-2 checkpoints past the last one (scancel: and the write after that)
    per_fault = 3 if cluster is None else 3 * CHECKPOINT_EVERY
    steps = max(len(p) for p in plans) * per_fault + 2 * CHECKPOINT_EVERY
    work = Path(tempfile.mkdtemp(prefix="chaos-"))
    started = time.monotonic()
    reference = reference_digest(work, steps)
    rounds = []
    for i, plan in enumerate(plans):
        rnd = Round(faults=plan, root=work / str(i), steps=steps, rng=random.Random(rng.randrange(1 << 30)))
        rnd.root.mkdir()
        if "disk-full" in plan:
            (rnd.root / "fs").mkdir()
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(rnd.root / "fs")], check=True)
        try:
            if cluster is None:
                play(rnd, reference)
            else:
                play_slurm(rnd, reference, cluster)
        finally:
            if "disk-full" in plan:
                if args.keep:  # the tmpfs goes with the unmount: --keep keeps a copy of its run
                    subprocess.run(["cp", "-a", str(rnd.root / "fs"), str(rnd.root / "fs-kept")], check=False)
                subprocess.run(["umount", "-l", str(rnd.root / "fs")], check=False)
        rounds.append(rnd)
        for fault in plan:
            print(
                f"round {i} {fault}: {'FAILED ' + '; '.join(rnd.failed[fault]) if fault in rnd.failed else 'survived'}"
            )
        for note in rnd.notes:
            print(f"round {i}: {note}")
    print(f"chaos: seed {seed}, {time.monotonic() - started:.0f}s, runs in {work}", file=sys.stderr)
    result = summarize(rounds)
    if not args.keep and result["survived"] == result["faults_injected"]:
        subprocess.run(["rm", "-rf", str(work)], check=False)
    print(json.dumps(result))
    ok = result["samples_lost"] == 0 and result["hangs"] == 0 and result["survived"] == result["faults_injected"]
    return 0 if ok else 1


def summarize(rounds: list[Round]) -> dict:
    by_fault: dict[str, dict[str, int]] = {}
    lost = duplicates = declared = 0
    for rnd in rounds:
        for fault in rnd.faults:
            entry = by_fault.setdefault(fault, {"injected": 0, "survived": 0})
            entry["injected"] += 1
            entry["survived"] += fault not in rnd.failed
        rows = rnd.rows
        expected = {(p // PROMPTS, p, k) for p in range(rnd.steps * PROMPTS) for k in range(GROUP)}
        duplicates += len(rows) - len(set(rows))
        missing = expected - set(rows)
        declared += len(missing & rnd.declared_lost)
        lost += len(missing - rnd.declared_lost)
    return {
        "faults_injected": sum(e["injected"] for e in by_fault.values()),
        "survived": sum(e["survived"] for e in by_fault.values()),
        "samples_lost": lost,
        "duplicates": duplicates,
        "declared_lost": declared,  # log rows of trained steps a damaged log lost, named by the repair line
        "hangs": sum(r.hangs for r in rounds),
        "by_fault": by_fault,
    }


if __name__ == "__main__":
    sys.exit(main())
