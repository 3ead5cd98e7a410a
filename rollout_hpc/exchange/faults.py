"""Fault injection for tests: `ROLLOUT_INJECT_FAULT=POINT[@N]` makes the N-th pass (default 1st) of a named point
raise `InjectedFault` in whatever thread runs it.

Points: `forwarder` (generator node leader's exchange thread, per batch sent), `receiver` (trainer node leader's
exchange thread, per batch received), `weight-sync` (generator's weight receiver thread, per version received),
`reward-sender` (generator's reward sender thread, per batch). The run's reaction to a failing thread is the
product's (docs/resume.md "Hangs and failing threads"); this only makes the failure happen on demand. Several
points: comma-separated. Unset: one dictionary lookup per pass.
"""

from __future__ import annotations

import os
import threading

_passes: dict[str, int] = {}
_lock = threading.Lock()


class InjectedFault(RuntimeError):
    """Raised at a fault point named by ROLLOUT_INJECT_FAULT."""


def fault_point(name: str) -> None:
    spec = os.environ.get("ROLLOUT_INJECT_FAULT")
    if not spec:
        return
    for item in spec.split(","):
        point, _, nth = item.strip().partition("@")
        if point != name:
            continue
        with _lock:
            _passes[name] = n = _passes.get(name, 0) + 1
        if n == int(nth or 1):
            raise InjectedFault(f"injected fault at '{name}' (pass {n}, ROLLOUT_INJECT_FAULT={spec})")
