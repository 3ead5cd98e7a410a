"""When the trainer loop checkpoints, and resuming from the newest valid checkpoint.

Checkpoints are taken at step boundaries only: every checkpoint.every_steps
steps, every checkpoint.every_minutes, and when SIGUSR1 or SIGTERM arrives
(Slurm's warning before the time limit, or scancel). A signal handler only
sets a flag; the loop finishes its step, saves, and stops cleanly. The stop
decision is agreed over the trainer group so every rank stops at the same step.

The files themselves are written by rollout_hpc.store.checkpoint (HDF5,
atomic, verified on load).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

from rollout_hpc.config import ConfigError
from rollout_hpc.rundir_layout import EXIT_CONTINUE
from rollout_hpc.runtime import early_signals
from rollout_hpc.runtime.world import sleeping_barrier
from rollout_hpc.store import checkpoint as store

# Stopped on a signal after checkpointing: "continue in a new allocation" (the batch script requeues).
EXIT_PREEMPTED = EXIT_CONTINUE


_stop = threading.Event()


def install_stop_handlers() -> None:
    """SIGUSR1 / SIGTERM only set a flag (on every rank: USR1's default action would kill it).
    Trainers act on it at the next step boundary; generators stop when the trainers close the weight stream."""
    for sig in early_signals.STOP_SIGNALS:
        signal.signal(sig, lambda signum, frame: _stop.set())
    if early_signals.take():  # one came while the rank started (runtime/early_signals.py)
        _stop.set()


def stop_signalled() -> bool:
    """Whether SIGUSR1 / SIGTERM arrived at this rank."""
    return _stop.is_set()


class Checkpointer:
    """`extras`: {key: object with state_dict() / load_state_dict(state)} saved beside the trainer's state (equal on
    every trainer rank: the reward models' normalization)."""

    def __init__(self, world, cfg, run_dir: Path, extras: dict | None = None):
        self.world = world
        self.extras = dict(extras or {})
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.stop_requested = False
        self._last_save = time.monotonic()
        self.store = store
        install_stop_handlers()

    def due(self, steps_done: int) -> bool:
        """Whether to checkpoint now (after `steps_done` steps). Collective over the trainer group."""
        c = self.cfg.checkpoint
        periodic = c.every_steps > 0 and steps_done % c.every_steps == 0
        timed = c.every_minutes > 0 and time.monotonic() - self._last_save >= 60 * c.every_minutes
        final = steps_done == self.cfg.total_steps
        flags = np.array([_stop.is_set(), periodic or timed or final], np.int8)
        if self.world.group_size > 1:  # rank 0 logs the step meanwhile: the others wait asleep, not spinning
            sleeping_barrier(self.world.group_comm)
        flags = self.world.group_comm.allreduce(flags)  # any rank signalled -> all stop together
        self.stop_requested = bool(flags[0])
        return bool(flags[0] or flags[1])

    def save(self, trainer, steps_done: int) -> None:
        """Checkpoint after `steps_done` steps. Collective over the trainer group."""
        store, g = self.store, self.world.group_comm
        state = trainer.state_dict_for_checkpoint()
        # The data cursor is the step: step s always trains on the prompts of its StepPlan (runtime.step_plan),
        # and sample k of prompt i is seeded from (run.seed, i, k), so nothing else is needed to continue as if
        # never stopped (dynamic sampling's refill rounds are replayed from the same rewards).
        state["loop"] = {"step": steps_done, "policy_version": steps_done}
        for key, obj in self.extras.items():
            state[key] = obj.state_dict()
        meta = {**store.config_meta(self.cfg), "policy_version": steps_done, "backend": self.cfg.trainer.backend}
        keep = self.cfg.checkpoint.keep_last
        path = None
        if trainer.sharded_checkpoint:
            entry = store.save_shard(
                self.run_dir, steps_done, self.world.group_rank, self.world.group_size, state, meta
            )
            entries = g.gather(entry, root=0)
            if self.world.group_rank == 0:
                path = store.commit_shards(self.run_dir, steps_done, entries, meta, keep_last=keep)
        elif self.world.group_rank == 0:
            path = store.save_checkpoint(self.run_dir, steps_done, state, meta, keep_last=keep)
        g.Barrier()
        self._last_save = time.monotonic()
        if path is not None and self.stop_requested:
            print(
                f"rollout-hpc: stop requested: saved {path} after step {steps_done}; a resume continues from there",
                file=sys.stderr,
                flush=True,
            )

    def resume(self, trainer) -> int:
        """Load the newest valid checkpoint into `trainer`; returns the steps already done (0 if none).
        Collective over the trainer group."""
        store, g = self.store, self.world.group_comm
        if trainer.sharded_checkpoint:
            found = self._load_shards()
        elif self.world.group_rank == 0:
            found = store.load_latest_valid(self.run_dir)
        else:
            found = None
        step = g.bcast(None if found is None else int(found[1]["loop"]["step"]), root=0)
        if step is None:
            return 0
        if found is not None:
            try:
                # `rollout-hpc resume --force` accepted a model/algorithm change (launch/resume.py).
                store.check_compatible(found[2], self.cfg, force=os.environ.get("ROLLOUT_RESUME_FORCE") == "1")
            except store.ConfigMismatch as exc:
                raise ConfigError(f"{found[0]}: {exc}") from None
        if not trainer.sharded_checkpoint:
            # Replicated backend: rank 0 read the file; the others take the same state from it.
            found = g.bcast(found, root=0)
        assert found is not None  # step is not None: every rank has the checkpoint (shards: all or none)
        trainer.load_checkpoint_state(found[1])
        for key, obj in self.extras.items():
            if key in found[1]:  # a checkpoint from before the object existed: it starts fresh
                obj.load_state_dict(found[1][key])
        if self.world.group_rank == 0:
            print(f"rollout-hpc: resumed from {found[0]} (after step {step})", file=sys.stderr, flush=True)
        return step

    def _load_shards(self) -> tuple[Path, dict, dict] | None:
        """(path, state, meta) of this rank's part of the newest sharded checkpoint that verifies, or None. Collective.

        Rank r of M reads shard r, and after a change of trainer count (N shards) also shards r+M, r+2M, ...
        (or shard r mod N when r >= N); it gets their deep union. The backend's shards are made for that
        (per-parameter entries by name, common entries equal in every shard: backends/train_deepspeed.py).
        A checkpoint any rank finds damaged is skipped by all, with one warning line, as load_latest_valid does."""
        store, g, r, m = self.store, self.world.group_comm, self.world.group_rank, self.world.group_size
        damaged: list[str] = []
        for info in reversed(g.bcast(store.list_checkpoints(self.run_dir) if r == 0 else None, root=0)):
            found, error = [], None
            try:
                if r == 0:  # shard 0 first: it checks the manifest and says how many shards there are
                    found.append(store.load_checkpoint(info, shard=0))
                    if "n_shards" not in found[0][2]:
                        raise store.CheckpointError(
                            f"{info.path} was written by the replicated '{found[0][2].get('backend')}' trainer, not one "
                            f"shard per rank: resume with trainer.backend={found[0][2].get('backend')}"
                        )
            except store.CheckpointCorrupt as exc:
                error = str(exc)
            n = g.bcast(None if error else int(found[0][2]["n_shards"]) if r == 0 else None, root=0)
            if n is not None:
                wanted = [r % n, *(s for s in range(r, n, m) if s != r % n)]
                try:
                    found += [store.load_checkpoint(info, shard=s) for s in wanted if not (r == 0 and s == 0)]
                except store.CheckpointCorrupt as exc:
                    error = str(exc)
            errors = [e for e in g.allgather(error) if e]
            if not errors:
                if r == 0:
                    store.warn_skipped(damaged, info.path)
                return found[0][0], _deep_union([state for _, state, _ in found]), found[0][2]
            damaged.append(errors[0])
        if damaged:
            raise store.every_checkpoint_damaged(self.run_dir, damaged)
        return None


def _deep_union(trees: list[dict]) -> dict:
    """One nested state from several: mappings merge key by key; any other value is the first tree's."""
    out = dict(trees[0])
    for tree in trees[1:]:
        for key, value in tree.items():
            if key not in out:
                out[key] = value
            elif isinstance(out[key], dict) and isinstance(value, dict):
                out[key] = _deep_union([out[key], value])
    return out
