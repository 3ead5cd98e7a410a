"""The ring with real processes: many producers and consumers, SIGKILL mid-record,
a consumer killed while holding a view, and reopening after every process died."""

from __future__ import annotations

import os
import random
import signal
import struct
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest
from test_ring_workers import check_record

from rollout_hpc.exchange.ring import Ring, RingClosed, RingTimeout, ring_path

WORKERS = str(Path(__file__).with_name("test_ring_workers.py"))


def start(*args) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.Popen([sys.executable, WORKERS, *map(str, args)], stdout=subprocess.PIPE, text=True, env=env)


def wait_line(proc: subprocess.Popen, prefix: str) -> str:
    line = proc.stdout.readline()
    assert line.startswith(prefix), f"worker said {line!r} (exit code {proc.poll()})"
    return line


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()


def read_pairs(path) -> list[tuple[int, int]]:
    data = Path(path).read_bytes()
    return [struct.unpack_from("<II", data, i) for i in range(0, len(data), 8)]


def read_log(path) -> set[int]:
    if not os.path.exists(path):
        return set()
    data = Path(path).read_bytes()
    return set(struct.unpack(f"<{len(data) // 4}I", data[: len(data) // 4 * 4]))


@pytest.fixture
def path(tmp_path):
    p = ring_path(
        "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path), "pytest", os.getpid(), "node0", tmp_path.name
    )
    yield p
    if os.path.exists(p):
        os.unlink(p)


def test_many_producers_and_consumers_deliver_each_record_once(path, tmp_path):
    producers, per_producer = 3, 1200
    ring = Ring.create(path, 256 << 10)  # small: forces wrap-around and full-ring waits
    consumers = [start("consumer", path, tmp_path / f"c{i}", style) for i, style in enumerate(["pop", "many", "view"])]
    prods = [start("producer", path, p, per_producer, 20_000) for p in range(producers)]
    for p in prods:
        assert p.wait(timeout=120) == 0
    ring.close()
    for c in consumers:
        assert c.wait(timeout=120) == 0
    per_consumer = [read_pairs(tmp_path / f"c{i}") for i in range(len(consumers))]
    counts = Counter(pair for got in per_consumer for pair in got)
    assert set(counts) == {(p, s) for p in range(producers) for s in range(per_producer)}
    assert max(counts.values()) == 1, "a record was delivered twice"
    for got in per_consumer:  # FIFO per producer, as seen by each consumer
        for p in range(producers):
            seqs = [s for q, s in got if q == p]
            assert seqs == sorted(seqs)
    s = ring.stats()
    assert s["records_in"] == s["records_out"] == producers * per_producer
    assert s["fill_bytes"] == 0 and s["high_water_bytes"] > (128 << 10)


class Drain(threading.Thread):
    """Consumes in the background, checking every record, until the ring is closed."""

    def __init__(self, ring: Ring):
        super().__init__(daemon=True)
        self.ring, self.got, self.error = ring, Counter(), None

    def run(self):
        try:
            while True:
                try:
                    for rec in self.ring.pop_many(8, timeout=0.2):
                        self.got[check_record(rec)] += 1
                except RingTimeout:
                    continue
        except RingClosed:
            pass
        except BaseException as e:  # reported by the test
            self.error = e


def test_producers_sigkilled_mid_record_lose_no_committed_record(path, tmp_path):
    ring = Ring.create(path, 8 << 20)
    drain = Drain(ring)
    drain.start()
    rng = random.Random(1234)
    logs, forced = {}, 0
    for i in range(20):
        if i % 4 == 3:  # deterministic: dies with a half-written 1 MiB record reserved
            proc = start("die_mid_write", path, 1 << 20)
            proc.wait(timeout=60)
            proc.stdout.close()
            assert proc.returncode == -signal.SIGKILL
            forced += 1
            continue
        logs[i] = tmp_path / f"log{i}"
        proc = start("producer", path, i, -1, 2 << 20, logs[i])  # records up to 2 MiB, forever
        wait_line(proc, "ready")
        threading.Event().wait(rng.uniform(0.0, 0.15))
        kill(proc)
    # The ring is still fully usable by a new producer.
    last = start("producer", path, 99, 30, 4096, tmp_path / "log99")
    assert last.wait(timeout=60) == 0
    ring.close()
    drain.join(timeout=60)
    assert drain.error is None, drain.error
    assert max(drain.got.values()) == 1, "a record was delivered twice"
    for i, log in logs.items():
        committed = read_log(log)
        received = {s for p, s in drain.got if p == i}
        assert committed <= received, f"producer {i}: committed records lost: {sorted(committed - received)[:5]}"
    assert {s for p, s in drain.got if p == 99} == set(range(30))
    s = ring.stats()
    assert s["reclaimed_slots"] >= forced
    assert s["fill_bytes"] == 0


def test_consumer_killed_holding_a_view_gets_its_record_redelivered(path):
    ring = Ring.create(path, 1 << 20)
    from test_ring_workers import make_record

    for seq in range(3):
        ring.push(make_record(7, seq, 1000))
    holder = start("hold_view", path)
    held = tuple(int(x) for x in wait_line(holder, "holding").split()[1:])
    assert held == (7, 0)
    assert ring.stats()["consumers"] == 1  # the holder (this process has not popped yet)
    kill(holder)
    got = [check_record(ring.pop(timeout=10)) for _ in range(3)]
    assert sorted(got) == [(7, 0), (7, 1), (7, 2)]
    s = ring.stats()
    assert s["requeued_claims"] == 1 and s["fill_bytes"] == 0
    with pytest.raises(RingTimeout):
        ring.pop(timeout=0.05)


def test_reopen_after_every_process_died_recovers_committed_records(path, tmp_path):
    Ring.create(path, 4 << 20)  # handle dropped at once: nobody in this process keeps it open
    producer = start("producer", path, 1, 100, 10_000)
    assert producer.wait(timeout=60) == 0
    holder = start("hold_view", path)
    wait_line(holder, "holding")
    kill(holder)
    half_writer = start("die_mid_write", path, 50_000)
    half_writer.wait(timeout=60)
    half_writer.stdout.close()

    ring = Ring.open(path)
    got = Counter()
    while True:
        try:
            got[check_record(ring.pop(timeout=0.5))] += 1
        except RingTimeout:
            break
    assert got == Counter({(1, s): 1 for s in range(100)})
    s = ring.stats()
    assert s["requeued_claims"] == 1 and s["reclaimed_slots"] == 1 and s["fill_bytes"] == 0
    ring.push(b"still usable")
    assert ring.pop(timeout=5) == b"still usable"
