"""What every generator backend shares: sampling parameters, one generation's result, the trajectory
record it becomes, multi-turn episodes, and the `Generator` base class whose `rollout` turns prompts
into a TrajectoryBatch. Backends (generate_hf.py, generate_vllm.py) supply `generate` and `load_weights`.

Seeds: sample s of prompt i is drawn with derive_seed(run seed, i, s[, turn]), whichever rank or batch
generates it, so a resumed run samples exactly what the lost one would have.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from rollout_hpc.envs.base import dataset_item, is_multi_turn
from rollout_hpc.envs.hosts import EnvHost
from rollout_hpc.models.prompting import encode_prompt_item
from rollout_hpc.trajectory import TrajectoryBatch

from .episodes import Episode, EpisodeSettings, reward_status, rollout_episodes


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()  # a sampled stop token ends the response (and is part of it)
    stop: tuple[str, ...] = ()  # stop strings: the response ends with the token that completes one
    greedy: bool = False  # argmax instead of sampling (eval); log-probabilities at temperature 1

    @classmethod
    def from_config(cls, algorithm_cfg, tokenizer) -> SamplingParams:
        return cls(
            algorithm_cfg.max_new_tokens,
            algorithm_cfg.temperature,
            algorithm_cfg.top_p,
            tuple(getattr(tokenizer, "stop_ids", (tokenizer.eos_id,))),
            tuple(algorithm_cfg.stop),
        )


def stop_string_end(tokenizer, response_ids: Sequence[int], stops: Sequence[str]) -> int | None:
    """Length of the response up to and including the token that completes the first stop string, or None."""

    def has_stop(n: int) -> bool:
        text = tokenizer.decode(list(response_ids[:n]))
        return any(s in text for s in stops)

    if not stops or not has_stop(len(response_ids)):
        return None
    lo, hi = 1, len(response_ids)  # a longer prefix keeps a stop string it contains: bisect for the first
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if has_stop(mid) else (mid + 1, hi)
    return lo


def cut_at_stop_strings(gen: Generation, tokenizer, stops: Sequence[str]) -> Generation:
    """Cut every response after the token that completes a stop string (that response is then not truncated)."""
    if not stops:
        return gen
    for i, ids in enumerate(gen.response_ids):
        end = stop_string_end(tokenizer, ids, stops)
        if end is not None:
            gen.response_ids[i], gen.logprobs[i], gen.truncated[i] = ids[:end], gen.logprobs[i][:end], False
    return gen


@dataclass
class Generation:
    response_ids: list[list[int]]  # includes the stop token when one was sampled
    logprobs: list[list[float]]  # sampling log-probability of each response token
    truncated: list[bool]  # reached max_new_tokens without a stop token
    prefixes: list | None = None  # a backend's kept keys/values per row (generate_hf.CachedPrefix), when asked


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (run seed, prompt index, ...): stable across runs and machines."""
    digest = hashlib.sha256(",".join(str(int(p)) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


# --- records -------------------------------------------------------------------


def trajectory_batch(
    prompt_tokens: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    logprobs: Sequence[Sequence[float]],
    rewards: Sequence[float],
    *,
    prompt_index: Sequence[int],
    sample_idx: Sequence[int],
    gen_rank: int,
    policy_version: int,
    truncated: Sequence[bool],
    t_start: float,
    t_end: float,
    loss_masks: Sequence[Sequence[int]] | None = None,
    turn_starts: Sequence[Sequence[int]] | None = None,
    turn_rewards: Sequence[Sequence[float]] | None = None,
) -> TrajectoryBatch:
    """Pack generation results into the record every generator produces (one row per trajectory)."""
    fixed = dict(
        prompt_id=prompt_index,
        sample_idx=sample_idx,
        gen_rank=gen_rank,
        policy_version=policy_version,
        reward=rewards,
        truncated=[bool(t) for t in truncated],
        t_start=t_start,
        t_end=t_end,
    )
    ragged = dict(
        prompt_ids=prompt_tokens,
        response_ids=response_ids,
        logprobs=logprobs,
        loss_mask=loss_masks,
        turn_starts=turn_starts,
        turn_rewards=turn_rewards,
    )
    return TrajectoryBatch.from_columns(len(response_ids), fixed, ragged)


def episode_batch(eps: Sequence[Episode], common: dict[str, Any]) -> TrajectoryBatch:
    """The records of played episodes (rows in the order of `eps`); `common`: trajectory_batch's shared keywords."""
    status = [e.status for e in eps]
    batch = trajectory_batch(
        [e.prompt_ids for e in eps],
        [e.response_ids for e in eps],
        [e.logprobs for e in eps],
        [e.reward for e in eps],
        truncated=[e.truncated for e in eps],
        t_end=time.time(),
        loss_masks=[e.loss_mask for e in eps],
        turn_starts=[e.turn_starts for e in eps],
        turn_rewards=[e.turn_rewards for e in eps],
        **common,
    )
    f = batch.fixed
    f["episode_status"] = status
    f["reward_status"] = [reward_status(e) for e in eps]
    f["format_errors"] = [min(e.format_errors, 255) for e in eps]
    f["success"] = [e.success for e in eps]
    return batch


# --- the generator a rank runs ------------------------------------------------


class Generator:
    """One generator rank's engine: model + tokenizer + task -> TrajectoryBatch per call.
    Backends implement generate(prompts, seeds) and load_weights(weights); rollout is shared.

        gen.load_weights(weights)                          # {name: ndarray} from WeightSync
        batch = gen.rollout(dataset, prompt_indices, group_size, gen_rank, policy_version)
    """

    tokenizer: Any
    task: Any
    sampling: SamplingParams
    seed: int
    max_context: int | None
    episodes: EpisodeSettings | None = None  # task.env of a multi-turn task (set by the generator loop)
    max_tokens_per_turn: int | None = None  # task.env.max_tokens_per_turn (default: sampling.max_new_tokens)
    env_host: EnvHost | None = None  # where the environments live (envs/hosts.py); None: threads of this rank

    def generate(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        params: SamplingParams | None = None,
        cache_keys=None,
        watch=None,
    ) -> Generation:
        """One response per prompt; sample i seeded by seeds[i]; params default to self.sampling. cache_keys (one
        hashable per row): the backend may keep what it computed for the row and, when the next call with the same
        key has a prompt that starts with this one and its response, not compute that start again (an episode's
        turns); rows of keys absent from a call are dropped. A backend without such a cache ignores them.
        watch(t, finished, out_ids, lengths) -> bool: called after each token, True aborts the rest (the HF backend
        only: generator.extra_prompts is refused for the others)."""
        raise NotImplementedError

    def forget_prefixes(self) -> None:
        """Drop what generate kept for cache_keys (the episodes are over, or the weights change)."""

    def encode_prompt(self, item) -> list[int]:
        """The token ids the model sees for a prompt item (chat template applied where the task asks for it)."""
        return encode_prompt_item(self.tokenizer, item, getattr(self.task, "chat_template", "auto"))

    def load_weights(self, weights: dict[str, Any]) -> None:
        raise NotImplementedError

    def play_episodes(
        self,
        items: Sequence[Any],
        seeds: Sequence[int],
        params: SamplingParams | None = None,
        labels: Sequence[str] | None = None,
        watch=None,
    ) -> list[Episode]:
        """One episode of the task's environment per item, batched across environments (backends/episodes.py).
        Turn k of episode i samples with derive_seed(seeds[i], k): the same whatever else is in the batch.
        params: per-turn sampling (default: self.sampling with task.env.max_tokens_per_turn). watch: see
        episodes.rollout_episodes (a caller that stops once it has the episodes it needs)."""
        settings = self.episodes or EpisodeSettings()
        if params is None:
            params = self.sampling
            if self.max_tokens_per_turn:
                params = replace(params, max_new_tokens=self.max_tokens_per_turn)
        turns = [0] * len(items)

        def generate_turn(prompts, live):
            turn_seeds = [derive_seed(seeds[i], turns[i]) for i in live]
            for i in live:
                turns[i] += 1
            # an episode's next prompt starts with its last one and the reply: the backend need not run that again
            return self.generate(prompts, turn_seeds, params, cache_keys=live)

        try:
            return rollout_episodes(
                lambda i: self.task.make_env(),
                items,
                generate_turn,
                self.tokenizer,
                params.max_new_tokens,
                self.max_context,
                settings,
                labels,
                host=self.env_host,
                watch=watch,
            )
        finally:
            self.forget_prefixes()

    def rollout(
        self, dataset, prompt_indices: Sequence[int], group_size: int, gen_rank: int, policy_version: int
    ) -> TrajectoryBatch:
        """group_size samples of each prompt, rows ordered by (prompt index, sample). Sample s of
        prompt i is drawn with seed derive_seed(seed, i, s[, turn]): the same whichever rank or
        batch generates it, so a resumed run samples exactly what the lost one would have."""
        t_start = time.time()
        items = [dataset_item(dataset, i) for i in prompt_indices]
        rows = [(int(idx), item, s) for idx, item in zip(prompt_indices, items) for s in range(group_size)]
        row_seeds = [derive_seed(self.seed, idx, s) for idx, _, s in rows]
        common: dict[str, Any] = dict(  # the keyword arguments of trajectory_batch that every row shares
            prompt_index=[r[0] for r in rows],
            sample_idx=[r[2] for r in rows],
            gen_rank=gen_rank,
            policy_version=policy_version,
            t_start=t_start,
        )
        if is_multi_turn(self.task):
            labels = [f"prompt {idx} sample {s}" for idx, _, s in rows]  # what the rank's log names
            return episode_batch(self.play_episodes([item for _, item, _ in rows], row_seeds, labels=labels), common)
        prompt_tokens = [self.encode_prompt(item) for _, item, _ in rows]
        gen = self.generate(prompt_tokens, row_seeds)
        rewards = [
            self.task.reward(item, self.tokenizer.decode(ids)) for (_, item, _), ids in zip(rows, gen.response_ids)
        ]
        return trajectory_batch(
            prompt_tokens, gen.response_ids, gen.logprobs, rewards, truncated=gen.truncated, t_end=time.time(), **common
        )
