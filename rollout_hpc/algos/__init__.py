"""RL algorithms as pure functions over torch tensors (see docs/algorithms.md).

The table of algorithms (algos/table.py) imports without torch, so the config can read the names from it;
everything else is loaded on first use (PEP 562), keeping `import rollout_hpc.algos.table` light.
"""

from __future__ import annotations

import importlib

from .table import ALGORITHM_NAMES, ALGORITHMS, Algorithm

_WHERE = {
    **dict.fromkeys(
        [
            "anchor_state_advantages",
            "broadcast_to_tokens",
            "discounted_returns",
            "gae",
            "group_normalized",
            "last_token_rewards",
            "leave_one_out",
            "whiten",
        ],
        "advantages",
    ),
    **dict.fromkeys(["DynamicSampling", "dynamic_sampling_filter", "groups_to_refill", "overlong_penalty"], "dapo"),
    **dict.fromkeys(
        ["aggregate", "entropy_from_logits", "kl_penalty", "masked_mean", "policy_loss", "value_loss"], "losses"
    ),
    **dict.fromkeys(
        ["AlgorithmSpec", "ESTIMATORS", "compute_advantages", "get_algorithm", "value_targets"], "registry"
    ),
}


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ALGORITHMS", "ALGORITHM_NAMES", "Algorithm", *sorted(_WHERE)]
