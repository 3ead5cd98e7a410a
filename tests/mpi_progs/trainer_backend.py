"""MPI program for tests/test_trainers.py: drive one trainer backend on the trainer ranks.

argv: RUN_DIR (holding config.resolved.yaml). Trainer ranks fit a fixed token
batch with the next-token loss for a few steps through `make_trainer`, check
checkpoint-state and full-weights round trips, and write RUN_DIR/trainer-<group rank>.json.
Generator ranks only join the world.
"""

import copy
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import torch

from rollout_hpc.config import load_config
from rollout_hpc.runtime.world import free_world, init_world


def digest(weights: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(weights):
        h.update(k.encode())
        h.update(np.ascontiguousarray(weights[k], np.float32).tobytes())
    return h.hexdigest()


def tiny_model(cfg):
    from rollout_hpc.runtime.train_program import build_policy

    return build_policy(cfg)[0]


def main(run_dir: Path) -> None:
    from rollout_hpc.backends.trainer import cross_entropy_loss_fn, make_trainer

    cfg = load_config(run_dir / "config.resolved.yaml")
    world = init_world(cfg)
    if world.is_trainer:
        torch.manual_seed(cfg.run.seed)
        model = tiny_model(cfg)
        spare = copy.deepcopy(model)
        trainer = make_trainer(cfg, model, world)
        g = torch.Generator().manual_seed(1234 + world.group_rank)  # each data-parallel rank its own data
        vocab = int(trainer.full_weights()[next(k for k in trainer.full_weights() if "embed" in k)].shape[0])
        ids = torch.randint(0, vocab, (4, 12), generator=g)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones(4, 12)}
        before = digest(trainer.full_weights())
        losses = [trainer.train_step(batch, cross_entropy_loss_fn)["loss"] for _ in range(8)]
        after_weights = trainer.full_weights()
        after = digest(after_weights)
        logp, ent = trainer.logprobs(ids, torch.ones_like(ids))

        # full_weights -> load_full_weights round trip on a differently initialised copy
        state = trainer.state_dict_for_checkpoint()
        next_loss = trainer.train_step(batch, cross_entropy_loss_fn)["loss"]

        # A fresh trainer from the checkpoint state continues exactly where the first one was.
        resumed = make_trainer(cfg, spare, world)
        resumed.load_checkpoint_state(state)
        resumed_digest = digest(resumed.full_weights())
        resumed_next = resumed.train_step(batch, cross_entropy_loss_fn)["loss"]
        out = {
            "losses": losses,
            "before": before,
            "after": after,
            "logp_shape": list(logp.shape),
            "logp_col0_zero": bool((logp[:, 0] == 0).all()),
            "logp_max": float(logp.max()),
            "entropy_min": float(ent[:, 1:].min()),
            "resumed_digest": resumed_digest,
            "next_loss": next_loss,
            "resumed_next_loss": resumed_next,
        }
        resumed.close()  # one process group for both: DeepSpeed cannot be re-initialised in a process
        (run_dir / f"trainer-{world.group_rank}.json").write_text(json.dumps(out))
    world.comm.Barrier()
    free_world(world)


if __name__ == "__main__":
    try:
        main(Path(sys.argv[1]))
    except BaseException:
        import traceback

        from mpi4py import MPI

        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)  # never leave the other ranks blocked
