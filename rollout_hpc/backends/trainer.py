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
import math
import os
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from rollout_hpc.config import UserError

# loss_fn(logprobs [B,T], entropy [B,T], batch) -> (scalar loss, {metric: float})
LossFn = Callable[[torch.Tensor, torch.Tensor, dict], "tuple[torch.Tensor, dict[str, float]]"]


class TrainerError(UserError):
    """A trainer backend that cannot run here; the message says what to use instead."""


# --- scoring tokens ------------------------------------------------------------------------------
def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log p(x_t | x_<t) and the entropy of that prediction, shape [B, T], column 0 = 0,
    from full logits (the reference implementation; `lm_token_scores` does it in chunks).

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


def _body_and_head(model):
    """(decoder returning last hidden states, output projection) of a HF causal LM whose logits are
    exactly head(hidden) (Llama, Qwen2, Mistral, ...); None where that is not known to hold."""
    body, head = getattr(model, "model", None), getattr(model, "lm_head", None)
    if not isinstance(body, torch.nn.Module) or not isinstance(head, torch.nn.Linear):
        return None
    conf = getattr(model, "config", None)
    if getattr(conf, "final_logit_softcapping", None) or getattr(conf, "logit_scale", None) not in (None, 1, 1.0):
        return None  # logits are transformed after the projection: score from the model's own logits
    return body, head


def _chunk_scores(head: torch.nn.Module, temperature: float, hidden: torch.Tensor, targets: torch.Tensor):
    """log p(target) and entropy for [N, H] hidden states: one chunk's [N, V] fp32 logits, freed on return."""
    logits = head(hidden).float() / temperature
    logz = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logz
    entropy = logz - (torch.exp(logits - logz.unsqueeze(-1)) * logits).sum(-1)
    return picked, entropy


def lm_token_scores(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int | None = 1024,
    positions: torch.Tensor | None = None,
):
    """(logp, entropy) [B, T] as `token_logprobs(model_logits(...))`, without full-vocabulary logits.

    Only the positions where `positions` is non-zero are scored (all but column 0 if None); the rest are 0.
    The last hidden states are projected `chunk_tokens` tokens at a time; under autograd each chunk is
    recomputed in backward (activation checkpointing), so at most one chunk of fp32 logits is alive.
    chunk_tokens None, or a model whose logits are not a plain projection: full logits (the old path).
    """
    split = _body_and_head(model) if chunk_tokens else None
    B, T = input_ids.shape
    if split is None:
        logp, ent = token_logprobs(model_logits(model, input_ids, attention_mask), input_ids, temperature)
        if positions is not None:
            m = (positions != 0).to(logp.dtype)
            logp, ent = logp * m, ent * m
        return logp, ent
    body, head = split
    assert chunk_tokens is not None  # split is looked for only with chunk_tokens
    hidden = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    sel = (
        torch.ones(B, T - 1, dtype=torch.bool, device=input_ids.device) if positions is None else positions[:, 1:] != 0
    )
    rows, cols = sel.nonzero(as_tuple=True)
    h, targets = hidden[:, :-1][rows, cols], input_ids[:, 1:][rows, cols]
    fn = partial(_chunk_scores, head, temperature)
    pieces = []
    for s in range(0, h.shape[0], chunk_tokens):
        hs, ts = h[s : s + chunk_tokens], targets[s : s + chunk_tokens]
        pieces.append(checkpoint(fn, hs, ts, use_reentrant=False) if hs.requires_grad else fn(hs, ts))
    logp = hidden.new_zeros(B, T, dtype=torch.float32)
    ent = hidden.new_zeros(B, T, dtype=torch.float32)
    if pieces:
        lp, en = torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])
        logp = logp.index_put((rows, cols + 1), lp)
        ent = ent.index_put((rows, cols + 1), en)
    elif torch.is_grad_enabled() and hidden.requires_grad:
        # Nothing to score (every mask zero): still use the head once, times 0, so the loss has a graph and
        # every parameter a gradient (DDP and ZeRO wait for all of them).
        lp, en = fn(hidden[:1, 0], input_ids[:1, 0])
        logp = logp + 0.0 * lp.sum()
        ent = ent + 0.0 * en.sum()
    return logp, ent


