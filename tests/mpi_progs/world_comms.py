"""Under mpirun: init the world from RUN_DIR's config and record what each communicator sees."""

import json
import sys
from pathlib import Path

from rollout_hpc.config import load_config
from rollout_hpc.runtime.world import free_world, init_world

run_dir = Path(sys.argv[1])
cfg = load_config(run_dir / "config.resolved.yaml")
w = init_world(cfg)
out = {
    "facts": w.facts(),
    "group_world_ranks": w.group_comm.allgather(w.rank),
    "node_world_ranks": w.node_comm.allgather(w.rank),
    "node_names_on_node_comm": w.node_comm.allgather(w.node_name),
    "remote_group_size": w.inter_comm.Get_remote_size(),
    "generator_leaders": [r.rank for r in w.leaders("generator")],
    "trainer_leaders": [r.rank for r in w.leaders("trainer")],
}
# A real exchange over the intercommunicator: each group rank r sums what remote rank r % remote sends.
peer = w.group_rank % w.inter_comm.Get_remote_size()
req = w.inter_comm.isend(w.rank, dest=peer, tag=5)
received = []
senders = [r for r in range(w.inter_comm.Get_remote_size()) if r % w.group_size == w.group_rank]
for s in senders:
    received.append(w.inter_comm.recv(source=s, tag=5))
req.wait()
out["received_from_remote"] = sorted(received)
(run_dir / f"comms-{w.rank}.json").write_text(json.dumps(out))
w.comm.Barrier()
free_world(w)
