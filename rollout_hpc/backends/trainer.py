"""The one interface every trainer backend offers, and the factory that picks one.

A trainer owns the policy being optimised on the trainer group's ranks. The RL
loop only talks to it through this interface, so torch DDP, DeepSpeed ZeRO and
Megatron-core are interchangeable by `trainer.backend`:

    trainer = make_trainer(cfg, model, world)
    logp, ent = trainer.logprobs(input_ids, attention_mask)      # no grad, per token
    metrics = trainer.train_step(batch, loss_fn, agg="token_mean")  # micro-batches, backward, clip, one step
    trainer.full_weights()                                       # {name: ndarray} on group rank 0 (for the generators)
    trainer.state_dict_for_checkpoint() / load_checkpoint_state(state)

Per-token log-probabilities are aligned with the input tokens: `logp[:, t]` is
log p(x_t | x_<t) (so column 0 is 0); padding and prompt positions are masked
by the caller's loss.

Memory (docs/training.md): a step's rows are split into micro-batches by
`trainer.max_tokens_per_microbatch` / `trainer.micro_batch_size` with gradient
accumulation, each micro-batch's loss weighted by its share of the step's
tokens (token_mean) or sequences (seq_mean), so the update equals the unsplit
one up to float rounding. Log-probs and entropies are computed from the last
hidden states in chunks of `trainer.logprob_chunk_tokens` tokens (only at the
positions the loss reads), each chunk recomputed in backward, so full-vocabulary
fp32 logits never exist for a whole micro-batch.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rollout_hpc.algos.losses import masked_mean
from rollout_hpc.errors import TrainerError
from rollout_hpc.models import lora
from rollout_hpc.models.packing import check_packable

from .micro_batches import micro_batch, micro_batch_weights, pad_time, split_micro_batches
from .optimizer import lr_at, make_optimizer
from .token_scores import ScoringModel, lm_token_scores, mask_positions, model_logits, score_tokens, token_logprobs

# loss_fn(logprobs [B,T], entropy [B,T], batch) -> (scalar loss, {metric: float})
LossFn = Callable[[torch.Tensor, torch.Tensor, dict], "tuple[torch.Tensor, dict[str, float]]"]


def enable_gradient_checkpointing(model: torch.nn.Module) -> bool:
    """Recompute each decoder layer's activations in backward (HF models; a critic's backbone too)."""
    # Duck-typed (an HF model, or a critic's HF backbone): Any, as torch types module attributes Tensor | Module.
    target: Any = model if hasattr(model, "gradient_checkpointing_enable") else getattr(model, "backbone", None)
    if target is None or not hasattr(target, "gradient_checkpointing_enable"):
        raise TrainerError(
            f"trainer.gradient_checkpointing: {type(model).__name__} has no gradient_checkpointing_enable(); "
            "use a Hugging Face model or turn it off"
        )
    kwargs = {"use_reentrant": False}  # non-reentrant: works under DDP/ZeRO and with inputs that need no grad
    if hasattr(target, "activation_checkpointing_enable"):  # transformers >= 5 (the old name is deprecated)
        target.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return True


def trainer_device(cfg, world) -> torch.device:
    if cfg.trainer.gpus_per_task > 0 and torch.cuda.is_available():
        return torch.device("cuda", world.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


# How long the trainer ranks wait for each other at the rendezvous store (torch's default is 30 minutes).
_STORE_TIMEOUT = timedelta(minutes=10)


def init_torch_distributed(world, backend: str) -> None:
    """Start torch.distributed over the MPI trainer group (not the whole world).

    Trainer group rank 0 starts the rendezvous store on a port the OS picks as it binds (no window in which another
    process can take a port chosen before: that failed with EADDRINUSE) and broadcasts its address over the group's
    MPI communicator; rank and size come from that communicator, so no launcher-specific environment (torchrun,
    SLURM_PROCID) is needed.
    """
    if dist.is_initialized():
        return
    comm = world.group_comm
    hosts = comm.allgather(socket.gethostname())
    store = None
    if comm.Get_rank() == 0:
        # one node: loopback works even where the hostname resolves oddly
        addr = "127.0.0.1" if len(set(hosts)) == 1 else socket.gethostbyname(hosts[0])
        store = dist.TCPStore(addr, 0, comm.Get_size(), is_master=True, timeout=_STORE_TIMEOUT, wait_for_workers=False)
        info = (addr, store.port)
    else:
        info = None
    addr, port = comm.bcast(info, root=0)
    if store is None:
        store = dist.TCPStore(addr, port, comm.Get_size(), is_master=False, timeout=_STORE_TIMEOUT)
    os.environ.setdefault("MASTER_ADDR", addr)  # for libraries that read them (DeepSpeed)
    os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group(backend=backend, store=store, rank=comm.Get_rank(), world_size=comm.Get_size())


class Trainer(ABC):
    """Common part: micro-batching, scoring tokens, the loss plumbing and the LR schedule;
    backends supply the engine."""

    # Backends that implement _zero_grad / _backward(loss, last) / _step() accumulate gradients over
    # micro-batches; the others (Megatron here) run one micro-batch per step through _backward_and_step.
    supports_accumulation = False

    optimizer: torch.optim.Optimizer  # set by the backend's __init__
    _fixed_lr: float | None = None  # the learning rate while fixed_lr() is active

    def __init__(self, cfg, world):
        self.cfg = cfg
        self.world = world
        self.temperature = cfg.algorithm.temperature
        self.device = trainer_device(cfg, world)
        self.steps_done = 0  # optimizer steps taken: also the LR schedule's position
        t = cfg.trainer
        self.max_tokens = t.max_tokens_per_microbatch
        self.max_rows = t.micro_batch_size
        self.chunk_tokens = t.logprob_chunk_tokens
        self.packing = t.packing
        self.lora = cfg.model.lora is not None  # make_trainer injected the adapters; the base is frozen

    def _prepare_model(self, model: torch.nn.Module) -> ScoringModel:
        """The module an engine wraps (gradient checkpointing switched on first when configured)."""
        if self.cfg.trainer.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        if self.packing:
            check_packable(model)
        return ScoringModel(model, self.temperature, self.chunk_tokens, self.packing)

    # --- what the backend provides -----------------------------------------
    @abstractmethod
    def _forward_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor: ...

    def _forward_scores(self, input_ids, attention_mask, positions=None):
        """(logp, entropy) [B, T]; backends whose engine wraps a ScoringModel do it in chunks."""
        scores = token_logprobs(self._forward_logits(input_ids, attention_mask), input_ids, self.temperature)
        return mask_positions(*scores, positions)

    def _backward_and_step(self, loss: torch.Tensor) -> float:
        """One micro-batch per step (backends without accumulation)."""
        raise NotImplementedError

    def _zero_grad(self) -> None:
        raise NotImplementedError

    def _backward(self, loss: torch.Tensor, last: bool) -> None:
        """Accumulate this micro-batch's gradients; `last`: the optimizer step follows (sync them)."""
        raise NotImplementedError

    def _step(self) -> float:
        """Clip to algorithm.max_grad_norm and step; returns the pre-clip gradient norm."""
        raise NotImplementedError

    def _micro_batch_context(self, last: bool):
        """Entered around each micro-batch's forward and backward (DDP: no_sync() but for the last)."""
        return contextlib.nullcontext()

    def _param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

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

    # --- LoRA (model.lora) ----------------------------------------------------
    def _lora_sync_weights(self, module: torch.nn.Module) -> dict[str, np.ndarray]:
        """What the generators load with LoRA: the merged weight of every adapted layer under its base name, the
        only tensors that differ from the frozen base. Every generator built that same base (build_policy: the same
        model.path, seeded built-in model or model.init_from), so any one sync, the first after a start or resume
        included, leaves it with exactly the trainer's merged model, whichever versions it skipped."""
        return lora.merged_weights(module)

    def _checkpoint_weights(self, module: torch.nn.Module) -> dict[str, np.ndarray]:
        """The weights a checkpoint holds: every tensor, or with LoRA only the adapters (the base is model.path /
        the seeded built-in model / model.init_from, rebuilt on resume and export)."""
        return lora.adapter_weights(module) if self.lora else self.full_weights()

    def _lora_state(self) -> dict[str, Any]:
        return {"lora": lora.lora_meta(self.cfg.model.lora)} if self.lora else {}

    # --- shared --------------------------------------------------------------
    def _to_device(self, batch: dict) -> dict:
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    @property
    def lr(self) -> float:
        """The learning rate of the next optimizer step (algorithm.lr_schedule at steps_done)."""
        if self._fixed_lr is not None:
            return self._fixed_lr
        return lr_at(self.cfg.algorithm, self.steps_done)

    @contextlib.contextmanager
    def fixed_lr(self, lr: float):
        """Optimizer steps at a constant `lr` that do not advance algorithm.lr_schedule (the SFT warm-up)."""
        steps_done, self._fixed_lr = self.steps_done, lr
        try:
            yield
        finally:
            self.steps_done, self._fixed_lr = steps_done, None

    def lr_schedule_state(self) -> dict[str, Any]:
        """The schedule's state for checkpoints (the schedule is a pure function of the optimizer step)."""
        a = self.cfg.algorithm
        return {"name": a.lr_schedule, "step": self.steps_done, "lr": self.lr}

    def _split(self, attention_mask: torch.Tensor, collective: bool) -> list[np.ndarray]:
        parts = split_micro_batches(attention_mask, self.max_tokens, self.max_rows, packing=self.packing)
        if collective and self.world.group_size > 1 and (self.max_tokens or self.max_rows):
            # ZeRO-2/3 reduce gradients (and ZeRO-3 gathers parameters) in every backward / forward: every rank
            # must run the same number of micro-batches. The largest count wins; the others split further.
            from mpi4py import MPI  # in here: importing mpi4py.MPI initialises MPI (runtime/world.py does it first)

            n = self.world.group_comm.allreduce(len(parts), op=MPI.MAX)
            parts = split_micro_batches(attention_mask, self.max_tokens, self.max_rows, n, self.packing)
        return parts

    @torch.no_grad()
    def _no_grad_map(self, batch: dict, fn) -> list[torch.Tensor]:
        """fn(micro-batch) -> tensor(s) [b, t] per micro-batch (the same count on every rank), right-padded
        back to [B, T] and concatenated, on the CPU."""
        self._set_train(False)
        T = batch["input_ids"].shape[1]
        outs = []
        parts = self._split(batch["attention_mask"], collective=True)
        for rows in parts:
            mb = batch if len(parts) == 1 else micro_batch(batch, rows)  # one part: the batch as it is, untrimmed
            res = fn(self._to_device(mb))
            res = res if isinstance(res, tuple) else (res,)
            if len(rows):
                outs.append([pad_time(r.cpu(), T) for r in res])
        if not outs:
            return [torch.zeros(0, T), torch.zeros(0, T)]
        return [torch.cat(col) for col in zip(*outs)]

    def logprobs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor | None = None
    ):
        """Per-token log-probabilities and entropies under the current weights (no grad), on the CPU.

        With a response_mask, positions outside it are zeroed (and not computed).
        """
        batch = {"input_ids": input_ids, "attention_mask": attention_mask}
        if response_mask is not None:
            batch["mask"] = response_mask
        logp, ent = self._no_grad_map(
            batch, lambda b: self._forward_scores(b["input_ids"], b["attention_mask"], b.get("mask"))
        )
        return logp, ent

    def outputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The model's raw output (logits; values for a critic) under the current weights, on the CPU."""
        batch = {"input_ids": input_ids, "attention_mask": attention_mask}
        return self._no_grad_map(batch, lambda b: self._forward_logits(b["input_ids"], b["attention_mask"]))[0]

    def train_step(
        self, batch: dict, loss_fn: LossFn, agg: str | None = "token_mean", mask_key: str = "mask"
    ) -> dict[str, float]:
        """One optimizer step on this rank's share of the batch (gradients averaged over the group).

        `batch` needs input_ids and attention_mask ([B, T]); everything else is passed through to
        `loss_fn(logprobs, entropy, batch)`, called per micro-batch. `agg` says how loss_fn aggregates over
        `batch[mask_key]` (token_mean | seq_mean), which sets each micro-batch's weight; log-probs are
        computed only where batch[mask_key] is non-zero (everywhere without one) and are 0 elsewhere.
        """

        def loss_on_scores(scores, b):
            return loss_fn(scores[0], scores[1], b)

        return self.optimize(batch, loss_on_scores, agg=agg, mask_key=mask_key, scores=True)

    def optimize(
        self,
        batch: dict,
        loss_on_output: Callable,
        agg: str | None = "token_mean",
        mask_key: str = "mask",
        scores: bool = False,
    ) -> dict[str, float]:
        """Forward, `loss_on_output(model_output, batch) -> (loss, metrics)`, backward per micro-batch, then
        clip and one optimizer step. Any model works: the policy (output = logits, or (logp, entropy) with
        scores=True) or PPO's critic (output = values)."""
        t0 = time.perf_counter()
        self._set_train(True)
        parts = self._split(batch["attention_mask"], collective=True)
        lr = self.lr
        for group in self._param_groups():
            group["lr"] = lr
        if len(parts) == 1:  # today's path: one forward over the whole share, untrimmed, weight 1
            micro: list[tuple[dict, float | None]] = [(batch, None)]
        else:
            if not self.supports_accumulation:
                raise TrainerError(
                    f"trainer.backend '{self.cfg.trainer.backend}' does not accumulate gradients over "
                    "micro-batches; unset trainer.max_tokens_per_microbatch and trainer.micro_batch_size"
                )
            weights = micro_batch_weights(batch, parts, agg, mask_key)
            micro = [(micro_batch(batch, rows), w) for rows, w in zip(parts, weights)]
        if not self.supports_accumulation:
            b = self._to_device(batch)
            loss, metrics = loss_on_output(self._forward_out(b, mask_key, scores), b)
            grad_norm = self._backward_and_step(loss)
            total_loss, out = float(loss.detach()), {k: float(v) for k, v in metrics.items()}
        else:
            self._zero_grad()
            total_loss, out = 0.0, {}
            for i, (mb, w) in enumerate(micro):
                b = self._to_device(mb)
                last = i == len(micro) - 1
                with self._micro_batch_context(last):
                    output = self._forward_out(b, mask_key, scores)
                    loss, metrics = loss_on_output(output, b)
                    self._backward(loss if w is None else loss * w, last=last)
                w = 1.0 if w is None else w
                total_loss += float(loss.detach()) * w
                for k, v in metrics.items():  # per-micro-batch statistics weighted like the loss; maxima: the max
                    out[k] = (
                        max(out.get(k, float(v)), float(v)) if k.endswith("_max") else out.get(k, 0.0) + float(v) * w
                    )
                del output, loss, b
            grad_norm = self._step()
        self.steps_done += 1
        out["loss"] = total_loss
        out["grad_norm"] = float(grad_norm)
        out["lr"] = lr
        out["micro_batches"] = float(len(parts))
        out["train_compute_time"] = time.perf_counter() - t0  # forward, loss, backward, optimizer: the model's share
        return out

    def _forward_out(self, b: dict, mask_key: str, scores: bool):
        if scores:
            return self._forward_scores(b["input_ids"], b["attention_mask"], b.get(mask_key))
        return self._forward_logits(b["input_ids"], b["attention_mask"])

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class EngineTrainer(Trainer):
    """A backend whose engine (DDP, a DeepSpeed engine) wraps the ScoringModel of `_prepare_model`: every forward
    goes through the engine, so its hooks run (gradient all-reduce, ZeRO-3 parameter gathering), and gradients
    accumulate over micro-batches. The backend sets `self.engine` and supplies _zero_grad, _backward and _step."""

    supports_accumulation = True
    engine: Any  # torch DDP / the model itself, or a DeepSpeed engine

    def _forward_logits(self, input_ids, attention_mask):
        return self.engine(input_ids, attention_mask)

    def _forward_scores(self, input_ids, attention_mask, positions=None):
        return self.engine(input_ids, attention_mask, positions, scores=True)

    def _set_train(self, mode: bool) -> None:
        self.engine.train(mode)


