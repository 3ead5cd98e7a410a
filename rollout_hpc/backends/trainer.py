"""The one interface every trainer backend offers, and the factory that picks one.

A trainer owns the policy being optimised on the trainer group's ranks. The RL
loop only talks to it through this interface, so torch DDP, DeepSpeed ZeRO and
Megatron-core are interchangeable by `trainer.backend`:

    trainer = make_trainer(cfg, model, world)
    logp, ent = trainer.logprobs(input_ids, attention_mask)      # no grad, per token
    metrics = trainer.train_step(batch, loss_fn)                 # forward, loss, backward, clip, step
    trainer.full_weights()                                       # {name: ndarray} on group rank 0 (for the generators)
    trainer.state_dict_for_checkpoint() / load_checkpoint_state(state)

Per-token log-probabilities are aligned with the input tokens: `logp[:, t]` is
log p(x_t | x_<t) (so column 0 is 0); padding and prompt positions are masked
by the caller's loss.
"""

from __future__ import annotations

import os
import socket
import time
from abc import ABC, abstractmethod
from typing import Any, Callable

import numpy as np
import torch

from rollout_hpc.config import UserError

# loss_fn(logprobs [B,T], entropy [B,T], batch) -> (scalar loss, {metric: float})
LossFn = Callable[[torch.Tensor, torch.Tensor, dict], "tuple[torch.Tensor, dict[str, float]]"]


class TrainerError(UserError):
    """A trainer backend that cannot run here; the message says what to use instead."""


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log p(x_t | x_<t) and the entropy of that prediction, shape [B, T], column 0 = 0.

    Logits are divided by the sampling temperature so the trainer scores tokens
    under the same distribution the generators sampled from.
    """
    logits = logits[:, :-1].float() / temperature
    logz = torch.logsumexp(logits, dim=-1)
    picked = torch.gather(logits, -1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1) - logz
    probs = torch.softmax(logits, dim=-1)
    entropy = logz - (probs * logits).sum(-1)
    pad = picked.new_zeros(picked.shape[0], 1)
    return torch.cat([pad, picked], 1), torch.cat([pad, entropy], 1)


def model_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Logits of a Hugging Face style causal LM (or any module returning logits)."""
    # Right-padded rows: the default positions 0..T-1 are each real token's index, as in generation.
    out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return out.logits if hasattr(out, "logits") else out


