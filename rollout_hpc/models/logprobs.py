"""Teacher-forced scoring of responses: the log-probability a model gives each response
token, the quantity the trainer needs (and the generator's sampling log-probs must match).

Layout: prompts are left-padded and responses right-padded, so every response starts at the
same column and the result is [B, T_response], matching the algos' [B, T] convention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout_hpc.algos import entropy_from_logits


def left_pad(seqs: list[list[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (ids [B, L], attention_mask [B, L]) padded on the left."""
    width = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, width - len(s) :] = torch.as_tensor(list(s), dtype=torch.long)
            mask[i, width - len(s) :] = 1
    return ids.to(device), mask.to(device)


def right_pad(seqs: list[list[int]], pad_value, dtype=torch.long, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Lists -> (values [B, T], mask [B, T]) padded on the right."""
    width = max((len(s) for s in seqs), default=0)
    out = torch.full((len(seqs), width), pad_value, dtype=dtype)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            out[i, : len(s)] = torch.as_tensor(list(s), dtype=dtype)
            mask[i, : len(s)] = 1
    return out.to(device), mask.to(device)


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
