"""Which prompts a step generates and trains on, with and without DAPO's dynamic sampling.

Without dynamic sampling, step s is prompts [s*P, (s+1)*P) (P = prompts_per_step).

With it, a step generates in rounds. A group whose (shaped) rewards are all
equal has zero advantage and teaches nothing, so after each round the groups
still missing are refilled with new prompts, until P groups are informative or
algorithm.dynamic_sampling_max_rounds rounds are done. Step s owns the block of
prompts [s*M, (s+1)*M), M = P * max_rounds, which every possible sequence of
rounds fits in; the rounds take its prompts in order, so the prompts a step
used are always a prefix [s*M, end) of its block. Two things follow:

- the step is still the whole data cursor: a resumed run regenerates exactly
  the same rounds from the same seeds, nothing else needs saving;
- generators and trainers agree on the rounds without a message: both replay
  this plan from the same rewards (generators to decide what to generate next,
  trainers to know when a step's experience is complete).

Unused prompts at the end of a block are skipped: free for procedural tasks,
and a finite dataset wraps around as always (envs.base.dataset_item).
"""

from __future__ import annotations

import numpy as np

from rollout_hpc import algos
from rollout_hpc.trajectory import TrajectoryBatch


def uses_dynamic_sampling(cfg) -> bool:
    return bool(algos.get_algorithm(cfg.algorithm.name).dynamic_sampling or cfg.algorithm.dynamic_sampling)


class StepPlan:
    """The rounds of one step. `round` is the prompt range to generate now; after it is scored,
    `advance(informative_groups_in_round)` says whether another round follows."""

    def __init__(self, step: int, prompts_per_step: int, max_rounds: int = 1):
        self.target = prompts_per_step
        self.max_rounds = max_rounds
        self.start = step * prompts_per_step * max_rounds
        self.round_start, self.end = self.start, self.start + prompts_per_step
        self.rounds = 1
        self.informative = 0
        self.done = max_rounds == 1  # without refills the first round is the whole step

    @classmethod
    def for_step(cls, cfg, step: int) -> StepPlan:
        a = cfg.algorithm
        return cls(step, a.prompts_per_step, a.dynamic_sampling_max_rounds if uses_dynamic_sampling(cfg) else 1)

    @property
    def round(self) -> range:
        return range(self.round_start, self.end)

    @property
    def prompts(self) -> range:
        """Every prompt of the step so far (all rounds)."""
        return range(self.start, self.end)

    @property
    def block_end(self) -> int:
        return self.start + self.target * self.max_rounds

    def advance(self, informative_in_round: int) -> bool:
        """Count the current round's informative groups; True if a refill round follows (now `round`)."""
        if self.done:
            raise RuntimeError("StepPlan.advance after the last round")
        self.informative += informative_in_round
        missing = algos.groups_to_refill(self.target, self.informative)
        if missing == 0 or self.rounds >= self.max_rounds:
            self.done = True
            return False
        self.round_start, self.end = self.end, self.end + missing
        self.rounds += 1
        return True


def shaped_rewards(cfg, rewards, response_len):
    """Task rewards plus DAPO's overlong shaping where configured (what advantages are computed from)."""
    import torch

    a = cfg.algorithm
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if a.overlong_buffer > 0:
        lengths = torch.as_tensor(response_len, dtype=torch.float32)
        rewards = rewards + algos.overlong_penalty(lengths, a.max_new_tokens, a.overlong_buffer, a.overlong_penalty)
    return rewards


def informative_groups(cfg, batch: TrajectoryBatch) -> int:
    """How many whole prompt groups in `batch` have rewards that are not all equal.
    The same test the trainer's dynamic-sampling filter applies (algos.dynamic_sampling_filter)."""
    if not len(batch):
        return 0
    order = np.argsort(batch.uids(cfg.algorithm.group_size), kind="stable")
    f = batch.fixed[order]
    rewards = shaped_rewards(cfg, f["reward"], f["response_len"].astype(np.float32))
    return algos.dynamic_sampling_filter(rewards, cfg.algorithm.group_size).kept_groups


def rank_share(prompts: range, rank: int, n_ranks: int) -> np.ndarray:
    """This rank's contiguous share of a prompt range (some ranks may get none)."""
    return np.array_split(np.arange(prompts.start, prompts.stop), n_ranks)[rank]
