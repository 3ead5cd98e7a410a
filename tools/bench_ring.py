#!/usr/bin/env python
"""Benchmark of the shared-memory ring against the physical limit and Python's own options.

For 64 B, 4 KiB, 256 KiB and 4 MiB records, with 1 producer/1 consumer and 2/2 processes:
  ring         rollout_hpc ring, push(bytes) -> pop() -> bytes (copy in, copy out)
  ring_view    push(bytes) -> pop_view(): the record read in place (no copy out)
  (both ring consumers read each record's first 8 bytes, as a consumer that routes or unpacks records does)
  ring_batch   push_many / pop_many of 256 (64 B and 4 KiB)
  mp_queue     multiprocessing.Queue (pickle + pipe)
  shm_queue    multiprocessing.shared_memory slots + a Queue of offsets (and one of free slots)
  memcpy       numpy copy of the same bytes, from an arena as large as the ring: the limit of one copy
plus push-to-pop latency (p50/p99) of 64 B records for the ring and mp.Queue.

    .venv/bin/python tools/bench_ring.py [--quick]

After a warm-up, every case of a size runs --repeats times (default 5) in rotated order (ring, view, batch, mp.Queue,
shm+Queue alternate, so a noisy moment hits them all); figures are medians, with the min-max spread in the JSON
(`*_spread`). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from multiprocessing import shared_memory

import numpy as np

from rollout_hpc.exchange.ring import Ring, RingClosed

SIZES = [64, 4 << 10, 256 << 10, 4 << 20]
CONFIGS = [(1, 1), (2, 2)]
BATCH = 256


def capacity_for(size: int) -> int:
    return max((size + 32) * 8, 8 << 20)


# ---- workers (module level: started with the spawn method) --------------------------------


def ring_producer(path, size, count, batch, barrier):
    ring = Ring.open(path)
    rec = b"\x01" * size
    barrier.wait()
    if batch > 1:  # batch 0 (view consumer) pushes one at a time
        items = [rec] * batch
        for i in range(0, count, batch):
            ring.push_many(items[: min(batch, count - i)])
    else:
        push = ring.push
        for _ in range(count):
            push(rec)


def ring_consumer(path, batch, barrier, results):
    ring = Ring.open(path)
    n = 0
    barrier.wait()
    try:
        # Every consumer reads each record's first 8 bytes, as one that routes or unpacks it does (the exchange's
        # forwarder peeks at a batch header and sends from the view; TrajectoryBatch.unpack views the arrays):
        # the copy path copies the whole record to get there, the view path reads it in place.
        h = 0
        if batch == 0:  # zero-copy claim
            while True:
                with ring.pop_view() as view:
                    h ^= int.from_bytes(view[:8], "little")
                n += 1
        elif batch > 1:
            while True:
                n += len(ring.pop_many(batch))
        else:
            pop = ring.pop
            while True:
                h ^= int.from_bytes(pop()[:8], "little")
                n += 1
    except RingClosed:
        pass
    results.put((time.perf_counter(), n))


def mpq_producer(q, size, count, barrier):
    rec = b"\x01" * size
    barrier.wait()
    for _ in range(count):
        q.put(rec)


def mpq_consumer(q, barrier, results):
    n = 0
    barrier.wait()
    while q.get() is not None:
        n += 1
    results.put((time.perf_counter(), n))


def shm_producer(name, size, count, free_q, full_q, barrier):
    shm = shared_memory.SharedMemory(name=name)
    rec = b"\x01" * size
    barrier.wait()
    for _ in range(count):
        off = free_q.get()
        shm.buf[off : off + size] = rec
        full_q.put((off, size))
    del rec
    shm.close()


def shm_consumer(name, free_q, full_q, barrier, results):
    shm = shared_memory.SharedMemory(name=name)
    n = 0
    barrier.wait()
    while (item := full_q.get()) is not None:
        off, size = item
        bytes(shm.buf[off : off + size])
        free_q.put(off)
        n += 1
    free_q.cancel_join_thread()  # slots nobody will take again must not keep this process alive
    shm.close()
    results.put((time.perf_counter(), n))


def ring_latency_consumer(path, n, results):
    ring = Ring.open(path)
    lat = np.empty(n, np.int64)
    for i in range(n):
        rec = ring.pop()
        lat[i] = time.perf_counter_ns() - int.from_bytes(rec[:8], "little")
    results.put(lat)


def mpq_latency_consumer(q, n, results):
    lat = np.empty(n, np.int64)
    for i in range(n):
        rec = q.get()
        lat[i] = time.perf_counter_ns() - int.from_bytes(rec[:8], "little")
    results.put(lat)


# ---- measurements -------------------------------------------------------------------------


def timed(ctx, make, nprod, ncons, total):
    """Starts producers and consumers, releases them together; records/s until the last consumer ends."""
    barrier = ctx.Barrier(nprod + ncons + 1)
    results = ctx.Queue()
    procs, finish = make(barrier, results)
    for p in procs:
        p.start()
    barrier.wait()
    t0 = time.perf_counter()
    for p in procs[:nprod]:
        p.join()
    finish()
    ends = [results.get(timeout=600) for _ in range(ncons)]
    for p in procs[nprod:]:
        p.join()
    got = sum(n for _, n in ends)
    assert got == total, f"consumers got {got} of {total} records"
    return total / (max(t for t, _ in ends) - t0)


def bench_ring(ctx, size, nprod, ncons, total, batch=1):
    path = f"/dev/shm/bench-ring-{os.getpid()}-{size}-{nprod}-{batch}"
    if os.path.exists(path):
        os.unlink(path)
    ring = Ring.create(path, capacity_for(size))
    per = total // nprod

    def make(barrier, results):
        procs = [ctx.Process(target=ring_producer, args=(path, size, per, batch, barrier)) for _ in range(nprod)]
        procs += [ctx.Process(target=ring_consumer, args=(path, batch, barrier, results)) for _ in range(ncons)]
        return procs, ring.close

    try:
        return timed(ctx, make, nprod, ncons, per * nprod)
    finally:
        ring.unlink()


def bench_mpq(ctx, size, nprod, ncons, total):
    q = ctx.Queue(maxsize=max(8, capacity_for(size) // (size + 32)))
    per = total // nprod

    def make(barrier, results):
        procs = [ctx.Process(target=mpq_producer, args=(q, size, per, barrier)) for _ in range(nprod)]
        procs += [ctx.Process(target=mpq_consumer, args=(q, barrier, results)) for _ in range(ncons)]
        return procs, lambda: [q.put(None) for _ in range(ncons)]

    return timed(ctx, make, nprod, ncons, per * nprod)


def bench_shm(ctx, size, nprod, ncons, total):
    slots = int(np.clip(capacity_for(size) // size, 8, 512))
    shm = shared_memory.SharedMemory(create=True, size=slots * size)
    free_q, full_q = ctx.Queue(), ctx.Queue()
    for i in range(slots):
        free_q.put(i * size)
    per = total // nprod

    def make(barrier, results):
        procs = [
            ctx.Process(target=shm_producer, args=(shm.name, size, per, free_q, full_q, barrier)) for _ in range(nprod)
        ]
        procs += [
            ctx.Process(target=shm_consumer, args=(shm.name, free_q, full_q, barrier, results)) for _ in range(ncons)
        ]
        return procs, lambda: [full_q.put(None) for _ in range(ncons)]

    try:
        return timed(ctx, make, nprod, ncons, per * nprod)
    finally:
        shm.close()
        shm.unlink()


def memcpy_gbs(size, total_bytes):
    """One copy of each record's bytes, from an arena as large as the ring (same cache footprint)."""
    arena = np.ones(capacity_for(size), np.uint8)
    dst = np.zeros(size, np.uint8)
    slots = len(arena) // size
    n = max(16, total_bytes // size)
    t = time.perf_counter()
    for i in range(n):
        off = (i % slots) * size
        np.copyto(dst, arena[off : off + size])
    return n * size / (time.perf_counter() - t) / 1e9


def inprocess_copy_gbs(size, total_bytes):
    """push + pop in one process, no scheduling involved: bytes copied per second (2 copies per
    record), i.e. the ring's own cost per copy, to compare with memcpy."""
    path = f"/dev/shm/bench-ring-inproc-{os.getpid()}"
    if os.path.exists(path):
        os.unlink(path)
    ring = Ring.create(path, capacity_for(size))
    ring.unlink()
    rec = b"\x01" * size
    n = max(64, total_bytes // size)
    t = time.perf_counter()
    for _ in range(n):
        ring.push(rec)
        ring.pop()
    return 2 * n * size / (time.perf_counter() - t) / 1e9


def latency(ctx, n, kind):
    """Push-to-pop latency of 64 B records sent one every 200 us (p50, p99 in microseconds)."""
    results = ctx.Queue()
    if kind == "ring":
        path = f"/dev/shm/bench-ring-lat-{os.getpid()}"
        if os.path.exists(path):
            os.unlink(path)
        ring = Ring.create(path, 1 << 20)
        proc = ctx.Process(target=ring_latency_consumer, args=(path, n, results))
        send = ring.push
    else:
        q = ctx.Queue()
        proc = ctx.Process(target=mpq_latency_consumer, args=(q, n, results))
        send = q.put
    proc.start()
    time.sleep(0.3)
    pad = b"\0" * 56
    for _ in range(n):
        t = time.perf_counter_ns()
        send(t.to_bytes(8, "little") + pad)
        while time.perf_counter_ns() - t < 200_000:
            pass
    lat = results.get(timeout=120)
    proc.join()
    if kind == "ring":
        ring.unlink()
    return float(np.percentile(lat, 50)) / 1e3, float(np.percentile(lat, 99)) / 1e3


def rounds(cases: dict, repeats: int) -> dict:
    """Each case (name -> callable returning a rate) once to warm up, then `repeats` rounds in rotated order;
    {name: (median, min, max)}."""
    names = list(cases)
    for name in names:
        cases[name]()
    got: dict = {name: [] for name in names}
    for i in range(repeats):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            got[name].append(cases[name]())
    return {name: (float(np.median(v)), min(v), max(v)) for name, v in got.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller volumes, 1 producer / 1 consumer (< 1 minute)")
    ap.add_argument("--repeats", type=int, default=5, help="rounds of every case after the warm-up (default 5)")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    budget = (256 << 20) if args.quick else (1 << 30)
    configs = CONFIGS[:1] if args.quick else CONFIGS  # --quick: 1 producer / 1 consumer only (process starts dominate)
    reps = args.repeats
    out = {}
    print(
        f"{'size':>8} {'P/C':>4} {'ring rec/s':>11} {'ring GB/s':>9} {'view GB/s':>9} {'memcpy GB/s':>11} "
        f"{'x memcpy':>8} {'mpQueue rec/s':>13} {'x mpQ':>6} {'shm+Q rec/s':>11} {'x shmQ':>6}   (medians of {reps})"
    )
    for size in SIZES:
        # Enough volume that process start-up skew does not dominate (each run >~ 0.1 s).
        total = int(np.clip(budget // size, 128, 100_000 if args.quick else 1_000_000))
        base_total = int(np.clip(total // 8, 32, 12_000 if args.quick else 100_000))
        local = rounds(
            {
                "memcpy": lambda: memcpy_gbs(size, budget // 4),
                "inprocess": lambda: inprocess_copy_gbs(size, budget // 8),
            },
            reps,
        )
        mc, ip = local["memcpy"][0], local["inprocess"][0]
        out[f"{size}B_inprocess"] = {"copy_gb_per_s": round(ip, 3), "x_memcpy": round(ip / mc, 3)}
        print(f"{size:>8} in one process: push+pop copies {ip:.2f} GB/s = {ip / mc:.2f}x memcpy per copy")
        for nprod, ncons in configs:
            key = f"{size}B_{nprod}p{ncons}c"
            cases = {
                "ring": lambda: bench_ring(ctx, size, nprod, ncons, total),
                "view": lambda: bench_ring(ctx, size, nprod, ncons, total, batch=0),
                "mpq": lambda: bench_mpq(ctx, size, nprod, ncons, base_total),
                "shm": lambda: bench_shm(ctx, size, nprod, ncons, base_total),
            }
            if size in (64, 4096) and (nprod, ncons) == (1, 1):
                cases["batch"] = lambda: bench_ring(ctx, size, 1, 1, total * (4 if size == 64 else 1), batch=BATCH)
            m = rounds(cases, reps)
            (r, *r_spread), (v, *v_spread) = m["ring"], m["view"]
            q, s_ = m["mpq"][0], m["shm"][0]
            gbs, vgbs = r * size / 1e9, v * size / 1e9
            out[key] = {
                "ring_records_per_s": round(r),
                "ring_records_per_s_spread": [round(x) for x in r_spread],
                "ring_gb_per_s": round(gbs, 3),
                "ring_view_records_per_s": round(v),
                "ring_view_records_per_s_spread": [round(x) for x in v_spread],
                "ring_view_gb_per_s": round(vgbs, 3),
                "memcpy_gb_per_s": round(mc, 3),
                "x_memcpy": round(gbs / mc, 3),
                "view_x_memcpy": round(vgbs / mc, 3),
                "view_x_copy": round(v / r, 3),
                "mp_queue_records_per_s": round(q),
                "x_mp_queue": round(r / q, 2),
                "shm_queue_records_per_s": round(s_),
                "x_shm_queue": round(r / s_, 2),
            }
            print(
                f"{size:>8} {nprod}/{ncons:<2} {r:>11.0f} {gbs:>9.3f} {vgbs:>9.3f} {mc:>11.2f} {max(gbs, vgbs) / mc:>8.3f} "
                f"{q:>13.0f} {r / q:>6.1f} {s_:>11.0f} {r / s_:>6.1f}"
            )
            if "batch" in m:
                rb, *rb_spread = m["batch"]
                out[f"{size}B_batch_1p1c_records_per_s"] = round(rb)
                out[f"{size}B_batch_1p1c_records_per_s_spread"] = [round(x) for x in rb_spread]
                out[f"{size}B_batch_x_single"] = round(rb / r, 3)
                print(
                    f"{size:>8} 1/1  ring push_many/pop_many({BATCH}): {rb:.0f} records/s ({rb / q:.1f}x mp.Queue, "
                    f"{rb / r:.2f}x single push/pop)"
                )
    n_lat = 2000 if args.quick else 20000
    rl = latency(ctx, n_lat, "ring")
    ql = latency(ctx, n_lat, "mpq")
    out["latency_us"] = {
        "ring_p50": round(rl[0], 1),
        "ring_p99": round(rl[1], 1),
        "mp_queue_p50": round(ql[0], 1),
        "mp_queue_p99": round(ql[1], 1),
    }
    print(
        f"push-to-pop latency 64 B: ring p50 {rl[0]:.1f} us p99 {rl[1]:.1f} us | mp.Queue p50 {ql[0]:.1f} us p99 {ql[1]:.1f} us"
    )
    k = out["262144B_1p1c"]
    t256 = max(k["x_memcpy"], k["view_x_memcpy"])
    t4 = out["4096B_1p1c"]["x_mp_queue"]
    t4b = out["4096B_batch_1p1c_records_per_s"] / out["4096B_1p1c"]["mp_queue_records_per_s"]
    out["targets"] = {
        "256KiB_x_memcpy_target_0.6": round(t256, 3),
        "256KiB_inprocess_x_memcpy_per_copy": out["262144B_inprocess"]["x_memcpy"],
        "4KiB_x_mp_queue_target_20": t4,
        "4KiB_batch_x_mp_queue_target_20": round(t4b, 2),
    }
    print(
        f"targets: 256 KiB at {t256:.2f}x memcpy (target 0.6x); 4 KiB at {t4:.1f}x mp.Queue records/s single, "
        f"{t4b:.1f}x batched (target 20x)"
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
