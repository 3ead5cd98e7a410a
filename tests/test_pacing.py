"""exchange/pacing.ArrivalPacer: fine probes for the first wait and once most of the last wait has passed, coarse
sleeps before that; a wait given up keeps the last length."""

from __future__ import annotations

import pytest

from rollout_hpc.exchange import pacing
from rollout_hpc.exchange.pacing import ArrivalPacer


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(pacing.time, "monotonic", lambda: now[0])
    return now


def test_probes_are_fine_until_a_wait_has_been_seen(clock):
    pacer = ArrivalPacer(fine=50e-6, coarse=1e-3, lead=0.75)
    assert pacer.next() == 50e-6  # not waiting
    pacer.start()
    clock[0] += 0.01
    assert pacer.next() == 50e-6  # the first wait: nothing to go by
    clock[0] += 0.03
    pacer.arrived()
    assert pacer.last == pytest.approx(0.04)


def test_coarse_sleeps_until_most_of_the_last_wait_has_passed_then_fine(clock):
    pacer = ArrivalPacer(fine=50e-6, coarse=1e-3, lead=0.75)
    pacer.last = 0.04  # the last wait: 40 ms, so probe finely from 30 ms on
    pacer.start()
    assert pacer.next() == 1e-3
    clock[0] += 0.0295
    assert pacer.next() == pytest.approx(0.0005)  # never past the point where fine probes start
    clock[0] += 0.0005
    assert pacer.next() == 50e-6
    clock[0] += 0.02  # later than expected: still fine probes
    assert pacer.next() == 50e-6
    pacer.arrived()
    assert pacer.last == pytest.approx(0.05)


def test_start_during_a_wait_keeps_its_beginning_and_cancel_keeps_the_last_length(clock):
    pacer = ArrivalPacer(fine=50e-6, coarse=1e-3, lead=0.75)
    pacer.last = 0.04
    pacer.start()
    clock[0] += 0.01
    pacer.start()  # called on every probe of one wait
    clock[0] += 0.02
    assert pacer.next() == 50e-6  # 30 ms of a 40 ms wait: fine from here
    pacer.cancel()  # the waiter gave up: no arrival to learn from
    assert pacer.last == 0.04 and pacer.t0 is None
    assert pacer.next() == 50e-6


def test_once_a_message_came_after_a_ring_the_bell_is_trusted_until_one_comes_without(clock):
    pacer = ArrivalPacer(fine=50e-6, coarse=1e-3, lead=0.75, trusted=20e-3, after_ring=2e-3)
    pacer.last = 0.04
    assert pacer.idle(2e-3) == 2e-3  # no ring seen yet: the caller's idle back-off
    pacer.start()
    clock[0] += 0.035
    pacer.rung()  # the sender rang (just before its send): fine probes for a moment
    assert pacer.next() == 50e-6
    clock[0] += 0.0001
    pacer.arrived()
    assert pacer.bell_trusted
    assert pacer.idle(2e-3) == 20e-3  # nobody waits: long sleeps, a ring ends them
    pacer.start()
    clock[0] += 0.035  # past the last wait's 75 %: still the trusted sleep
    assert pacer.next() == 20e-3
    pacer.rung()
    assert pacer.next() == 50e-6 and pacer.idle(2e-3) == 50e-6
    clock[0] += 0.003  # a ring with nothing behind it (a stray one): back to the trusted sleep
    assert pacer.next() == 20e-3
    clock[0] += 0.001
    pacer.arrived()  # rung since the last message: still trusted
    assert pacer.bell_trusted
    pacer.start()
    clock[0] += 0.01
    pacer.arrived()  # no ring before it (a sender on another node): pace by the last wait again
    assert not pacer.bell_trusted and pacer.idle(2e-3) == 2e-3
    pacer.start()
    assert pacer.next() == 1e-3  # the last wait was 10 ms: coarse sleeps until 7.5 ms ...
    clock[0] += 0.008
    assert pacer.next() == 50e-6  # ... then fine probes


def test_a_message_between_waits_counts_for_trust_but_not_for_the_wait_length(clock):
    pacer = ArrivalPacer(fine=50e-6, coarse=1e-3, lead=0.75, trusted=20e-3, after_ring=2e-3)
    pacer.last = 0.04
    pacer.rung()
    clock[0] += 0.5
    pacer.arrived()  # nobody waited for it
    assert pacer.bell_trusted and pacer.last == 0.04
