"""Scoring tokens: per-token log p(x_t | x_<t) and the entropy of that prediction from a causal LM, at the
sampling temperature, so the trainer scores tokens under the distribution the generators sampled from.

Layout: [B, T] aligned with the right-padded input tokens, column t = log p(x_t | x_<t), column 0 = 0.
`lm_token_scores` projects the last hidden states in chunks of trainer.logprob_chunk_tokens tokens (each
recomputed in backward), so full-vocabulary fp32 logits never exist for a whole micro-batch; `token_logprobs`
is the reference computation from full logits.
"""

from __future__ import annotations

from functools import partial

import torch
from torch.utils.checkpoint import checkpoint

from rollout_hpc.models.packing import PackedRow

from .micro_batches import micro_batch, pad_time, split_micro_batches


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log p(x_t | x_<t) and the entropy of that prediction, shape [B, T], column 0 = 0,
    from full logits (the reference implementation; `lm_token_scores` does it in chunks)."""
    picked, entropy = _picked_and_entropy(logits[:, :-1], input_ids[:, 1:], temperature)
    pad = picked.new_zeros(picked.shape[0], 1)
    return torch.cat([pad, picked], 1), torch.cat([pad, entropy], 1)


def _picked_and_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """log p(target) and the entropy of softmax(logits / temperature), in fp32: [..., V] logits -> [...] each."""
    logits = logits.float() / temperature
    logz = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logz
    entropy = logz - (torch.exp(logits - logz.unsqueeze(-1)) * logits).sum(-1)
    return picked, entropy


def mask_positions(logp: torch.Tensor, ent: torch.Tensor, positions: torch.Tensor | None):
    """(logp, entropy) zeroed where `positions` is 0 (unchanged without positions)."""
    if positions is None:
        return logp, ent
    m = (positions != 0).to(logp.dtype)
    return logp * m, ent * m


def model_logits(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, packing: bool = False, position_ids=None
) -> torch.Tensor:
    """Logits of a Hugging Face style causal LM (or any module returning logits). packing: computed on the real
    tokens as one packed row (models/packing.py), returned in the [B, T, ...] layout with 0 at padding."""
    if packing:
        assert attention_mask is not None  # it says which tokens are real
        row = PackedRow.of(attention_mask)
        return row.unpack(model_logits(model, row.pack(input_ids), None, position_ids=row.position_ids))
    # Right-padded rows: the default positions 0..T-1 are each real token's index, as in generation.
    extra = {} if position_ids is None else {"position_ids": position_ids}
    out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra)
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
    return _picked_and_entropy(head(hidden), targets, temperature)


def lm_token_scores(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    temperature: float = 1.0,
    chunk_tokens: int | None = 1024,
    positions: torch.Tensor | None = None,
    packing: bool = False,
    position_ids: torch.Tensor | None = None,
):
    """(logp, entropy) [B, T] as `token_logprobs(model_logits(...))`, without full-vocabulary logits.

    Only the positions where `positions` is non-zero are scored (all but column 0 if None); the rest are 0.
    The last hidden states are projected `chunk_tokens` tokens at a time; under autograd each chunk is
    recomputed in backward (activation checkpointing), so at most one chunk of fp32 logits is alive.
    chunk_tokens None, or a model whose logits are not a plain projection: full logits (the old path).
    packing: the real tokens scored as one packed row (models/packing.py), returned in the [B, T] layout.
    """
    if packing:
        assert attention_mask is not None  # it says which tokens are real
        row = PackedRow.of(attention_mask)
        scored = row.scored(positions)
        logp, ent = lm_token_scores(
            model, row.pack(input_ids), None, temperature, chunk_tokens, scored, position_ids=row.position_ids
        )
        return row.unpack(logp), row.unpack(ent)
    split = _body_and_head(model) if chunk_tokens else None
    B, T = input_ids.shape
    if split is None:
        logits = model_logits(model, input_ids, attention_mask, position_ids=position_ids)
        scores = token_logprobs(logits, input_ids, temperature)
        return mask_positions(*scores, positions)
    body, head = split
    assert chunk_tokens is not None  # split is looked for only with chunk_tokens
    out = body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    hidden = out.last_hidden_state
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
    parts = split_micro_batches(attention_mask, t.max_tokens_per_microbatch, t.micro_batch_size, packing=t.packing)
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
            packing=t.packing,
        )[0]
        outs.append(pad_time(lp.cpu(), T))
    return torch.cat(outs) if outs else torch.zeros(0, T)


class ScoringModel(torch.nn.Module):
    """What the engines (DDP, DeepSpeed) wrap: the model, whose forward gives either its raw output
    (logits; values for a critic) or chunked per-token log-probs, so everything runs inside the
    engine's forward (DDP's gradient hooks, ZeRO-3's parameter gathering). Names of parameters are
    the inner model's: backends keep `self.module = scoring.model`."""

    def __init__(self, model: torch.nn.Module, temperature: float, chunk_tokens: int | None, packing: bool = False):
        super().__init__()
        self.model = model
        self.temperature = temperature
        self.chunk_tokens = chunk_tokens
        self.packing = packing  # trainer.packing: each forward's sequences as one packed row

    def forward(self, input_ids, attention_mask, positions=None, scores: bool = False):
        if not scores:
            return model_logits(self.model, input_ids, attention_mask, self.packing)
        return lm_token_scores(
            self.model, input_ids, attention_mask, self.temperature, self.chunk_tokens, positions, self.packing
        )