@torch.no_grad()
def score_tokens(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, cfg, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-token log-probs [B, T] of a model outside any engine (the frozen reference), on the CPU: in
    micro-batches of trainer.max_tokens_per_microbatch / micro_batch_size, chunked like the trainer's."""
    t = cfg.trainer
    device = next(model.parameters()).device
    B, T = input_ids.shape
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    if positions is not None:
        batch["mask"] = positions
    parts = split_micro_batches(attention_mask, t.max_tokens_per_microbatch, t.micro_batch_size)
    outs = []
    for rows in parts:
        mb = batch if len(parts) == 1 else micro_batch(batch, rows)
        mb = {k: v.to(device) for k, v in mb.items()}
        lp = lm_token_scores(
            model,
            mb["input_ids"],
            mb["attention_mask"],
            cfg.algorithm.temperature,
            t.logprob_chunk_tokens,
            mb.get("mask"),
        )[0]
        outs.append(_pad_time(lp.cpu(), T))
    return torch.cat(outs) if outs else torch.zeros(0, T)


class ScoringModel(torch.nn.Module):
    """What the engines (DDP, DeepSpeed) wrap: the model, whose forward gives either its raw output
    (logits; values for a critic) or chunked per-token log-probs, so everything runs inside the
    engine's forward (DDP's gradient hooks, ZeRO-3's parameter gathering). Names of parameters are
    the inner model's: backends keep `self.module = scoring.model`."""

    def __init__(self, model: torch.nn.Module, temperature: float, chunk_tokens: int | None):
        super().__init__()
        self.model = model
        self.temperature = temperature
        self.chunk_tokens = chunk_tokens

    def forward(self, input_ids, attention_mask, positions=None, scores: bool = False):
        if not scores:
            return model_logits(self.model, input_ids, attention_mask)
        return lm_token_scores(self.model, input_ids, attention_mask, self.temperature, self.chunk_tokens, positions)


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


# --- micro-batches -----------------------------------------------------------------------------
def split_micro_batches(
    attention_mask: torch.Tensor, max_tokens: int | None = None, max_rows: int | None = None, min_parts: int = 1
) -> list[np.ndarray]:
    """Contiguous row ranges whose padded size (rows x longest row) stays within `max_tokens` and whose row
    count within `max_rows` (a row longer than the budget is a micro-batch of its own); then the largest
    parts are halved until there are at least `min_parts` (so every rank of a group can run the same number).
    With neither bound: one part, all rows."""
    lengths = (
        attention_mask.sum(dim=1).cpu().numpy().astype(np.int64) if attention_mask.numel() else np.zeros(0, np.int64)
    )
    n = len(lengths)
    parts: list[np.ndarray] = []
    start = 0
    longest = 0
    for i in range(n):
        longest_with = max(longest, int(lengths[i]), 1)
        rows_with = i - start + 1
        over = (max_tokens is not None and rows_with * longest_with > max_tokens) or (
            max_rows is not None and rows_with > max_rows
        )
        if over and i > start:
            parts.append(np.arange(start, i))
            start, longest_with = i, max(int(lengths[i]), 1)
        longest = longest_with
    if n:
        parts.append(np.arange(start, n))
    else:
        parts.append(np.arange(0))
    while len(parts) < min_parts:
        big = max(range(len(parts)), key=lambda k: len(parts[k]))
        if len(parts[big]) < 2:
            parts.append(np.arange(0))  # fewer rows than parts: an empty micro-batch (weight 0)
            continue
        half = len(parts[big]) // 2
        parts[big : big + 1] = [parts[big][:half], parts[big][half:]]
    return parts


def micro_batch(batch: dict, rows: np.ndarray) -> dict:
    """Rows of every [B, ...] tensor; [B, T] tensors trimmed to the longest row (right padding only).
    No rows: row 0 with every mask zeroed (a weight-0 micro-batch that keeps collectives in step)."""
    attn = batch["attention_mask"]
    B, T = attn.shape
    empty = len(rows) == 0
    idx = torch.from_numpy(np.asarray(rows if not empty else [0], np.int64)).to(attn.device)
    keep = int(attn.index_select(0, idx).sum(dim=1).max()) if B else T
    keep = max(min(keep, T), 2)
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == B:
            v = v.index_select(0, idx)
            if v.dim() >= 2 and v.shape[1] == T:
                v = v[:, :keep]
            if empty and k in ("mask", "loss_mask"):
                v = torch.zeros_like(v)
        out[k] = v
    return out


def micro_batch_weights(batch: dict, parts: list[np.ndarray], agg: str | None, mask_key: str) -> list[float]:
    """Each micro-batch's share of the step's loss, so that sum_i w_i * loss(micro-batch i) equals the loss
    of the whole batch: its share of the valid tokens (token_mean), of the sequences with a valid token
    (seq_mean), or of the rows (no mask)."""
    mask = batch.get(mask_key)
    if mask is None or agg is None:
        counts = [float(len(p)) for p in parts]
    elif agg == "token_mean":
        per_row = mask.sum(dim=-1).double().cpu().numpy()
        counts = [float(per_row[p].sum()) for p in parts]
    elif agg == "seq_mean":
        per_row = (mask.sum(dim=-1) > 0).double().cpu().numpy()
        counts = [float(per_row[p].sum()) for p in parts]
    else:
        raise ValueError(f"loss aggregation '{agg}' is not one of token_mean, seq_mean")
    total = sum(counts)
    if total <= 0:  # nothing to learn from: every part counts by its rows (the loss is 0 anyway)
        counts, total = [float(len(p)) for p in parts], float(max(sum(len(p) for p in parts), 1))
    return [c / total for c in counts]


def _pad_time(x: torch.Tensor, T: int) -> torch.Tensor:
    """Right-pad dimension 1 ([b, t, ...]) to T with zeros."""
    return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, T - x.shape[1]))


