"""Under mpirun: trainers publish VERSIONS weight sets; every generator records what it got (sha256 per tensor)."""

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

from rollout_hpc.config import load_config
from rollout_hpc.exchange.weights import SyncClosed, WeightSync
from rollout_hpc.runtime.world import free_world, init_world

run_dir, versions = Path(sys.argv[1]), int(sys.argv[2])
cfg = load_config(run_dir / "config.resolved.yaml")
w = init_world(cfg)
ws = WeightSync(w, cfg)


def weights(version):
    rng = np.random.default_rng(version)
    return {
        "embed": rng.standard_normal((97, 33)).astype(np.float32),  # larger than one chunk in the test config
        "layer.0.bias": rng.standard_normal(7).astype(np.float64),
        "step": np.array(version, np.int64),  # 0-d
        "empty": np.zeros((0, 4), np.float16),
        "mask": rng.integers(0, 2, (5, 3), dtype=np.uint8),
        "strided": rng.standard_normal((8, 6)).astype(np.float32)[:, ::2],  # not contiguous
    }


def digest(tensors):
    return {
        k: [hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest(), v.dtype.str, list(v.shape)]
        for k, v in tensors.items()
    }


out = {"rank": w.rank, "role": w.role, "versions": []}
for v in range(1, versions + 1):
    if w.is_trainer:
        t = weights(v)
        stats = ws.publish(v, t if w.group_rank == 0 else None)
        out["versions"].append({"version": v, "digest": digest(t), "stats": stats})
    else:
        got_v, tensors = ws.receive(min_version=v, timeout=60)
        out["versions"].append({"version": got_v, "digest": digest(tensors), "poll_after": ws.poll() is not None})
        if v == 1:
            held = tensors  # kept alive: receive buffers still viewed must never be reused
        del tensors  # the others are dropped, so their buffers can be reused
    if not w.is_trainer and v == versions:
        out["held_v1_digest"] = digest(held)
    w.comm.Barrier()
if w.is_trainer:
    ws.close()
else:
    try:
        ws.receive(min_version=versions + 1, timeout=60)
        out["closed"] = False
    except SyncClosed:
        out["closed"] = True
    out["history"] = ws.history
    out["buffers_reused"] = ws.buffers_reused
    out["rings"] = ws.rings
    ws.close()
(run_dir / f"weights-{w.rank}.json").write_text(json.dumps(out))
free_world(w)
