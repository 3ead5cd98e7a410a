"""Padding-free packing (`trainer.packing`): the sequences of a micro-batch laid end to end in one row.

A right-padded micro-batch [B, T] spends compute and activation memory on its padding. Packed, its real tokens
are one row [1, N] (N = the real tokens) whose position ids restart at 0 at every sequence, as verl's
`use_remove_padding`, OpenRLHF's `packing_samples` and ROLL's `use_sequence_packing` do. Called with those
position ids, no attention mask and no KV cache, transformers (>= 4.53, `masking_utils`) reads the restarts as
sequence boundaries: sdpa and eager get a block-diagonal causal mask, flash-attention its varlen kernel with
cu_seqlens from the positions. So no token attends across sequences, and each token's rotary position is its
index in its own sequence: the outputs equal the unpacked ones (tests/test_packing.py checks it for the
built-in Llama and a Hugging Face Qwen2 / Mistral / Qwen3).

Only the trainer's scoring packs (backends/trainer.py); generation and its KV cache never see a packed row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout_hpc.errors import ConfigError

# Architectures whose decoder builds its attention mask with transformers' masking_utils (which detects packed
# position ids) and whose positions enter only through rotary embeddings of position_ids. Verified in tests.
PACKABLE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def check_packable(model: torch.nn.Module) -> None:
    """ConfigError unless `model` (a causal LM, or a critic with a causal-LM `backbone`) packs exactly."""
    inner = getattr(model, "backbone", model)
    model_type = getattr(getattr(inner, "config", None), "model_type", None)
    if model_type not in PACKABLE_MODEL_TYPES:
        raise ConfigError(
            f"trainer.packing: model type '{model_type}' ({type(inner).__name__}) is not known to keep packed "
            f"sequences apart; packing supports {', '.join(PACKABLE_MODEL_TYPES)}. Set trainer.packing: false"
        )
    try:
        from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401  (the detection we rely on)
    except ImportError:
        import transformers

        raise ConfigError(
            f"trainer.packing needs transformers >= 4.53 (packed position ids); {transformers.__version__} is "
            "installed. Upgrade transformers or set trainer.packing: false"
        ) from None


@dataclass(frozen=True)
class PackedRow:
    """Where each real token of a [B, T] micro-batch sits in the packed row [1, N]."""

    rows: torch.Tensor  # [N] the token's row in the micro-batch
    cols: torch.Tensor  # [N] its column
    position_ids: torch.Tensor  # [1, N] its index within its own sequence (restarts at 0)
    shape: tuple[int, int]  # (B, T)

    @classmethod
    def of(cls, attention_mask: torch.Tensor) -> PackedRow:
        """The layout of the tokens where attention_mask is 1, row by row, in order."""
        real = attention_mask != 0
        if not bool(real.any()):  # nothing real (a weight-0 micro-batch): one token keeps the forward well-formed
            real = torch.zeros_like(real)
            real[0, 0] = True
        rows, cols = real.nonzero(as_tuple=True)
        positions = (real.long().cumsum(dim=1) - 1)[rows, cols]
        return cls(rows, cols, positions.unsqueeze(0), (int(real.shape[0]), int(real.shape[1])))

    @property
    def n_tokens(self) -> int:
        return int(self.rows.numel())

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] -> [1, N, ...]: the real tokens' entries, end to end."""
        return x[self.rows, self.cols].unsqueeze(0)

    def unpack(self, y: torch.Tensor) -> torch.Tensor:
        """[1, N, ...] -> [B, T, ...], zeros at padding (differentiable)."""
        out = y.new_zeros(*self.shape, *y.shape[2:])
        return out.index_put((self.rows, self.cols), y[0])

    def scored(self, positions: torch.Tensor | None) -> torch.Tensor:
        """[1, N] non-zero where a log-prob is wanted: `positions` (every token if None), never a sequence's first
        token, whose predecessor in the row belongs to another sequence (unpacked, column 0 is 0 too)."""
        keep = self.position_ids != 0
        return keep if positions is None else keep & (self.pack(positions) != 0)


__all__ = ["PACKABLE_MODEL_TYPES", "PackedRow", "check_packable"]
