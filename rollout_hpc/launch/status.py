"""Where a run's jobs stand: state of each Slurm het component (nodes, restart count), or of a local run.

`scontrol show job` is asked first: it answers without accounting (slurmdbd) and knows the restart
count, but only while slurmctld still holds the job (MinJobAge, 5 minutes by default, after it
ends). After that, `sacct` answers where accounting is enabled.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from rollout_hpc.config import load_config
from rollout_hpc.errors import UserError
from rollout_hpc.rundir_layout import CHECKPOINTS, RESOLVED_CONFIG

ROLES = ("generator", "trainer")  # het components 0 and 1; a config's cfg.het_groups names any after them


def _role(roles: Sequence[str], offset: int) -> str:
    return roles[offset] if offset < len(roles) else f"component {offset}"


# States after which Slurm will not run the job again by itself (UNKNOWN: it has forgotten the job).
ENDED = {
    "COMPLETED",
    "CANCELLED",
    "FAILED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
    "OUT_OF_MEMORY",
    "UNKNOWN",
}
_FIELD = re.compile(r"(\S+?)=(.*?)(?= \S+?=|$)")


@dataclass
class ComponentState:
    job_id: str  # e.g. 1234+0 for component 0 of het job 1234
    role: str
    state: str
    nodes: str
    restarts: str
    reason: str
    source: str  # scontrol | sacct | none

    def to_dict(self) -> dict:
        return asdict(self)


def _run(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return None
    return done.stdout if done.returncode == 0 and done.stdout.strip() else None


def parse_scontrol(text: str) -> list[dict[str, str]]:
    """`scontrol -o show job` prints one line of Key=Value pairs per het component."""
    return [dict(_FIELD.findall(line.strip())) for line in text.splitlines() if line.strip()]


def _from_scontrol(job_id: str, roles: Sequence[str]) -> list[ComponentState] | None:
    out = _run(["scontrol", "-o", "show", "job", job_id])
    if out is None:
        return None
    states = []
    for fields in parse_scontrol(out):
        offset = int(fields.get("HetJobOffset", "0") or 0)
        shown = f"{job_id}+{offset}" if "HetJobOffset" in fields else fields.get("JobId", job_id)
        states.append(
            ComponentState(
                job_id=shown,
                role=_role(roles, offset),
                state=fields.get("JobState", "?"),
                nodes=fields.get("NodeList", "") if fields.get("NodeList") not in (None, "(null)") else "",
                restarts=fields.get("Restarts", "?"),
                reason=fields.get("Reason", "") if fields.get("Reason") != "None" else "",
                source="scontrol",
            )
        )
    return states


def _from_sacct(job_id: str, roles: Sequence[str]) -> list[ComponentState] | None:
    out = _run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "JobID,State,NodeList,Reason"])
    if out is None:
        return None
    states = []
    for line in out.splitlines():
        jid, state, nodes, reason = (line.split("|") + ["", "", "", ""])[:4]
        offset = int(jid.partition("+")[2] or 0)
        states.append(
            ComponentState(
                jid,
                _role(roles, offset),
                state,
                nodes,
                "?",
                "" if reason == "None" else reason,
                "sacct",
            )
        )
    return states or None


def run_roles(run_dir: str | Path) -> Sequence[str]:
    """The roles of a run's het components, in order (from its resolved config; the first two without one). A
    colocated run's job has one component, each node running both groups."""
    try:
        cfg = load_config(Path(run_dir) / RESOLVED_CONFIG)
        if cfg.placement == "colocated":
            return ["generator+trainer"]
        return [role for role, _, _ in cfg.het_groups]
    except (OSError, UserError):
        return ROLES


def job_states(job_id: str, roles: Sequence[str] = ROLES) -> list[ComponentState]:
    """Each het component's state; roles name the components in order ([role for role, _, _ in cfg.het_groups])."""
    return (
        _from_scontrol(job_id, roles)
        or _from_sacct(job_id, roles)
        or [
            ComponentState(
                job_id, "-", "UNKNOWN", "", "?", "no longer known to slurmctld, and sacct has no record", "none"
            )
        ]
    )


def local_state(record: dict) -> str:
    """A local (mpirun) run from its manifest record: ENDED (exit N), RUNNING, RUNNING? (another host), or LOST."""
    if record.get("exit_code") is not None:
        return f"ENDED (exit {record['exit_code']})"
    if record.get("host") != os.uname().nodename:
        return f"RUNNING? (on {record.get('host')})"
    if not _process_alive(record["pid"]):
        return "LOST (the launcher died without recording an exit code)"
    return "RUNNING"


def _process_alive(pid: int) -> bool:
    """pid runs (a zombie does not: an mpirun killed with its launcher waits, dead, until something reaps it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc (not Linux): trust kill()
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


@dataclass
class TrainingProgress:
    """How far training got, from the run directory's files (no Slurm, no torch): the steps in the
    trajectory log's metrics table, the run's total from its config, the newest published checkpoint."""

    steps_done: int | None  # the last logged step + 1 (0-based steps); None: no trajectory log yet
    total_steps: int | None  # None: no readable config.resolved.yaml
    checkpoint_step: int | None  # None: no checkpoint yet
    checkpoint_age_s: float | None
    log: str  # the log's state (closed cleanly, being written, cut) or why it could not be read

    def to_dict(self) -> dict:
        return asdict(self)


def training_progress(run_dir: str | Path) -> TrainingProgress:
    # In here: h5py (the CLI imports every command module, and this one with `status`, at start).
    from rollout_hpc.store.trajlog import TrajectoryLogError, TrajectoryReader, log_path

    run_dir = Path(run_dir)
    try:
        total: int | None = load_config(run_dir / RESOLVED_CONFIG, []).total_steps
    except UserError:
        total = None
    done, log = None, "no trajectories.h5 yet (training has not started)"
    if log_path(run_dir).is_file():
        try:
            with TrajectoryReader(run_dir, warn=False) as reader:
                steps, log = reader.metrics().get("step"), reader.status_line()
            done = int(steps.max()) + 1 if steps is not None and len(steps) else 0
        except (TrajectoryLogError, KeyError, OSError) as exc:  # being created by the trainer right now
            log = f"unreadable right now: {exc}"
    step, age = _newest_checkpoint(run_dir)
    return TrainingProgress(done, total, step, age, log)


# store.checkpoint's published names: step-NNNNNNNN.h5, or a sharded step-NNNNNNNN/ once its manifest.json is
# there. Matched here by name: importing store.checkpoint pulls torch (store.h5tree), seconds on a login node.
_PUBLISHED = re.compile(r"^step-(\d{8})(\.h5)?$")


def _newest_checkpoint(run_dir: Path) -> tuple[int | None, float | None]:
    """(step, age in seconds) of the newest published checkpoint, (None, None) when there is none."""
    published = []
    for entry in (run_dir / CHECKPOINTS).glob("step-*"):
        if (m := _PUBLISHED.match(entry.name)) and (m.group(2) or (entry / "manifest.json").is_file()):
            published.append((int(m.group(1)), entry))
    if not published:
        return None, None
    step, path = max(published)
    try:
        return step, time.time() - path.stat().st_mtime
    except OSError:  # pruned by checkpoint.keep_last meanwhile
        return step, None
