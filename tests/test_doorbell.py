"""exchange/doorbell: a ring from another process ends a waiter's sleep at once; set() wakes it from its own
process; a name already taken still gives a doorbell that set() wakes; ringing a name nobody holds is no error.
Real sockets, a real second process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from rollout_hpc.exchange.doorbell import Doorbell, Ringer, bell_name


def _name(tag: str) -> str:
    return bell_name(f"test{os.getpid()}", tag, 0)


def test_a_ring_from_another_process_ends_the_sleep():
    bell = Doorbell(_name("cross"))
    assert bell.bound and bell.wait(0.001) == (False, False)
    ringer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from rollout_hpc.exchange.doorbell import Ringer; "
            "r = Ringer([sys.argv[1]]); time.sleep(0.3); r.ring()",
            _name("cross"),
        ]
    )
    try:
        t0 = time.monotonic()
        assert bell.wait(30) == (True, True)  # woken, and by a sender's ring
        assert time.monotonic() - t0 < 10  # the ring, not the 30 s timeout, ended it
        assert bell.wait(0.001) == (False, False)  # drained
    finally:
        ringer.wait(30)
        bell.close()


def test_set_wakes_without_a_ring_and_a_short_wait_still_sees_a_pending_ring():
    bell = Doorbell(_name("local"))
    try:
        bell.set()
        bell.set()
        assert bell.wait(1) == (True, False)
        assert bell.wait(0.001) == (False, False)  # both wake-ups drained at once
        Ringer([_name("local")]).ring()
        assert bell.wait(50e-6) == (True, True)  # a sub-millisecond wait sleeps, then drains
    finally:
        bell.close()


def test_a_taken_name_falls_back_to_waking_its_own_process_only():
    first, second = Doorbell(_name("taken")), Doorbell(_name("taken"))
    try:
        assert first.bound and not second.bound
        second.set()
        assert second.wait(1) == (True, False) and first.wait(0.001) == (False, False)
        Ringer([_name("taken")]).ring()
        assert first.wait(1) == (True, True) and second.wait(0.001) == (False, False)
    finally:
        first.close()
        second.close()


def test_ringing_nobody_is_no_error_and_is_not_retried():
    bell = Doorbell(_name("there"))
    ringer = Ringer([_name("nobody"), _name("there")])
    try:
        ringer.ring()
        ringer.ring()
        assert ringer.absent == {0}  # the peer on another host (or gone): its probes find the sends anyway
        assert bell.wait(1) == (True, True)
    finally:
        ringer.close()
        bell.close()


def test_rollout_doorbell_0_turns_the_rings_off(monkeypatch):
    bell = Doorbell(_name("off"))
    monkeypatch.setenv("ROLLOUT_DOORBELL", "0")
    ringer = Ringer([_name("off")])
    try:
        ringer.ring()
        assert bell.wait(0.01) == (False, False)  # the waiter keeps its probe timing alone
        bell.set()
        assert bell.wait(1) == (True, False)  # its own process still wakes it
    finally:
        ringer.close()
        bell.close()
