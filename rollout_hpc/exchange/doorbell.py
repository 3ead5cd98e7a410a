"""A doorbell: wakes a thread that polls MPI, from any process on its host (its own included).

MPI has no wait that sleeps, so a receiver thread probes and sleeps in between (exchange/pacing.py). When the sender
runs on the same host (a colocated node, the local launcher), it can say "I just sent" at once: each waiting thread
owns a Linux abstract-namespace UNIX datagram socket named after the job, the link and its world rank; the sender
`ring()`s it just before posting its MPI send, and the waiter's sleep (a `poll()` on the socket) ends there.

The doorbell only shortens sleeps: what arrived is always found by the MPI probe, so a ring that never comes (the
sender on another node), a ring lost (a full socket queue: one was already pending) or a stray one (any process of
the host may send to an abstract socket: a spurious wake-up, nothing more) changes latency, never what is received.
If the name is taken (another process bound it first), the doorbell works for its own process only (`set()`).
"""

from __future__ import annotations

import os
import select
import socket
import time

_LOCAL, _REMOTE = b"L", b"R"  # set() by a thread of this process; ring() by a sender


def bell_name(job_id: str, link: str, world_rank: int) -> str:
    return f"rollout-hpc.{job_id}.{link}.{world_rank}"


class Doorbell:
    """The waiting side. `wait(timeout)` -> (woken, rung): woken by anything, rung by a sender's ring()."""

    def __init__(self, name: str) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.bind("\0" + name)
            self.sock, self._local, self._local_to = (
                sock,
                socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM),
                sock.getsockname(),
            )
        except OSError:  # the name is taken: set() still works, through a socket pair of our own
            sock.close()
            self.sock, self._local = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._local_to = None
        self.bound = self._local_to is not None
        self.sock.setblocking(False)
        self._local.setblocking(False)
        self._poll = select.poll()
        self._poll.register(self.sock, select.POLLIN)

    def set(self) -> None:
        """Wake the waiter from this process (what threading.Event.set does for it)."""
        try:
            if self._local_to is not None:
                self._local.sendto(_LOCAL, self._local_to)
            else:
                self._local.send(_LOCAL)
        except OSError:  # queue full: a wake-up is pending already
            pass

    def wait(self, timeout: float) -> tuple[bool, bool]:
        """Sleep until woken or `timeout` seconds passed; drains every pending wake-up."""
        if timeout < 1e-3:  # poll() counts whole milliseconds; a ring matters little in a sleep this short
            time.sleep(max(timeout, 0.0))
        elif not self._poll.poll(int(timeout * 1e3)):
            return False, False
        woken = rung = False
        while True:
            try:
                rung |= self.sock.recv(8) == _REMOTE
                woken = True
            except BlockingIOError:
                return woken, rung

    def close(self) -> None:
        self.sock.close()
        self._local.close()


class Ringer:
    """The sending side: rings the doorbells of a fixed set of names (the peers that may wait for its sends); rings
    nothing under ROLLOUT_DOORBELL=0."""

    def __init__(self, names: list[str]) -> None:
        self.on = enabled()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self.addresses = ["\0" + n for n in names]
        self.absent: set[int] = set()  # peers with no doorbell on this host: not tried again

    def ring(self, which: int | None = None) -> None:
        """Ring peer `which` (an index into the names), or all."""
        if not self.on:
            return
        for i in range(len(self.addresses)) if which is None else (which,):
            if i in self.absent:
                continue
            try:
                self.sock.sendto(_REMOTE, self.addresses[i])
            except (ConnectionRefusedError, FileNotFoundError):
                self.absent.add(i)  # on another host, or gone: its probes find our sends anyway
            except OSError:  # its queue is full: a ring is pending already
                pass

    def close(self) -> None:
        self.sock.close()


def enabled() -> bool:
    """ROLLOUT_DOORBELL=0 turns the doorbells off (for measuring what they save)."""
    return os.environ.get("ROLLOUT_DOORBELL", "1") != "0"