# --- optimizer and learning-rate schedule ------------------------------------------------------
def make_optimizer(params, algorithm) -> torch.optim.Optimizer:
    """AdamW from algorithm.lr, adam_betas, adam_eps, weight_decay (one parameter group, as verl)."""
    a = algorithm
    return torch.optim.AdamW(params, lr=a.lr, betas=tuple(a.adam_betas), eps=a.adam_eps, weight_decay=a.weight_decay)


def lr_at(algorithm, step: int) -> float:
    """The learning rate of optimizer step `step` (0-based): linear warmup over algorithm.warmup_steps from
    lr/warmup_steps, then constant, or linear / cosine decay to lr * min_lr_ratio at the last update
    (algorithm.steps x mini_batches x epochs optimizer steps in the run)."""
    a = algorithm
    if a.warmup_steps and step < a.warmup_steps:
        return a.lr * (step + 1) / a.warmup_steps
    if a.lr_schedule == "constant":
        return a.lr
    total = a.steps * a.mini_batches * a.epochs
    span = max(total - a.warmup_steps - 1, 1)
    progress = min(max(step - a.warmup_steps, 0) / span, 1.0)
    floor = a.lr * a.min_lr_ratio
    if a.lr_schedule == "linear":
        return floor + (a.lr - floor) * (1.0 - progress)
    if a.lr_schedule == "cosine":
        return floor + (a.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"algorithm.lr_schedule '{a.lr_schedule}' is not one of constant, linear, cosine")


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

    def _prepare_model(self, model: torch.nn.Module) -> ScoringModel:
        """The module an engine wraps (gradient checkpointing switched on first when configured)."""
        if self.cfg.trainer.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        return ScoringModel(model, self.temperature, self.chunk_tokens)

    # --- what the backend provides -----------------------------------------
    @abstractmethod
    def _forward_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor: ...

    def _forward_scores(self, input_ids, attention_mask, positions=None):
        """(logp, entropy) [B, T]; backends whose engine wraps a ScoringModel do it in chunks."""
        logp, ent = token_logprobs(self._forward_logits(input_ids, attention_mask), input_ids, self.temperature)
        if positions is not None:
            m = (positions != 0).to(logp.dtype)
            logp, ent = logp * m, ent * m
        return logp, ent

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
        parts = split_micro_batches(attention_mask, self.max_tokens, self.max_rows)
        if collective and self.world.group_size > 1 and (self.max_tokens or self.max_rows):
            # ZeRO-2/3 reduce gradients (and ZeRO-3 gathers parameters) in every backward / forward: every rank
            # must run the same number of micro-batches. The largest count wins; the others split further.
            from mpi4py import MPI

            n = self.world.group_comm.allreduce(len(parts), op=MPI.MAX)
            parts = split_micro_batches(attention_mask, self.max_tokens, self.max_rows, min_parts=n)
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
                outs.append([_pad_time(r.cpu(), T) for r in res])
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
