"""`run.program: hello`: prove the MPI world of a run and exit.

Every rank prints one HELLO line with its role and node and writes the same
facts to RUN_DIR/hello/rank-R.json; the two groups then pass one message
round trip over the intercommunicator (generator group rank 0 -> trainer
group rank 0 -> back), which proves MPI works across the heterogeneous groups.
"""

from __future__ import annotations

import json
from pathlib import Path

_TAG = 11


def main(world, cfg, run_dir: Path) -> int:
    facts = world.facts()
    print(
        f"HELLO rank={world.rank} role={world.role} group_rank={world.group_rank} "
        f"node={world.node_name} node_index={world.node_index} local_rank={world.local_rank}",
        flush=True,
    )
    facts["exchange"] = None
    if world.group_rank == 0:
        token = {"from_rank": world.rank, "role": world.role, "config_digest": cfg.digest()}
        if world.is_generator:
            world.inter_comm.send(token, dest=0, tag=_TAG)
            reply = world.inter_comm.recv(source=0, tag=_TAG)
        else:
            reply = world.inter_comm.recv(source=0, tag=_TAG)
            world.inter_comm.send(token, dest=0, tag=_TAG)
        ok = reply["role"] != world.role and reply["config_digest"] == cfg.digest()
        facts["exchange"] = {"ok": ok, "peer_rank": reply["from_rank"]}
        print(f"HELLO-EXCHANGE {'ok' if ok else 'MISMATCH'} rank={world.rank} peer={reply['from_rank']}", flush=True)
    out = Path(run_dir) / "hello"
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".rank-{world.rank}.json.tmp"
    tmp.write_text(json.dumps(facts, indent=1))
    tmp.rename(out / f"rank-{world.rank}.json")
    world.comm.Barrier()
    return 0 if facts["exchange"] is None or facts["exchange"]["ok"] else 1