_BACKENDS = {
    "torch": "rollout_hpc.backends.train_torch:TorchTrainer",
    "deepspeed": "rollout_hpc.backends.train_deepspeed:DeepSpeedTrainer",
    "megatron": "rollout_hpc.backends.train_megatron:MegatronTrainer",
}


def make_trainer(cfg, model, world) -> Trainer:
    """The trainer for cfg.trainer.backend, wrapping `model` (an nn.Module on the CPU)."""
    name = cfg.trainer.backend
    if name not in _BACKENDS:
        raise TrainerError(f"trainer.backend '{name}' is unknown; use one of {', '.join(_BACKENDS)}")
    if cfg.model.lora is not None:
        if name == "megatron":
            raise TrainerError("model.lora is not supported by trainer.backend 'megatron'; use torch or deepspeed")
        lora.apply_lora(model, cfg.model.lora, seed=cfg.run.seed)  # in place: the backend sees the adapted model
    module_name, cls_name = _BACKENDS[name].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(cfg, model, world)


def cross_entropy_loss_fn(logp, ent, batch):
    """Supervised next-token loss over `loss_mask` positions (used to sanity-check backends)."""
    mask = batch["loss_mask"].to(logp.dtype)
    return -masked_mean(logp, mask), {"entropy": float(masked_mean(ent.detach(), mask))}


# The pieces that live in micro_batches.py, optimizer.py and token_scores.py stay importable from here.
__all__ = [
    "EngineTrainer",
    "LossFn",
    "ScoringModel",
    "Trainer",
    "TrainerError",
    "cross_entropy_loss_fn",
    "enable_gradient_checkpointing",
    "init_torch_distributed",
    "lm_token_scores",
    "lr_at",
    "make_optimizer",
    "make_trainer",
    "micro_batch",
    "micro_batch_weights",
    "model_logits",
    "score_tokens",
    "split_micro_batches",
    "token_logprobs",
    "trainer_device",
]
