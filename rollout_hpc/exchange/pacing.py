"""How often a thread probes MPI for a message its rank is waiting for.

MPI has no wait that sleeps (a blocking probe spins a core), so the exchange's receiver thread and the weight sync's
receiver thread poll: probe, sleep, probe. Each wake-up takes a core from the rank's compute for a moment, and where
ranks share cores (colocated, or any node with more threads than cores) that stalls a whole OpenMP team, which waits
for its slowest thread. Probing every 50-100 us through a whole phase of the other role cost about 1,000 context
switches a step on the quickstart's colocated run (2 cores; the plain loop: 3).

Phases repeat, so a message comes about as long after a wait starts as it did last time: the pacer sleeps coarsely
until most of the last wait has passed, then probes finely. The first wait, and any message later than expected,
gets fine probes (the latency of today's polling); a message that comes early waits at most one coarse sleep.

Where the sender shares the host, it rings the waiter's doorbell (exchange/doorbell.py) just before it sends. Once a
message came with a ring before it, the pacer trusts the bell: it sleeps `trusted` between probes, waiting or not
(the ring ends the sleep), with fine probes for `after_ring` after each ring (the send follows the ring); a message
that comes without one (a sender on another node) turns the pacing by the last wait back on.
"""

from __future__ import annotations

import time


class ArrivalPacer:
    """pacer.start() when a wait begins, pacer.next() -> seconds to sleep before the next probe, pacer.arrived() when
    a message came (a waited-for one's wait paces the next wait); pacer.rung() when the doorbell rang; outside a wait,
    pacer.idle(delay) -> the sleep instead of `delay`."""

    def __init__(
        self,
        fine: float = 50e-6,
        coarse: float = 1e-3,
        lead: float = 0.75,
        trusted: float = 20e-3,
        after_ring: float = 2e-3,
    ):
        self.fine, self.coarse, self.lead, self.trusted, self.after_ring = fine, coarse, lead, trusted, after_ring
        self.last = 0.0  # length of the last completed wait (0: none yet, probe finely)
        self.t0: float | None = None
        self.bell_trusted = False  # the last message came with a doorbell ring before it
        self.rung_at: float | None = None  # when the latest ring since the last message came

    def start(self) -> None:
        if self.t0 is None:
            self.t0 = time.monotonic()

    def _just_rung(self, now: float) -> bool:
        return self.rung_at is not None and now - self.rung_at < self.after_ring

    def next(self) -> float:
        if self.t0 is None:
            return self.fine
        now = time.monotonic()
        if self._just_rung(now):
            return self.fine  # the message is there or about to be
        if self.bell_trusted:
            return self.trusted
        early = self.lead * self.last - (now - self.t0)  # until most of the last wait has passed
        return min(self.coarse, early) if early > self.fine else self.fine

    def idle(self, delay: float) -> float:
        """The sleep between probes while nobody waits: `delay`, longer while the bell is trusted."""
        if self._just_rung(time.monotonic()):
            return self.fine
        return max(delay, self.trusted) if self.bell_trusted else delay

    def rung(self) -> None:
        """A sender rang this thread's doorbell."""
        self.rung_at = time.monotonic()

    def arrived(self) -> None:
        """A message came (waited for or not)."""
        if self.t0 is not None:
            self.last = time.monotonic() - self.t0
            self.t0 = None
        self.bell_trusted, self.rung_at = self.rung_at is not None, None

    def cancel(self) -> None:
        """The wait ended without the message (the waiter gave up): keep the last length."""
        self.t0 = None
