"""Plain PyTorch trainer: DistributedDataParallel over the trainer group.

gloo on CPUs, NCCL on GPUs. With one trainer rank the model is not wrapped in
DDP (nothing to all-reduce), but torch.distributed is still started so the
code path is the same at every scale. Micro-batches accumulate gradients under
DDP's no_sync(); the last one's backward all-reduces the sum.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from rollout_hpc.backends.optimizer import make_optimizer
from rollout_hpc.backends.trainer import EngineTrainer, init_torch_distributed
from rollout_hpc.models import lora
from rollout_hpc.store.rng import capture_rng_state, restore_rng_state


class TorchTrainer(EngineTrainer):
    def __init__(self, cfg, model: torch.nn.Module, world):
        super().__init__(cfg, world)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        init_torch_distributed(world, "nccl" if self.device.type == "cuda" else "gloo")
        self.module = model.to(self.device)
        # A ScoringModel (chunked log-probs inside the engine's forward), wrapped in DDP across several ranks.
        self.engine: torch.nn.Module = self._prepare_model(self.module)
        if world.group_size > 1:
            self.engine = DistributedDataParallel(
                self.engine, device_ids=[self.device.index] if self.device.type == "cuda" else None
            )
        self.optimizer = make_optimizer(self.module.parameters(), cfg.algorithm)

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _micro_batch_context(self, last: bool):
        # DDP all-reduces in the backward of the last micro-batch only; no_sync must cover the forward too.
        if last or not isinstance(self.engine, torch.nn.parallel.DistributedDataParallel):
            return contextlib.nullcontext()
        return self.engine.no_sync()

    def _backward(self, loss: torch.Tensor, last: bool) -> None:
        loss.backward()

    def _step(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg.algorithm.max_grad_norm)
        self.optimizer.step()
        return float(norm)

    def full_weights(self) -> dict[str, np.ndarray]:
        # DDP keeps every replica identical, so each rank can answer locally. Copies: the caller
        # may keep them while training goes on (float() and cpu() would alias a float32 CPU tensor).
        if self.lora:
            return self._lora_sync_weights(self.module)
        return {k: v.detach().to("cpu", torch.float32, copy=True).numpy() for k, v in self.module.state_dict().items()}

    def load_full_weights(self, weights: dict[str, np.ndarray]) -> None:
        sd = self.module.state_dict()
        self.module.load_state_dict({k: torch.as_tensor(np.asarray(weights[k])).to(sd[k].dtype) for k in sd})

    def state_dict_for_checkpoint(self) -> dict[str, Any]:
        return {
            "weights": self._checkpoint_weights(self.module),
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),  # a snapshot, not live tensors
            "rng": capture_rng_state(),
            "steps_done": self.steps_done,
            "lr_schedule": self.lr_schedule_state(),
            **self._lora_state(),
        }

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        if self.lora:
            lora.load_adapter_weights(self.module, state["weights"])
        else:
            self.load_full_weights(state["weights"])
        saved = state["optimizer"]
        # Hyper-parameters come from the current config (a resume may change lr); moments from the checkpoint.
        self.optimizer.load_state_dict(
            {"state": saved["state"], "param_groups": self.optimizer.state_dict()["param_groups"]}
        )
        restore_rng_state(state["rng"])
        self.steps_done = int(state["steps_done"])
