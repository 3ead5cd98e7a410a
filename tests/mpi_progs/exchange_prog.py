"""Under mpirun or srun: generators put random trajectory batches, trainers get them; every rank writes
what it sent or received (a sha256 per trajectory) and the exchange counters to RUN_DIR/exchange-R.json.

argv: RUN_DIR SPEC_JSON where SPEC has
  batches      batches per generator rank
  max_records  records per batch are drawn in [1, max_records]
  max_response response lengths are drawn in [1, max_response]
  gen_delay    {node_index: seconds between puts} (uneven producer speeds)
  train_delay  seconds a trainer sleeps after each get (a slow trainer)
  get_n        records per get() (at most, with get_available)
  get_available  trainers call get_available(get_n) instead of get(get_n)
  get_timeout  seconds a trainer's get_available waits before it returns empty (default 60)
  flush_after  a generator flushes after this many batches (-1: never), recording the counters then
  kill_after   the last generator rank kills itself with SIGKILL before this batch (-1: never)
  bad          None | "version" | "truncated": the last generator rank pushes one damaged record into its ring;
               "put_packed": it hands a damaged buffer to put_packed (which must refuse it) and goes on;
               "wire": it sends a damaged batch straight to the first trainer node (as a foreign sender would)
"""

import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

from rollout_hpc.config import load_config
from rollout_hpc.exchange.forward import Exchange
from rollout_hpc.runtime.world import free_world, init_world
from rollout_hpc.trajectory import RAGGED, LayoutError, TrajectoryBatch

run_dir, spec = Path(sys.argv[1]), json.loads(sys.argv[2])
cfg = load_config(run_dir / "config.resolved.yaml")
w = init_world(cfg)
ex = Exchange(w, cfg)


def digests(batch: TrajectoryBatch) -> list[str]:
    out = []
    for i in range(len(batch)):
        rec = batch.record(i)
        h = hashlib.sha256(batch.fixed[i : i + 1].tobytes())
        for name, _, _ in RAGGED:
            h.update(np.ascontiguousarray(rec[name]).tobytes())
        out.append(h.hexdigest())
    return out


def make_batch(rng, rank, k):
    n = int(rng.integers(1, spec["max_records"] + 1))
    records = []
    for i in range(n):
        rlen = int(rng.integers(1, spec["max_response"] + 1))
        records.append(
            {
                "prompt_id": rank * 1_000_000 + k * 100 + i,
                "sample_idx": i,
                "gen_rank": rank,
                "policy_version": 0,
                "reward": float(rng.standard_normal()),
                "prompt_ids": rng.integers(0, 1000, int(rng.integers(1, 20))),
                "response_ids": rng.integers(0, 1000, rlen),
                "logprobs": -rng.random(rlen).astype(np.float32),
                "t_start": time.time(),
            }
        )
    return TrajectoryBatch.from_records(records)


out = {"rank": w.rank, "role": w.role, "node": w.node_name, "node_index": w.node_index, "digests": [], "tokens": 0}
try:
    if w.is_generator:
        rng = np.random.default_rng(1234 + w.rank)
        delay = spec.get("gen_delay", {}).get(str(w.node_index), 0)
        bad_rank = spec.get("bad") and w.group_rank == w.group_size - 1
        for k in range(spec["batches"]):
            batch = make_batch(rng, w.rank, k)
            if bad_rank and k == spec["batches"] // 2:
                buf = batch.pack()
                if spec["bad"] == "put_packed":
                    buf[4:8] = (99).to_bytes(4, "little")
                    try:
                        ex.put_packed(buf)
                    except LayoutError as exc:
                        out["put_packed_error"] = str(exc)
                    continue
                if spec["bad"] == "wire":  # straight onto the wire, past the forwarder's check
                    from mpi4py import MPI

                    from rollout_hpc.exchange.forward import TAG_DATA

                    buf[4:8] = (99).to_bytes(4, "little")
                    ex.comm.Send([buf, MPI.BYTE], dest=w.leaders("trainer")[0].group_rank, tag=TAG_DATA)
                    continue
                if spec["bad"] == "version":
                    buf[4:8] = (99).to_bytes(4, "little")
                else:
                    buf = buf[: len(buf) - 9]
                ex.ring.push(bytes(buf))  # as a non-MPI producer on the node would
                continue
            if k == spec.get("kill_after", -1) and w.group_rank == w.group_size - 1:
                os.kill(os.getpid(), signal.SIGKILL)  # a generator rank dies mid-stream
            ex.put(batch)
            out["digests"] += digests(batch)
            out["tokens"] += batch.n_tokens
            if k == spec.get("flush_after", -1):
                ex.flush(timeout=60)
                out["after_flush"] = ex.stats()
            time.sleep(delay)
        ex.close(timeout=60)
    else:
        while True:
            if spec.get("get_available"):  # as data-parallel ranks sharing a node ring do
                batch = ex.get_available(spec["get_n"], timeout=spec.get("get_timeout", 60))
                done = ex.ended
            else:
                batch = ex.get(spec["get_n"], timeout=60)
                done = len(batch) < spec["get_n"]
            out["digests"] += digests(batch)
            out["tokens"] += batch.n_tokens
            out.setdefault("get_sizes", []).append(len(batch))
            if done:
                break
            time.sleep(spec.get("train_delay", 0))
        out["ended"] = ex.ended
        out["rest"] = len(ex.close(timeout=60))
except (LayoutError, Exception) as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
out["stats"] = ex.stats()
(run_dir / f"exchange-{w.rank}.json").write_text(json.dumps(out))
w.comm.Barrier()  # every rank, failed or not, gets here: the error must reach all of them
if "error" in out:
    sys.exit(3)  # the run stops (entry.py would MPI_Abort here)
free_world(w)
