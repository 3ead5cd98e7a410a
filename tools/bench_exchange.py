#!/usr/bin/env python3
"""Benchmark: moving trajectory batches generator -> trainer, and weights trainer -> generators.

Payload: batches of 64 trajectories x (128 prompt + 1,024 response tokens) with logprobs and loss masks.
Side by side in one run, between two MPI ranks that emulate two nodes (mpirun, ROLLOUT_NODE):

  exchange       ours: Exchange.put -> node ring -> forwarder -> MPI -> receiver -> node ring -> Exchange.get
  raw_mpi        the limit: mpi4py Send/Recv of the same packed buffers (pre-packed, no ring, no checks)
  raw_mpi_hot    the same, sending one buffer again and again (cache-resident: an upper bound no real
                 stream of fresh trajectories sees)
  pickle_arrays  mpi4py send/recv (pickle) of a list of 64 dicts of numpy arrays
  pickle_lists   the same with Python lists (how many RL codes ship tokens)
  ray            Ray object store put/get between two processes (only if ray is installed)

and weight sync: WeightSync.publish (header + chunked intercomm Bcast) to 2 generator ranks vs one raw
Bcast of the same bytes; and what one sync of a real model (built-in Llama, hidden 256, 4 layers) sends and takes
without and with model.lora (rank 8 on q/k/v/o_proj: only the merged adapted layers go out). Each figure is the median of several rounds; ratios are ours / baseline.
The last line printed is one JSON object with every figure.

    python tools/bench_exchange.py --quick     # < 1 minute
    python tools/bench_exchange.py             # more batches and rounds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

N_SAMPLES, PROMPT_LEN, RESPONSE_LEN = 64, 128, 1024
POOL = 100  # distinct batches each method cycles through (~63 MB)


def make_records(seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            "prompt_id": i,
            "sample_idx": i % 8,
            "gen_rank": 0,
            "policy_version": 3,
            "reward": float(rng.random()),
            "prompt_ids": rng.integers(0, 32000, PROMPT_LEN, dtype=np.int32),
            "response_ids": rng.integers(0, 32000, RESPONSE_LEN, dtype=np.int32),
            "logprobs": -rng.random(RESPONSE_LEN, dtype=np.float32),
            "loss_mask": np.ones(RESPONSE_LEN, np.uint8),
        }
        for i in range(N_SAMPLES)
    ]


# --------------------------------------------------------------------------- MPI parts (run under mpirun)
def _exchange_part(args) -> dict:
    from mpi4py import MPI

    from rollout_hpc.config import load_config
    from rollout_hpc.exchange.forward import Exchange
    from rollout_hpc.runtime.world import init_world
    from rollout_hpc.trajectory import TrajectoryBatch

    cfg = load_config(Path(args.run_dir) / "config.resolved.yaml")
    world = init_world(cfg)
    comm, gen = world.inter_comm, world.is_generator
    # A pool of distinct batches (~64 MB, more than the caches): every method moves fresh data, as a
    # generator does; sending one buffer again and again would measure cache bandwidth instead.
    pool_records = [make_records(seed) for seed in range(POOL)]
    pool = [TrajectoryBatch.from_records(r) for r in pool_records]
    packed = [np.frombuffer(b.pack(), np.uint8) for b in pool]
    nbytes = packed[0].nbytes
    results: dict[str, list[float]] = {}

    def timed(name, n, send, recv):
        world.comm.Barrier()
        t0 = time.perf_counter()
        for i in range(n):
            send(i % POOL) if gen else recv(i % POOL)
        world.comm.Barrier()  # the receiver has everything
        seconds = time.perf_counter() - t0
        results.setdefault(name, []).append(n * nbytes / seconds / 1e9)

    rbufs = [np.empty_like(p) for p in packed]
    as_lists = [
        [{k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in r.items()} for r in recs]
        for recs in pool_records[:2]
    ]
    ex = Exchange(world, cfg)

    def ex_recv(_):
        got = ex.get(N_SAMPLES, timeout=120)
        assert len(got) == N_SAMPLES

    for rnd in range(args.rounds + 1):  # round 0 warms up
        timed(
            "raw_mpi",
            args.batches,
            lambda i: comm.Send([packed[i], MPI.BYTE], dest=0, tag=1),
            lambda i: comm.Recv([rbufs[i], MPI.BYTE], source=0, tag=1),
        )
        timed(
            "raw_mpi_hot",
            args.batches,
            lambda i: comm.Send([packed[0], MPI.BYTE], dest=0, tag=4),
            lambda i: comm.Recv([rbufs[0], MPI.BYTE], source=0, tag=4),
        )
        timed("exchange", args.batches, lambda i: ex.put(pool[i]), ex_recv)
        timed(
            "pickle_arrays",
            max(4, args.batches // 4),
            lambda i: comm.send(pool_records[i], dest=0, tag=2),
            lambda i: comm.recv(source=0, tag=2),
        )
        timed(
            "pickle_lists",
            max(2, args.batches // 40),
            lambda i: comm.send(as_lists[i % 2], dest=0, tag=3),
            lambda i: comm.recv(source=0, tag=3),
        )
        if rnd == 0:
            results.clear()
    stats = ex.stats()
    ex.close(timeout=60)
    out = {
        "batch_bytes": nbytes,
        "gbps": {k: statistics.median(v) for k, v in results.items()},
        "rounds": {k: v for k, v in results.items()},
    }
    if gen:
        out["forwarder"] = stats.get("forwarder")
    return out


def _weights_part(args) -> dict:
    from mpi4py import MPI

    from rollout_hpc.config import load_config
    from rollout_hpc.exchange.weights import WeightSync
    from rollout_hpc.runtime.world import init_world

    cfg = load_config(Path(args.run_dir) / "config.resolved.yaml")
    world = init_world(cfg)
    ws = WeightSync(world, cfg)
    rng = np.random.default_rng(0)
    n_tensors = 24
    per = args.weight_mb * (1 << 20) // n_tensors // 4
    tensors = {f"layer.{i}.weight": rng.standard_normal(per, dtype=np.float32) for i in range(n_tensors)}
    total = sum(t.nbytes for t in tensors.values())
    flat = (
        np.concatenate([t.view(np.uint8) for t in tensors.values()]) if world.is_trainer else np.empty(total, np.uint8)
    )
    comm = world.inter_comm
    res: dict[str, list[float]] = {"weight_sync": [], "raw_bcast": []}
    version = 0
    warmup = 2  # the first two versions land in fresh memory (page faults); later ones reuse it
    for rnd in range(args.rounds + warmup):
        version += 1
        sync_s = _one_sync(world, ws, version, tensors)
        t1 = time.perf_counter()
        if world.is_trainer:
            comm.Bcast([flat, MPI.BYTE], root=MPI.ROOT)
        else:
            comm.Bcast([flat, MPI.BYTE], root=0)
        world.comm.Barrier()
        t2 = time.perf_counter()
        if rnd >= warmup:
            res["weight_sync"].append(total / sync_s / 1e9)
            res["raw_bcast"].append(total / (t2 - t1) / 1e9)
    lora_sync = _lora_sync(world, ws, args.rounds, version)
    ws.close()
    return {
        "lora_sync": lora_sync,
        "weight_bytes": total,
        "generators": cfg.generator.ranks,
        "gbps": {k: statistics.median(v) for k, v in res.items()},
        "rounds": res,
    }


def _one_sync(world, ws, version: int, tensors: dict) -> float:
    """Seconds of one weight sync between two world barriers: trainers publish `version`, generators
    receive it."""
    world.comm.Barrier()
    t0 = time.perf_counter()
    if world.is_trainer:
        ws.publish(version, tensors)
    else:
        ws.receive(min_version=version, timeout=120)
    world.comm.Barrier()
    return time.perf_counter() - t0


def _lora_sync(world, ws, rounds: int, version: int) -> dict:
    """Bytes and seconds (median) of one weight sync of the same model: every tensor (a full fine-tune) vs the
    merged adapted layers of model.lora (what the trainers publish with LoRA)."""
    from rollout_hpc.config import LoraSection, ModelSection
    from rollout_hpc.models import build_model, lora

    syncs: dict[str, dict] = {"full": {}, "lora": {}}
    if world.is_trainer:
        model = build_model(ModelSection(hidden_size=256, num_layers=4, num_heads=4, max_seq_len=64), 99)
        syncs["full"] = {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}
        lora.apply_lora(model, LoraSection(rank=8))
        syncs["lora"] = lora.merged_weights(model)
    out = {}
    for name, tensors in syncs.items():
        seconds = []
        for rnd in range(rounds + 1):  # the first lands in fresh memory
            version += 1
            sync_s = _one_sync(world, ws, version, tensors)
            if rnd:
                seconds.append(sync_s)
        out[name] = {"bytes": sum(t.nbytes for t in tensors.values()), "seconds": statistics.median(seconds)}
    return out


def mpi_main(args) -> None:
    out = (_exchange_part if args.mpi_part == "exchange" else _weights_part)(args)
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() == MPI.COMM_WORLD.Get_size() - 1:  # a trainer rank reports
        Path(args.out).write_text(json.dumps(out))


# --------------------------------------------------------------------------- Ray (plain processes)
def ray_bench(batches: int, rounds: int) -> dict:
    try:
        import ray
    except ImportError:
        return {"available": False, "why": "ray is not installed"}
    from rollout_hpc.trajectory import TrajectoryBatch

    packed = [np.frombuffer(TrajectoryBatch.from_records(make_records(s)).pack(), np.uint8) for s in range(POOL)]
    ray.init(
        num_cpus=2,
        object_store_memory=400 << 20,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
        configure_logging=False,
    )
    try:

        @ray.remote
        class Consumer:
            def consume(self, refs):
                n = 0
                for ref in refs:
                    n += np.array(ray.get(ref[0])).nbytes  # get, then own the bytes (like Exchange.get)
                return n

        consumer = Consumer.remote()
        ray.get(consumer.consume.remote([]))
        rates = []
        for rnd in range(rounds + 1):
            t0 = time.perf_counter()
            pending = []
            for start in range(0, batches, 8):  # hand refs over in small groups, like a stream
                refs = [[ray.put(packed[(start + k) % POOL])] for k in range(min(8, batches - start))]
                pending.append(consumer.consume.remote(refs))
            total = sum(ray.get(pending))
            if rnd:
                rates.append(total / (time.perf_counter() - t0) / 1e9)
        return {"available": True, "version": ray.__version__, "gbps": statistics.median(rates), "rounds": rates}
    finally:
        ray.shutdown()


# --------------------------------------------------------------------------- driver
def run_mpi(part: str, run_dir: Path, args, blocks: list[tuple[int, str]]) -> dict:
    out = run_dir / f"{part}.json"
    me = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--mpi-part",
        part,
        "--run-dir",
        str(run_dir),
        "--out",
        str(out),
        "--batches",
        str(args.batches),
        "--rounds",
        str(args.rounds),
        "--weight-mb",
        str(args.weight_mb),
    ]
    cmd = ["mpirun", "--oversubscribe"]
    for i, (n, node) in enumerate(blocks):
        cmd += ([":"] if i else []) + ["-np", str(n), "-x", f"ROLLOUT_NODE={node}", *me]
    env = dict(
        os.environ,
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise SystemExit(f"bench part {part} failed:\n{res.stdout[-2000:]}{res.stderr[-3000:]}")
    return json.loads(out.read_text())


def write_config(run_dir: Path, overrides: list[str]) -> None:
    import yaml

    from rollout_hpc.config import load_config

    cfg = load_config(None, [f"run.dir={run_dir}", f"exchange.ring_dir={run_dir}", *overrides])
    (run_dir / "config.resolved.yaml").write_text(yaml.safe_dump(cfg.resolved()))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer batches and rounds: under a minute")
    p.add_argument("--batches", type=int, default=None)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--weight-mb", type=int, default=None)
    p.add_argument("--no-ray", action="store_true")
    p.add_argument("--mpi-part", choices=["exchange", "weights"], help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.batches = args.batches or (150 if args.quick else 600)
    args.rounds = args.rounds or (3 if args.quick else 5)
    args.weight_mb = args.weight_mb or (128 if args.quick else 512)
    if args.mpi_part:
        return mpi_main(args)

    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(
        prefix="bench-exchange-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    ) as tmp:
        ex_dir, w_dir = Path(tmp, "ex"), Path(tmp, "w")
        ex_dir.mkdir(), w_dir.mkdir()
        write_config(ex_dir, ["exchange.ring_bytes=67108864", "exchange.max_inflight_bytes=33554432"])
        write_config(w_dir, ["generator.nodes=2", "exchange.weight_chunk_bytes=16777216"])
        ex = run_mpi("exchange", ex_dir, args, [(1, "gen0"), (1, "train0")])
        w = run_mpi("weights", w_dir, args, [(1, "gen0"), (1, "gen1"), (1, "train0")])
    ray_res = (
        {"available": False, "why": "--no-ray"} if args.no_ray else ray_bench(max(40, args.batches // 2), args.rounds)
    )

    g = ex["gbps"]
    ratios = {
        "exchange_vs_raw_mpi": g["exchange"] / g["raw_mpi"],
        "exchange_vs_raw_mpi_hot": g["exchange"] / g["raw_mpi_hot"],
        "exchange_vs_pickle_arrays": g["exchange"] / g["pickle_arrays"],
        "exchange_vs_pickle_lists": g["exchange"] / g["pickle_lists"],
        "weight_sync_vs_raw_bcast": w["gbps"]["weight_sync"] / w["gbps"]["raw_bcast"],
    }
    if ray_res.get("available"):
        ratios["exchange_vs_ray"] = g["exchange"] / ray_res["gbps"]
    print(
        f"batch: {N_SAMPLES} x ({PROMPT_LEN}+{RESPONSE_LEN}) tokens = {ex['batch_bytes'] / 1e6:.2f} MB packed; "
        f"{args.batches} batches x {args.rounds} rounds (median)"
    )
    for name in ("raw_mpi", "raw_mpi_hot", "exchange", "pickle_arrays", "pickle_lists"):
        print(f"  {name:15s} {g[name]:7.3f} GB/s")
    print(
        f"  {'ray':15s} "
        + (
            f"{ray_res['gbps']:7.3f} GB/s (ray {ray_res['version']})"
            if ray_res.get("available")
            else f"n/a ({ray_res['why']})"
        )
    )
    print(
        f"weights: {w['weight_bytes'] / 1e6:.0f} MB to {w['generators']} generators: "
        f"weight_sync {w['gbps']['weight_sync']:.3f} GB/s, raw Bcast {w['gbps']['raw_bcast']:.3f} GB/s"
    )
    ls = w["lora_sync"]
    ratios["lora_sync_bytes_vs_full"] = ls["lora"]["bytes"] / ls["full"]["bytes"]
    print(
        f"weight sync of a {ls['full']['bytes'] / 1e6:.1f} MB model: full {ls['full']['seconds'] * 1e3:.2f} ms, "
        f"LoRA (merged q/k/v/o_proj) {ls['lora']['bytes'] / 1e6:.1f} MB in {ls['lora']['seconds'] * 1e3:.2f} ms"
    )
    for k, v in ratios.items():
        print(f"  {k:28s} {v:6.2f}x")
    summary = {
        "bench": "exchange",
        "quick": args.quick,
        "batch_bytes": ex["batch_bytes"],
        "batches": args.batches,
        "rounds": args.rounds,
        "gbps": {**g, "ray": ray_res.get("gbps")},
        "ray": {k: v for k, v in ray_res.items() if k != "rounds"},
        "weights": {
            "bytes": w["weight_bytes"],
            "generators": w["generators"],
            **{f"{k}_gbps": v for k, v in w["gbps"].items()},
        },
        "lora_sync": ls,
        "ratios": ratios,
        "targets": {"exchange_vs_raw_mpi": 0.9, "exchange_vs_ray": 3.0},
        "seconds": time.perf_counter() - t_start,
        "cpus": os.cpu_count(),
    }
    if not ray_res.get("available") and not args.no_ray:  # a ratio against a baseline that did not run: say so
        print(
            f"could not run the Ray baseline: {ray_res['why']} (install it with `tools/setup.sh --bench`, "
            "or leave it out with --no-ray)",
            file=sys.stderr,
        )
    print(json.dumps(summary))
    return 0 if ray_res.get("available") or args.no_ray else 1


if __name__ == "__main__":
    raise SystemExit(main())
