"""Micro-batches: a step's rows split so that each forward/backward fits in memory, and each part's weight in
the step's loss so that gradient accumulation over the parts equals the unsplit update (docs/training.md).

Bounds: trainer.max_tokens_per_microbatch (rows x longest row) and trainer.micro_batch_size (rows); rows are
right-padded [B, T] tensors, split into contiguous ranges."""

from __future__ import annotations

import numpy as np
import torch


def split_micro_batches(
    attention_mask: torch.Tensor,
    max_tokens: int | None = None,
    max_rows: int | None = None,
    min_parts: int = 1,
    packing: bool = False,
) -> list[np.ndarray]:
    """Contiguous row ranges whose padded size (rows x longest row) stays within `max_tokens` and whose row
    count within `max_rows` (a row longer than the budget is a micro-batch of its own); then the largest
    parts are halved until there are at least `min_parts` (so every rank of a group can run the same number).
    With neither bound: one part, all rows. packing (trainer.packing): a part's size is its real tokens."""
    lengths = (
        attention_mask.sum(dim=1).cpu().numpy().astype(np.int64) if attention_mask.numel() else np.zeros(0, np.int64)
    )
    n = len(lengths)
    parts: list[np.ndarray] = []
    start = 0
    longest = real = 0
    for i in range(n):
        length = max(int(lengths[i]), 1)
        longest_with, real_with = max(longest, length), real + length
        rows_with = i - start + 1
        size = real_with if packing else rows_with * longest_with
        over = (max_tokens is not None and size > max_tokens) or (max_rows is not None and rows_with > max_rows)
        if over and i > start:
            parts.append(np.arange(start, i))
            start, longest_with, real_with = i, length, length
        longest, real = longest_with, real_with
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


def pad_time(x: torch.Tensor, T: int) -> torch.Tensor:
    """Right-pad dimension 1 ([b, t, ...]) to T with zeros."""
    return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, T - x.shape[1]))
