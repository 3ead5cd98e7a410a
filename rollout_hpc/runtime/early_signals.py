"""Stop signals that reach a rank while it starts, kept until its program listens for them.

A rank's program installs its SIGUSR1/SIGTERM handlers (runtime/checkpointing.install_stop_handlers) only after the
imports (torch: seconds) and MPI start-up. Until then USR1's default action would kill the rank, and Slurm sends the
time-limit warning to every task of the step whenever it comes: a job step started just before its warning ended
with "task 0: User defined signal 1" (exit 138) and no requeue (seen in the Slurm fault-injection suite, a storm of
warnings on a job that had just started). `hold()`, the first thing the entry point does, records them instead;
`take()` hands them to the program's handlers, which act on them at the first step boundary (checkpoint, exit 75).
Imports nothing heavy: the earlier it runs, the shorter the window in which a signal still kills the rank.
"""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
_pending: list[int] = []


def _record(signum, _frame) -> None:
    _pending.append(signum)


def hold() -> None:
    """Record SIGUSR1/SIGTERM from now on, until the program installs its own handlers."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _record)


def take() -> list[int]:
    """The stop signals recorded since hold(), oldest first; the record is emptied."""
    got = list(_pending)
    _pending.clear()
    return got
