"""Batched multi-turn episodes: a generator rank steps many environments at once.

Every turn, the next prompts of all live episodes go to the generator in one batched call; then every live
environment steps, all in one batched call to the rank's environment host (envs/hosts.py: threads of the rank, worker
processes, or an environment rank of its own het group; each call under a deadline). A finished episode leaves the batch
and the next waiting one joins it, so at most `parallel_envs` environments are live. An episode's tokens grow by
appending (its context is never re-encoded): the first observation is the prompt; the response is every model turn
(loss_mask 1, trained on) and every observation after it (loss_mask 0, no gradient), `turn_starts` marking where
each model turn begins.

An episode ends when its environment says done, after max_turns turns, when the next turn would not fit the
model's context, or when its environment fails (raises, hangs past step_timeout, returns no text): then it is
recorded with episode_status EPISODE_ERROR / EPISODE_TIMEOUT, reward 0 and no trainable token, and the run goes on.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rollout_hpc.envs.hosts import Call, EnvHost, Reply, ThreadEnvs
from rollout_hpc.errors import TaskError
from rollout_hpc.trajectory import EPISODE_OK, EPISODE_TIMEOUT, REWARD_ERROR, REWARD_OK, REWARD_TIMEOUT

if TYPE_CHECKING:  # generator.py imports this module
    from .generator import Generation

# generate_fn(prompts, live): `live` are the episode indices the prompts belong to (one turn of each)
GenerateFn = Callable[[list[list[int]], list[int]], "Generation"]


@dataclass(frozen=True)
class EpisodeSettings:
    """task.env as the episode loop needs it (defaults: the environment's max_turns, no penalty, 30 s a call)."""

    parallel_envs: int = 64
    max_turns: int | None = None
    format_penalty: float = 0.0
    step_timeout: float = 30.0

    @classmethod
    def from_config(cls, env_cfg) -> EpisodeSettings:
        return cls(env_cfg.parallel_envs, env_cfg.max_turns, env_cfg.format_penalty, env_cfg.step_timeout)


@dataclass
class Episode:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)  # model turns and the observations between them
    logprobs: list[float] = field(default_factory=list)  # 0 on observation tokens
    loss_mask: list[int] = field(default_factory=list)  # 1 on model tokens, 0 on observation tokens
    turn_starts: list[int] = field(default_factory=list)  # response offset where each model turn begins
    turn_rewards: list[float] = field(default_factory=list)  # each turn's step reward (minus its format penalty)
    reward: float = 0.0  # sum of the turn rewards
    truncated: bool = False  # ended by max_turns or the context limit, not by the environment
    status: int = EPISODE_OK  # trajectory.EPISODE_*: how the environment ended it
    format_errors: int = 0  # turns whose reply the environment could not parse
    success: bool = False  # the environment's last info said success (or solved)
    error: str = ""  # what the environment did wrong (status != EPISODE_OK)


def reward_status(episode: Episode) -> int:
    """The record's reward_status: a failed environment's reward is a stand-in 0, counted like a reward that raised
    (or timed out)."""
    if episode.status == EPISODE_OK:
        return REWARD_OK
    return REWARD_TIMEOUT if episode.status == EPISODE_TIMEOUT else REWARD_ERROR


def _format_error(info: dict) -> bool:
    return bool(info.get("format_error", info.get("invalid", False)))


def _success(info: dict) -> bool:
    return bool(info.get("success", info.get("solved", False)))


def rollout_episodes(
    envs: Sequence[Any] | Callable[[int], Any],
    items: Sequence[Any],
    generate_fn: GenerateFn,
    tokenizer,
    max_new_tokens: int,
    max_context: int | None = None,
    settings: EpisodeSettings = EpisodeSettings(),
    labels: Sequence[str] | None = None,
    host: EnvHost | None = None,
    watch: Callable[[list[int], list[Episode]], bool] | None = None,
) -> list[Episode]:
    """Play one episode per item, at most settings.parallel_envs at a time. `envs`: one environment per item, or
    make(i) -> a fresh environment for episode i (called in the episode's thread, so it may fail like a step).
    host: where the environments live (envs/hosts.py; keys are the episode indices); default: threads of this
    process, built by `envs`. labels: what the rank's log calls episode i when its environment fails.
    watch(ended, episodes), after each turn of the batch with the episodes that ended since the last call: True
    stops there (the episodes still running or waiting are abandoned unfinished, their environments closed)."""
    own_host = host is None
    if host is None:
        make: Callable[[int], Any] = envs if callable(envs) else envs.__getitem__
        host = ThreadEnvs(make, settings.step_timeout)  # type: ignore[arg-type]
    try:
        return _play(host, items, generate_fn, tokenizer, max_new_tokens, max_context, settings, labels, watch)
    finally:
        if own_host:
            host.close()


