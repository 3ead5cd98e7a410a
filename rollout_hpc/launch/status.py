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
from dataclasses import asdict, dataclass

ROLES = {0: "generator", 1: "trainer"}
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


def _from_scontrol(job_id: str) -> list[ComponentState] | None:
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
                role=ROLES.get(offset, f"component {offset}"),
                state=fields.get("JobState", "?"),
                nodes=fields.get("NodeList", "") if fields.get("NodeList") not in (None, "(null)") else "",
                restarts=fields.get("Restarts", "?"),
                reason=fields.get("Reason", "") if fields.get("Reason") != "None" else "",
                source="scontrol",
            )
        )
    return states


def _from_sacct(job_id: str) -> list[ComponentState] | None:
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
                ROLES.get(offset, f"component {offset}"),
                state,
                nodes,
                "?",
                "" if reason == "None" else reason,
                "sacct",
            )
        )
    return states or None


def job_states(job_id: str) -> list[ComponentState]:
    return (
        _from_scontrol(job_id)
        or _from_sacct(job_id)
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
    try:
        os.kill(record["pid"], 0)
    except ProcessLookupError:
        return "LOST (the launcher died without recording an exit code)"
    except PermissionError:
        pass
    return "RUNNING"
