"""Worker processes for the ring's multi-process tests (run as `python test_ring_workers.py ROLE ...`).

Not a test module: it holds no tests, only the producer/consumer programs that
tests/test_ring_procs.py starts as real processes and kills. Records carry their
producer, sequence number and a CRC32, so every delivery can be checked.
"""

from __future__ import annotations

import os
import random
import struct
import sys
import time
import zlib

HEAD = struct.Struct("<IIQ")  # producer, seq, total length


def make_record(producer: int, seq: int, length: int) -> bytes:
    length = max(length, HEAD.size + 4)
    body = HEAD.pack(producer, seq, length) + random.Random(producer << 32 | seq).randbytes(length - HEAD.size - 4)
    return body + struct.pack("<I", zlib.crc32(body))


def check_record(data) -> tuple[int, int]:
    """Returns (producer, seq) after checking length and CRC; raises AssertionError if damaged."""
    data = bytes(data)
    producer, seq, length = HEAD.unpack_from(data)
    assert len(data) == length, f"record {producer}/{seq}: {len(data)} bytes, header says {length}"
    assert zlib.crc32(data[:-4]) == struct.unpack("<I", data[-4:])[0], f"record {producer}/{seq}: bad CRC"
    return producer, seq


def size_for(seq: int, max_len: int) -> int:
    return (seq * 2654435761) % max_len


def producer(path: str, producer_id: int, count: int, max_len: int, log: str | None) -> None:
    """Pushes `count` records (mixing push, push_many and reserve); appends each committed seq to `log`."""
    from rollout_hpc.exchange.ring import Ring

    ring = Ring.open(path)
    log_fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600) if log else None
    print("ready", flush=True)
    seq = 0
    while count < 0 or seq < count:
        mode = seq % 3
        if mode == 2 and (count < 0 or seq + 4 <= count):
            recs = [make_record(producer_id, seq + i, size_for(seq + i, max_len)) for i in range(4)]
            ring.push_many(recs, timeout=60)
            done = list(range(seq, seq + 4))
        elif mode == 1:
            rec = make_record(producer_id, seq, size_for(seq, max_len))
            with ring.reserve(len(rec), timeout=60) as buf:
                buf[:] = rec
            done = [seq]
        else:
            ring.push(make_record(producer_id, seq, size_for(seq, max_len)), timeout=60)
            done = [seq]
        if log_fd is not None:
            os.write(log_fd, struct.pack(f"<{len(done)}I", *done))
        seq += len(done)


def consumer(path: str, out: str, style: str) -> None:
    """Pops until the ring is closed and drained; writes the (producer, seq) pairs it got to `out`."""
    from rollout_hpc.exchange.ring import Ring, RingClosed

    ring = Ring.open(path)
    got = []
    try:
        while True:
            if style == "view":
                with ring.pop_view(timeout=60) as view:
                    got.append(check_record(view))
            elif style == "many":
                got.extend(check_record(r) for r in ring.pop_many(16, timeout=60))
            else:
                got.append(check_record(ring.pop(timeout=60)))
    except RingClosed:
        pass
    with open(out, "wb") as f:
        f.write(b"".join(struct.pack("<II", p, s) for p, s in got))


def hold_view(path: str) -> None:
    """Claims one record with pop_view, reports it and waits to be killed inside the block."""
    from rollout_hpc.exchange.ring import Ring

    ring = Ring.open(path)
    with ring.pop_view(timeout=60) as view:
        producer, seq = check_record(view)
        print(f"holding {producer} {seq}", flush=True)
        time.sleep(600)


def die_mid_write(path: str, nbytes: int) -> None:
    """Reserves a record, fills half of it and SIGKILLs itself (a producer dying mid-copy)."""
    import signal

    from rollout_hpc.exchange.ring import Ring

    ring = Ring.open(path)
    with ring.reserve(nbytes, timeout=60) as buf:
        buf[: nbytes // 2] = b"\xab" * (nbytes // 2)
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    role, args = sys.argv[1], sys.argv[2:]
    if role == "producer":
        producer(args[0], int(args[1]), int(args[2]), int(args[3]), args[4] if len(args) > 4 else None)
    elif role == "consumer":
        consumer(args[0], args[1], args[2])
    elif role == "hold_view":
        hold_view(args[0])
    elif role == "die_mid_write":
        die_mid_write(args[0], int(args[1]))
    else:
        raise SystemExit(f"unknown role {role}")
