"""Teacher-forced scoring of responses: the log-probability a model gives each response
token, the quantity the trainer needs (and the generator's sampling log-probs must match).

Layout: prompts are left-padded and responses right-padded, so every response starts at the
same column and the result is [B, T_response], matching the algos' [B, T] convention.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rollout_hpc.algos import entropy_from_logits


def _pad(seqs, pad_value, dtype, left: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    """One scatter for the whole batch: a per-row tensor copy costs ~10 us, 1.3 ms for a step's 128 prompts."""
    lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    width = int(lengths.max(initial=0))
    out = torch.full((len(seqs), width), pad_value, dtype=dtype)
    start = (width - lengths) if left else np.zeros_like(lengths)
    column = np.arange(width)[None, :] - start[:, None]  # column within each row's tokens
    mask = torch.from_numpy(((column >= 0) & (column < lengths[:, None])).astype(np.int64))
    if lengths.sum():
        flat = torch.as_tensor(np.concatenate([np.asarray(s) for s in seqs if len(s)]), dtype=dtype)
        out[mask.bool()] = flat  # row-major order: each row's tokens land in its own columns, in order
    return out.to(device), mask.to(device)


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (ids [B, L], attention_mask [B, L]) padded on the left."""
    return _pad(seqs, pad_id, torch.long, True, device)


def right_pad(seqs: Sequence[Sequence], pad_value, dtype=torch.long, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Lists -> (values [B, T], mask [B, T]) padded on the right."""
    return _pad(seqs, pad_value, dtype, False, device)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions count only real tokens: a left-padded prompt starts at position 0."""
    return (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)


@dataclass
class ResponseScores:
    logprobs: torch.Tensor  # [B, T] log-softmax(logits / temperature) at each response token, 0 on padding
    mask: torch.Tensor  # [B, T] 1 on real response tokens
    entropy: torch.Tensor | None  # [B, T] entropy of softmax(logits / temperature), if asked for


def response_logprobs(
    model,
    prompts: list[list[int]],
    responses: list[list[int]],
    pad_id: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> ResponseScores:
    """Score `responses` given `prompts` in one forward pass (gradients flow unless the
    caller wraps it in torch.no_grad)."""
    device = next(model.parameters()).device
    p_ids, p_mask = left_pad(prompts, pad_id, device)
    r_ids, r_mask = right_pad(responses, pad_id, device=device)
    ids = torch.cat([p_ids, r_ids], dim=1)
    attn = torch.cat([p_mask, r_mask], dim=1)
    logits = model(
        input_ids=ids, attention_mask=attn, position_ids=position_ids_from_mask(attn), use_cache=False
    ).logits
    P, T = p_ids.shape[1], r_ids.shape[1]
    # Logits at column c predict the token at c+1: response token j is predicted at P-1+j.
    scores = logits[:, P - 1 : P - 1 + T].float() / temperature
    logp_all = torch.log_softmax(scores, dim=-1)
    logp = logp_all.gather(-1, r_ids.unsqueeze(-1)).squeeze(-1) * r_mask
    entropy = None
    if with_entropy:
        entropy = entropy_from_logits(scores) * r_mask
    return ResponseScores(logp, r_mask, entropy)