def trainer_device(cfg, world) -> torch.device:
    if cfg.trainer.gpus_per_task > 0 and torch.cuda.is_available():
        return torch.device("cuda", world.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_torch_distributed(world, backend: str) -> None:
    """Start torch.distributed over the MPI trainer group (not the whole world).

    Trainer group rank 0 picks a free TCP port and broadcasts its address over
    the group's MPI communicator; rank and size come from that communicator, so
    no launcher-specific environment (torchrun, SLURM_PROCID) is needed.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return
    comm = world.group_comm
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        host = socket.gethostname()
        addr = socket.gethostbyname(host)
        info = (host, addr, port)
    else:
        info = None
    host, addr, port = comm.bcast(info, root=0)
    if all(h == host for h in comm.allgather(socket.gethostname())):
        addr = "127.0.0.1"  # one node: loopback works even where the hostname resolves oddly
    os.environ.setdefault("MASTER_ADDR", addr)
    os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{addr}:{port}",
        rank=comm.Get_rank(),
        world_size=comm.Get_size(),
    )


class Trainer(ABC):
    """Common part: scoring tokens and the loss plumbing; backends supply the engine."""

    def __init__(self, cfg, world):
        self.cfg = cfg
        self.world = world
        self.temperature = cfg.algorithm.temperature
        self.device = trainer_device(cfg, world)
        self.steps_done = 0

    # --- what the backend provides -----------------------------------------
    @abstractmethod
    def _forward_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def _backward_and_step(self, loss: torch.Tensor) -> float:
        """Backpropagate, clip to algorithm.max_grad_norm, step; returns the pre-clip gradient norm."""

    @abstractmethod
    def _set_train(self, mode: bool) -> None: ...

    @abstractmethod
    def full_weights(self) -> dict[str, np.ndarray]:
        """All parameters by name as float32 numpy arrays (complete on group rank 0; {} elsewhere may be returned)."""

    @abstractmethod
    def load_full_weights(self, weights: dict[str, np.ndarray]) -> None: ...

    # Checkpoints: a replicated backend (torch DDP) saves one file from group rank 0; a sharded
    # one (DeepSpeed ZeRO) saves one shard per rank, and each rank loads its own shard back.
    sharded_checkpoint = False

    @abstractmethod
    def state_dict_for_checkpoint(self) -> dict[str, Any]:
        """Everything to continue training: weights, optimizer, RNG, step count (this rank's shard if sharded).
        Collective over the trainer group for sharded backends."""

    @abstractmethod
    def load_checkpoint_state(self, state: dict[str, Any]) -> None: ...

    # --- shared --------------------------------------------------------------
    def _to_device(self, batch: dict) -> dict:
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    @torch.no_grad()
    def logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor | None = None):
        """Per-token log-probabilities and entropies under the current weights (no grad), on the CPU.

        With a response_mask, positions outside it are zeroed.
        """
        self._set_train(False)
        ids, mask = input_ids.to(self.device), attention_mask.to(self.device)
        logp, ent = token_logprobs(self._forward_logits(ids, mask), ids, self.temperature)
        if response_mask is not None:
            m = response_mask.to(self.device, logp.dtype)
            logp, ent = logp * m, ent * m
        return logp.cpu(), ent.cpu()

    def train_step(self, batch: dict, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step on this rank's share of the batch (gradients averaged over the group).

        `batch` needs input_ids and attention_mask ([B, T]); everything else is
        passed through to `loss_fn(logprobs, entropy, batch)`.
        """
        def loss_on_logits(logits, b):
            logp, ent = token_logprobs(logits, b["input_ids"], self.temperature)
            return loss_fn(logp, ent, b)

        return self.optimize(batch, loss_on_logits)

    @torch.no_grad()
    def outputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The model's raw output (logits; values for a critic) under the current weights, on the CPU."""
        self._set_train(False)
        return self._forward_logits(input_ids.to(self.device), attention_mask.to(self.device)).cpu()

    def optimize(self, batch: dict, loss_on_output: Callable) -> dict[str, float]:
        """Forward, `loss_on_output(model_output, batch) -> (loss, metrics)`, backward, clip, step.
        Any model works: the policy (output = logits) or PPO's critic (output = values)."""
        t0 = time.perf_counter()
        self._set_train(True)
        batch = self._to_device(batch)
        output = self._forward_logits(batch["input_ids"], batch["attention_mask"])
        loss, metrics = loss_on_output(output, batch)
        grad_norm = self._backward_and_step(loss)
        self.steps_done += 1
        out = {k: float(v) for k, v in metrics.items()}
        out["loss"] = float(loss.detach())
        out["grad_norm"] = float(grad_norm)
        out["train_compute_time"] = time.perf_counter() - t0  # forward, loss, backward, optimizer: the model's share
        return out

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


_BACKENDS = {
    "torch": "rollout_hpc.backends.train_torch:TorchTrainer",
    "deepspeed": "rollout_hpc.backends.train_deepspeed:DeepSpeedTrainer",
    "megatron": "rollout_hpc.backends.train_megatron:MegatronTrainer",
}


def make_trainer(cfg, model, world) -> Trainer:
    """The trainer for cfg.trainer.backend, wrapping `model` (an nn.Module on the CPU)."""
    import importlib

    name = cfg.trainer.backend
    if name not in _BACKENDS:
        raise TrainerError(f"trainer.backend '{name}' is unknown; use one of {', '.join(_BACKENDS)}")
    module_name, cls_name = _BACKENDS[name].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(cfg, model, world)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def cross_entropy_loss_fn(logp, ent, batch):
    """Supervised next-token loss over `loss_mask` positions (used to sanity-check backends)."""
    mask = batch["loss_mask"].to(logp.dtype)
    return -masked_mean(logp, mask), {"entropy": float(masked_mean(ent.detach(), mask))}


__all__ = [
    "Trainer",
    "TrainerError",
    "make_trainer",
    "token_logprobs",
    "model_logits",
    "init_torch_distributed",
    "masked_mean",
    "cross_entropy_loss_fn",
]
