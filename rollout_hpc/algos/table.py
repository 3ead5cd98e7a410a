"""The algorithms as table rows: one frozen dataclass per algorithm, no torch needed (the config reads the
names from here). Adding an algorithm = one row here + its advantage estimator (registered by name in
algos/registry.py), if it needs a new one: the config's allowed names, compute_advantages, runtime/objective.py (KL in
the loss or the reward, critic values), the step plan (dynamic sampling) and the trainer loop (a critic or not)
read the row. Every algorithm trains on the clipped policy loss (losses.policy_loss); a reference model is
built whenever algorithm.kl_coef > 0, whatever the row."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class Algorithm:
    name: str
    advantage: str  # estimator in registry.ESTIMATORS: per-sequence rewards -> per-token advantages
    # The paper's loss aggregation; a run uses algorithm.loss_agg (token_mean unless set: docs/algorithms.md says why).
    paper_agg: Literal["token_mean", "seq_mean"]
    needs_critic: bool = False  # a value model trained on value_loss (PPO)
    kl_in: Literal["loss", "reward"]  # where algorithm.kl_coef applies (either way kl_coef > 0 needs a reference model)
    min_group_size: int = 1  # smallest algorithm.group_size that gives the estimator a baseline
    dynamic_sampling: bool = False  # drop all-equal-reward groups by default (any algorithm may turn it on)
    summary: str = ""  # one line for `rollout-hpc schema algorithm`


ROWS = (
    Algorithm(
        name="grpo",
        advantage="group_normalized",
        paper_agg="seq_mean",
        kl_in="loss",
        min_group_size=2,
        summary="group-normalised advantages, KL to reference in the loss",
    ),
    Algorithm(
        name="dr_grpo",
        advantage="group_centered",
        paper_agg="token_mean",  # the paper: token sum / a constant budget; token_mean weighs tokens alike too
        kl_in="loss",
        min_group_size=2,
        summary="Dr. GRPO: GRPO without the std division, token-level loss (no per-response length normalisation)",
    ),
    Algorithm(
        name="dapo",
        advantage="group_normalized",
        paper_agg="token_mean",
        kl_in="loss",
        min_group_size=2,
        dynamic_sampling=True,
        summary="GRPO advantages + clip-higher, dynamic sampling, token-level loss, overlong shaping",
    ),
    Algorithm(
        name="ppo",
        advantage="gae",
        paper_agg="token_mean",
        needs_critic=True,
        kl_in="reward",
        summary="critic + GAE, KL penalty in the token rewards",
    ),
    Algorithm(
        name="rloo",
        advantage="leave_one_out",
        paper_agg="token_mean",
        kl_in="reward",
        min_group_size=2,
        summary="leave-one-out baseline, sequence KL subtracted from the reward",
    ),
    Algorithm(
        name="reinforce_pp",
        advantage="reinforce_pp",
        paper_agg="token_mean",
        kl_in="reward",
        summary="token-level KL in the reward, discounted returns normalised over the global batch",
    ),
)

ALGORITHMS: dict[str, Algorithm] = {row.name: row for row in ROWS}
ALGORITHM_NAMES: tuple[str, ...] = tuple(ALGORITHMS)