def _play(
    host: EnvHost, items, generate_fn, tokenizer, max_new_tokens, max_context, settings, labels, watch=None
) -> list[Episode]:
    n = len(items)
    eps: list[Episode] = [Episode([]) for _ in range(n)]
    turns = [0] * n
    limit = [0] * n  # each episode's max_turns: task.env.max_turns capped by the environment's own
    waiting = deque(range(n))
    live: list[int] = []
    closing: list[Call] = []  # episodes that ended: their environments close with the next batch of calls
    ended: list[int] = []  # since the last watch call

    def end(i: int, failure: Reply | None = None) -> None:
        ended.append(i)
        if failure is None:
            closing.append((i, "close", None))
            return
        # counted, not trained on: the environment's fault, not the policy's (the host has closed it)
        ep = eps[i]
        ep.status, ep.error, ep.reward, ep.truncated = failure.status, failure.error, 0.0, True
        ep.loss_mask = [0] * len(ep.response_ids)
        ep.turn_rewards = [0.0] * len(ep.turn_starts)  # stand-ins, as the reward
        if not ep.prompt_ids:  # the first observation never came: a placeholder prompt
            ep.prompt_ids = tokenizer.encode_prompt("") or [tokenizer.eos_id]
        who = labels[i] if labels is not None else f"episode {i}"
        where = f"turn {turns[i]}" if turns[i] else "start"
        print(f"environment of {who}, {where}: {failure.error}; the episode ends", file=sys.stderr)

    def calls(batch: list[Call]) -> dict:
        batch = closing + batch
        closing.clear()
        return host.run(batch)

    def start(new: list[int]) -> list[int]:
        replies = calls([(i, "reset", items[i]) for i in new])
        started = []
        for i in new:
            reply = replies[i]
            if not reply.ok:
                end(i, reply)
                continue
            first = tokenizer.encode_prompt(reply.value)
            if max_context is not None and len(first) + max_new_tokens > max_context:
                raise TaskError(
                    f"a first observation of {len(first)} tokens plus max_new_tokens={max_new_tokens} exceeds the "
                    f"model's context of {max_context} tokens; raise model.max_seq_len or shorten the task's observations"
                )
            caps = [t for t in (reply.max_turns, settings.max_turns) if t is not None]
            if not caps:
                raise TaskError("the task's environment has no max_turns attribute: set task.env.max_turns")
            limit[i] = min(caps)
            eps[i].prompt_ids = first
            started.append(i)
        return started

    while waiting or live:
        new = [waiting.popleft() for _ in range(min(len(waiting), settings.parallel_envs - len(live)))]
        live += start(new)
        if not live:
            continue
        gen = generate_fn([eps[i].prompt_ids + eps[i].response_ids for i in live], live)
        steps: list[Call] = []
        for k, i in enumerate(live):
            ep, ids = eps[i], gen.response_ids[k]
            ep.turn_starts.append(len(ep.response_ids))
            ep.response_ids += ids
            ep.logprobs += gen.logprobs[k]
            ep.loss_mask += [1] * len(ids)
            turns[i] += 1
            steps.append((i, "step", tokenizer.decode(ids)))
        replies = calls(steps)
        still = []
        for i in live:
            ep, reply = eps[i], replies[i]
            if not reply.ok:
                end(i, reply)
                continue
            obs, reward, done, info = reply.value
            if _format_error(info):
                ep.format_errors += 1
                reward -= settings.format_penalty
            ep.turn_rewards.append(reward)
            ep.reward += reward
            if done or turns[i] >= limit[i]:
                ep.truncated = not done or bool(info.get("truncated", False))
                ep.success = _success(info)
                end(i)
                continue
            obs_ids = tokenizer.encode(obs)
            if (
                max_context is not None
                and len(ep.prompt_ids) + len(ep.response_ids) + len(obs_ids) + max_new_tokens > max_context
            ):
                ep.truncated = True  # the next turn would not fit: end here, without the observation
                end(i)
                continue
            ep.response_ids += obs_ids
            ep.logprobs += [0.0] * len(obs_ids)
            ep.loss_mask += [0] * len(obs_ids)
            still.append(i)
        live = still
        if watch is not None:
            stop = watch(list(ended), eps)
            ended.clear()
            if stop:  # the caller has what it needs: abandon the rest
                closing.extend((i, "close", None) for i in live)
                live, waiting = [], deque()
    if closing:
        calls([])
    return eps
