"""What every generator backend shares: sampling parameters, one generation's result, the trajectory
record it becomes, multi-turn episodes, and the `Generator` base class whose `rollout` turns prompts
into a TrajectoryBatch. Backends (generate_hf.py, generate_vllm.py) supply `generate` and `load_weights`.

Seeds: sample s of prompt i is drawn with derive_seed(run seed, i, s[, turn]), whichever rank or batch
generates it, so a resumed run samples exactly what the lost one would have.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rollout_hpc.envs.base import dataset_item, is_multi_turn
from rollout_hpc.errors import TaskError
from rollout_hpc.models.prompting import encode_prompt_item
from rollout_hpc.trajectory import TrajectoryBatch


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
    )
    return TrajectoryBatch.from_columns(len(response_ids), fixed, ragged)


# --- multi-turn episodes ---------------------------------------------------------

# generate_fn(prompts, live): `live` are the episode indices the prompts belong to
GenerateFn = Callable[[list[list[int]], list[int]], Generation]


@dataclass
class Episode:
    prompt_ids: list[int]
    response_ids: list[int]  # model turns and the observations between them
    logprobs: list[float]  # 0 on observation tokens
    loss_mask: list[int]  # 1 on model tokens, 0 on observation tokens
    turn_starts: list[int]  # response offset where each model turn begins
    reward: float  # sum of the step rewards
    truncated: bool  # ended by max_turns or the context limit, not by the environment


def rollout_episodes(
    envs: Sequence[Any],
    items: Sequence[Any],
    generate_fn: GenerateFn,
    tokenizer,
    max_new_tokens: int,
    max_context: int | None = None,
) -> list[Episode]:
    """Play one episode per (env, item) in lockstep: each turn generates for every live episode
    in one batch, then steps the environments. An episode ends when its environment says done,
    after env.max_turns turns, or when the next turn would not fit in max_context tokens."""
    first = [tokenizer.encode_prompt(env.reset(item)) for env, item in zip(envs, items)]
    for p in first:
        if max_context is not None and len(p) + max_new_tokens > max_context:
            raise TaskError(
                f"a first observation of {len(p)} tokens plus max_new_tokens={max_new_tokens} exceeds the model's "
                f"context of {max_context} tokens; raise model.max_seq_len or shorten the task's observations"
            )
    eps = [Episode(list(p), [], [], [], [], 0.0, False) for p in first]
    contexts = [list(p) for p in first]
    live = list(range(len(envs)))
    turn = 0
    while live:
        gen = generate_fn([contexts[i] for i in live], live)
        turn += 1
        still = []
        for k, i in enumerate(live):
            ep, ids = eps[i], gen.response_ids[k]
            ep.turn_starts.append(len(ep.response_ids))
            ep.response_ids += ids
            ep.logprobs += gen.logprobs[k]
            ep.loss_mask += [1] * len(ids)
            contexts[i] += ids
            obs, reward, done, info = envs[i].step(tokenizer.decode(ids))
            ep.reward += float(reward)
            if done or turn >= envs[i].max_turns:
                ep.truncated = not done or bool(isinstance(info, dict) and info.get("truncated", False))
                continue
            obs_ids = tokenizer.encode(obs)
            if max_context is not None and len(contexts[i]) + len(obs_ids) + max_new_tokens > max_context:
                ep.truncated = True  # the next turn would not fit: end here, without the observation
                continue
            ep.response_ids += obs_ids
            ep.logprobs += [0.0] * len(obs_ids)
            ep.loss_mask += [0] * len(obs_ids)
            contexts[i] += obs_ids
            still.append(i)
        live = still
    return eps


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

    def generate(self, prompts: list[list[int]], seeds: list[int], params: SamplingParams | None = None) -> Generation:
        """One response per prompt; sample i seeded by seeds[i]; params default to self.sampling."""
        raise NotImplementedError

    def encode_prompt(self, item) -> list[int]:
        """The token ids the model sees for a prompt item (chat template applied where the task asks for it)."""
        return encode_prompt_item(self.tokenizer, item, getattr(self.task, "chat_template", "auto"))

    def load_weights(self, weights: dict[str, Any]) -> None:
        raise NotImplementedError

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
            envs = [self.task.make_env() for _ in rows]
            turn = iter(range(1 << 30))

            def generate_turn(prompts, live):
                k = next(turn)
                return self.generate(prompts, [derive_seed(row_seeds[i], k) for i in live])

            eps = rollout_episodes(
                envs,
                [item for _, item, _ in rows],
                generate_turn,
                self.tokenizer,
                self.sampling.max_new_tokens,
                self.max_context,
            )
            return trajectory_batch(
                [e.prompt_ids for e in eps],
                [e.response_ids for e in eps],
                [e.logprobs for e in eps],
                [e.reward for e in eps],
                truncated=[e.truncated for e in eps],
                t_end=time.time(),
                loss_masks=[e.loss_mask for e in eps],
                turn_starts=[e.turn_starts for e in eps],
                **common,
            )
        prompt_tokens = [self.encode_prompt(item) for _, item, _ in rows]
        gen = self.generate(prompt_tokens, row_seeds)
        rewards = [
            self.task.reward(item, self.tokenizer.decode(ids)) for (_, item, _), ids in zip(rows, gen.response_ids)
        ]
        return trajectory_batch(
            prompt_tokens, gen.response_ids, gen.logprobs, rewards, truncated=gen.truncated, t_end=time.time(), **common
        )
