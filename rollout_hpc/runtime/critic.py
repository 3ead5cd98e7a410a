"""PPO's critic on the trainer ranks: a second trained model beside the policy.

The critic is a copy of the initial policy with a zero-initialised scalar head
(models.ValueModel), trained by its own trainer from the same backend as the
policy (its own optimizer at algorithm.critic_lr, gradients averaged over the
trainer group the same way). With DeepSpeed that is a second engine in the
process, sharing the trainer group's torch.distributed group. Only the policy
is synced to the generators; both go into checkpoints: for a sharded backend
each rank's checkpoint shard holds its critic shard next to its policy shard.
"""

from __future__ import annotations

import copy

import torch

from rollout_hpc import algos
from rollout_hpc.backends.trainer import make_trainer
from rollout_hpc.config import UserError
from rollout_hpc.models import ValueModel
from rollout_hpc.store.rng import capture_rng_state


class CriticError(UserError):
    """A setting the critic cannot run with (user-fixable)."""


class Critic:
    def __init__(self, cfg, initial_policy: torch.nn.Module, world):
        a = cfg.algorithm
        # The backend reads its learning rate from algorithm.lr: give the critic's trainer a config with critic_lr there.
        critic_cfg = cfg.model_copy(update={"algorithm": a.model_copy(update={"lr": a.critic_lr or a.lr})})
        self.trainer = make_trainer(critic_cfg, ValueModel(copy.deepcopy(initial_policy)), world)
        self.agg, self.clip = a.loss_agg, a.value_clip

    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B, T] value of the state each token was sampled in: V(x_<t) at column t (the policy's
        logp[:, t] layout), i.e. the head's output after token t-1. Column 0 is 0."""
        after = self.trainer.outputs(input_ids, attention_mask)
        return _state_before_token(after)

    def train_step(self, batch: dict) -> dict[str, float]:
        """One step on the clipped value loss against batch['returns'] (old values: batch['old_values'])."""

        def loss(after_token, b):
            v = _state_before_token(after_token)
            return algos.value_loss(v, b["old_values"], b["returns"], b["mask"], self.clip, self.agg)

        stats = self.trainer.optimize(batch, loss, agg=self.agg, mask_key="mask")
        return {f"critic_{k}": v for k, v in stats.items()}

    def state_dict_for_checkpoint(self) -> dict:
        state = self.trainer.state_dict_for_checkpoint()
        state.pop("rng", None)  # the policy trainer's state holds the process RNG once
        return state

    def load_checkpoint_state(self, state: dict) -> None:
        # The process RNG is restored by the policy trainer (PolicyAndCritic loads the critic first).
        self.trainer.load_checkpoint_state({**state, "rng": capture_rng_state()})

    def close(self) -> None:
        self.trainer.close()


def _state_before_token(after_token: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(after_token[:, :-1], (1, 0))


class PolicyAndCritic:
    """What the Checkpointer saves and resumes when there is a critic: the policy's state with the
    critic's under 'critic' (the weights digest stays the policy's)."""

    def __init__(self, policy, critic: Critic):
        self.policy, self.critic = policy, critic
        self.sharded_checkpoint = policy.sharded_checkpoint

    def state_dict_for_checkpoint(self) -> dict:
        return {**self.policy.state_dict_for_checkpoint(), "critic": self.critic.state_dict_for_checkpoint()}

    def load_checkpoint_state(self, state: dict) -> None:
        if "critic" not in state:
            raise CriticError(
                "the checkpoint has no critic state (saved by a run without one); start a new run for PPO"
            )
        self.critic.load_checkpoint_state(state["critic"])
        self.policy.load_checkpoint_state(state)
