"""PPO's critic: a causal-LM backbone with a scalar head on its last hidden state."""

from __future__ import annotations

from typing import Any

import torch

from .build import build_model


class ValueModel(torch.nn.Module):
    """values[b, t] = head(h_t): the value of the state after token t (same [B, T] layout as the
    policy's per-token log-probs). The head starts at zero, so the first values are 0."""

    def __init__(self, backbone: torch.nn.Module) -> None:
        super().__init__()
        self.backbone = backbone
        config: Any = backbone.config  # a Hugging Face config (torch types module attributes as Tensor | Module)
        hidden = config.hidden_size
        self.head = torch.nn.Linear(hidden, 1, dtype=next(backbone.parameters()).dtype)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None) -> torch.Tensor:
        # use_cache: accepted (and ignored) so trainers call the critic like a causal LM
        out = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            output_hidden_states=True,
            use_cache=False,
        )
        return self.head(out.hidden_states[-1]).squeeze(-1).float()


def build_critic(model_cfg, vocab_size: int, seed: int = 0) -> ValueModel:
    """A critic with the policy's architecture (and, for model.path, its pretrained weights)."""
    return ValueModel(build_model(model_cfg, vocab_size, seed=seed))
