"""How often a thread probes MPI for a message its rank is waiting for.

MPI has no wait that sleeps (a blocking probe spins a core), so the exchange's receiver thread and the weight sync's
receiver thread poll: probe, sleep, probe. Each wake-up takes a core from the rank's compute for a moment, and where
ranks share cores (colocated, or any node with more threads than cores) that stalls a whole OpenMP team, which waits
for its slowest thread. Probing every 50-100 us through a whole phase of the other role cost about 1,000 context
switches a step on the quickstart's colocated run (2 cores; the plain loop: 3).

Phases repeat, so a message comes about as long after a wait starts as it did last time: the pacer sleeps coarsely
until most of the last wait has passed, then probes finely. The first wait, and any message later than expected,
gets fine probes (the latency of today's polling); a message that comes early waits at most one coarse sleep.
"""

from __future__ import annotations

import time


class ArrivalPacer:
    """pacer.start() when a wait begins, pacer.next() -> seconds to sleep before the next probe, pacer.arrived() when
    the message came (its wait's length paces the next wait)."""

    def __init__(self, fine: float = 50e-6, coarse: float = 1e-3, lead: float = 0.75):
        self.fine, self.coarse, self.lead = fine, coarse, lead
        self.last = 0.0  # length of the last completed wait (0: none yet, probe finely)
        self.t0: float | None = None

    def start(self) -> None:
        if self.t0 is None:
            self.t0 = time.monotonic()

    def next(self) -> float:
        if self.t0 is None:
            return self.fine
        early = self.lead * self.last - (time.monotonic() - self.t0)  # until most of the last wait has passed
        return min(self.coarse, early) if early > self.fine else self.fine

    def arrived(self) -> None:
        if self.t0 is not None:
            self.last = time.monotonic() - self.t0
            self.t0 = None

    def cancel(self) -> None:
        """The wait ended without the message (the waiter gave up): keep the last length."""
        self.t0 = None
