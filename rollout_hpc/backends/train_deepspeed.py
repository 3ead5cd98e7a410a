"""DeepSpeed trainer: ZeRO stages 0-3 over the trainer group.

On CPUs it runs with DS_ACCELERATOR=cpu and the gloo backend (DeepSpeed
JIT-builds a small shared-memory op with g++ the first time); on GPUs with
NCCL. torch.distributed is started from the MPI trainer group first, so
DeepSpeed finds it initialised and never looks for a launcher's environment.

Under ZeRO-3 the parameters are partitioned: `full_weights` gathers them
(collective over the group) so the weight sync can send whole tensors.
Optimizer states stay partitioned; a checkpoint keeps each rank's shard as an
opaque blob, so a resume needs the same number of trainer ranks.
"""

from __future__ import annotations

import io
import os
from typing import Any

import numpy as np
import torch

from rollout_hpc.backends.trainer import (
    Trainer,
    TrainerError,
    init_torch_distributed,
    model_logits,
)
from rollout_hpc.store.rng import capture_rng_state, restore_rng_state


def deepspeed_config(cfg) -> dict:
    """The DeepSpeed JSON config built from the run config."""
    a, t = cfg.algorithm, cfg.trainer
    zero: dict[str, Any] = {"stage": t.zero_stage}
    if t.zero_stage == 3:
        # gather small tiny-model layers eagerly; keeps CPU runs from thrashing on many tiny all-gathers
        zero.update({"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0})
    conf = {
        # we call forward/backward/step ourselves, one micro-batch per step
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": a.max_grad_norm,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if cfg.model.dtype == "bfloat16" and t.gpus_per_task > 0:
        conf["bf16"] = {"enabled": True}
    elif cfg.model.dtype == "float16" and t.gpus_per_task > 0:
        conf["fp16"] = {"enabled": True}
    return conf


def _ninja_on_path() -> None:
    """DeepSpeed JIT-builds its CPU communication op with ninja; the pip `ninja` package puts it next to
    the interpreter, which is not on PATH when a venv's python is run by full path (mpirun, srun)."""
    import shutil
    import sys

    if shutil.which("ninja") is None:
        bindir = os.path.dirname(sys.executable)
        if os.path.exists(os.path.join(bindir, "ninja")):
            os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")


class DeepSpeedTrainer(Trainer):
    def __init__(self, cfg, model: torch.nn.Module, world):
        on_gpu = cfg.trainer.gpus_per_task > 0 and torch.cuda.is_available()
        if not on_gpu:
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
            _ninja_on_path()
        try:
            import deepspeed
        except ImportError as exc:
            raise TrainerError(f"trainer.backend 'deepspeed' needs the deepspeed package ({exc}); pip install deepspeed, or use backend 'torch'") from None
        super().__init__(cfg, world)
        if on_gpu:
            torch.cuda.set_device(self.device)
        backend = "nccl" if on_gpu else "gloo"
        init_torch_distributed(world, backend)
        deepspeed.init_distributed(dist_backend=backend, verbose=False)
        self._deepspeed = deepspeed
        self.stage = cfg.trainer.zero_stage
        a = cfg.algorithm
        model = model.to(self.device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.99), weight_decay=0.0)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(cfg))
        self.module = self.engine.module

    def _forward_logits(self, input_ids, attention_mask):
        return model_logits(self.engine, input_ids, attention_mask)

    def _set_train(self, mode: bool) -> None:
        self.engine.train(mode)

    def _backward_and_step(self, loss: torch.Tensor) -> float:
        self.engine.backward(loss)
        self.engine.step()  # clips to gradient_clipping, steps, zeroes grads
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def _gathered(self, modifier_rank=None):
        """Context in which every parameter is whole (a no-op below ZeRO-3)."""
        import contextlib

        if self.stage != 3:
            return contextlib.nullcontext()
        return self._deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=modifier_rank)

    def full_weights(self) -> dict[str, np.ndarray]:
        # Collective under ZeRO-3: every trainer rank must call it.
        with self._gathered():
            return {k: v.detach().float().cpu().numpy().copy() for k, v in self.module.state_dict().items()}

    def load_full_weights(self, weights: dict[str, np.ndarray] | None) -> None:
        """Set every parameter from group rank 0's `weights` (other ranks may pass None). Collective."""
        import torch.distributed as dist

        with self._gathered(modifier_rank=0), torch.no_grad():
            tensors = self.module.state_dict(keep_vars=True)
            if self.world.group_rank == 0:
                for name, tensor in tensors.items():
                    tensor.data.copy_(torch.as_tensor(np.asarray(weights[name])).to(tensor.dtype))
            if self.stage != 3:  # replicated parameters: rank 0's values everywhere
                for tensor in tensors.values():
                    dist.broadcast(tensor.data, src=0)
        if self.stage in (1, 2) and hasattr(self.engine.optimizer, "refresh_fp32_params"):
            # ZeRO-1/2 keep an fp32 master copy of each partition: refresh it from the new weights.
            self.engine.optimizer.refresh_fp32_params()

    sharded_checkpoint = True

    def state_dict_for_checkpoint(self) -> dict[str, Any]:
        """This rank's shard: its partition of the optimizer (an opaque torch.save blob: DeepSpeed's
        state holds Python objects HDF5 cannot), and on group rank 0 the full weights."""
        weights = self.full_weights()  # collective under ZeRO-3
        blob = io.BytesIO()
        torch.save(self.engine.optimizer.state_dict(), blob)
        state = {
            "optimizer_blob": np.frombuffer(blob.getvalue(), np.uint8),
            "zero_stage": self.stage,
            "n_ranks": self.world.group_size,
            "rng": capture_rng_state(),
            "steps_done": self.steps_done,
        }
        if self.world.group_rank == 0:
            state["weights"] = weights
        return state

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        n = self.world.group_size
        if int(state["zero_stage"]) != self.stage or int(state["n_ranks"]) != n:
            raise TrainerError(
                f"the checkpoint's DeepSpeed state is for ZeRO-{int(state['zero_stage'])} over {int(state['n_ranks'])} rank(s); "
                f"this run has ZeRO-{self.stage} over {n}: resume with the same trainer.zero_stage and trainer ranks"
            )
        self.load_full_weights(state.get("weights"))
        sd = torch.load(io.BytesIO(np.asarray(state["optimizer_blob"], np.uint8).tobytes()), weights_only=False)
        if self.stage == 0:
            self.engine.optimizer.load_state_dict(sd)
        else:
            # ZeRO's loader takes every rank's state and picks its own by data-parallel rank.
            self.engine.optimizer.load_state_dict([sd] * n, load_from_fp32_weights=True)
        restore_rng_state(state["rng"])
        self.steps_done = int(state["steps_done"])
