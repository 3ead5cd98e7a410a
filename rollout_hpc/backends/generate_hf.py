"""Generator backend on torch / Hugging Face models (CPU or GPU): a batched sampling
loop with a KV cache that returns, for every response token, the log-probability it
was sampled with. Also the rollout of multi-turn episodes and the packing of results
into TrajectoryBatch records.

Sampling log-probabilities: log-softmax of (logits / temperature) after top-p filtering,
i.e. exactly the distribution the token was drawn from. With top_p = 1 this equals the
trainer's teacher-forced log-softmax(logits / temperature); with top_p < 1 tokens inside
the nucleus get a slightly higher log-probability than the unfiltered distribution gives.

Sampling uses the Gumbel-max trick with uniforms from a CPU torch.Generator, so a seed
gives the same tokens whichever device holds the model (up to the logits themselves).
"""

from __future__ import annotations

import hashlib
import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rollout_hpc.envs.base import dataset_item, is_multi_turn
from rollout_hpc.envs.registry import TaskError
from rollout_hpc.models.logprobs import left_pad, position_ids_from_mask
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


def sampling_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """log-softmax(logits / temperature) restricted to the top-p nucleus (-inf outside)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_logp, order = torch.sort(logp, dim=-1, descending=True)
        probs = sorted_logp.exp()
        # Keep a token if the mass before it is below top_p (the most likely token always stays).
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logp = torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)
    return logp


def _sample(logp: torch.Tensor, generator) -> torch.Tensor:
    """Gumbel-max: argmax(logp + Gumbel noise) is a draw from softmax(logp). `generator` is one
    torch.Generator for the batch or one per row (then a row's draw ignores the rest of the batch)."""
    if isinstance(generator, (list, tuple)):
        u = torch.stack([torch.rand(logp.shape[-1], generator=g, dtype=torch.float64) for g in generator])
    else:
        u = torch.rand(logp.shape, generator=generator, dtype=torch.float64)
    gumbel = -torch.log(-torch.log(u.clamp_(1e-300, 1.0)))
    return torch.argmax(logp + gumbel.to(device=logp.device, dtype=logp.dtype), dim=-1)


def _cache_kwarg(model) -> str:
    """transformers >= 5.24 calls the KV cache `cache`; older versions `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def generate(
    model,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    pad_id: int,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    stop_text: Callable[[list[int]], str] | None = None,
) -> Generation:
    """Sample one response per prompt (token lists) with a KV cache; prompts are left-padded.
    `generator`: one CPU torch.Generator for the batch, or one per prompt. `stop_text` (a decode function)
    is needed for params.stop: a row ends at the token after which its text's tail contains a stop string
    (the caller cuts exactly with cut_at_stop_strings)."""
    n = len(prompts)
    if n == 0:
        return Generation([], [], [])
    if params.stop and stop_text is None:
        raise ValueError("stop strings need stop_text (the tokenizer's decode)")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (start prompts with the tokenizer's BOS)")
    device = next(model.parameters()).device
    ids, attn = left_pad([list(p) for p in prompts], pad_id, device)
    positions = position_ids_from_mask(attn)
    stop = torch.tensor(sorted(params.stop_ids), dtype=torch.long, device=device)
    out_ids = torch.full((n, params.max_new_tokens), pad_id, dtype=torch.long, device=device)
    out_lp = torch.zeros((n, params.max_new_tokens), dtype=torch.float32, device=device)
    lengths = torch.zeros(n, dtype=torch.long, device=device)
    finished = torch.zeros(n, dtype=torch.bool, device=device)

    cache_kw = _cache_kwarg(model)
    past = None
    step_ids, step_pos = ids, positions
    for t in range(params.max_new_tokens):
        out = model(input_ids=step_ids, attention_mask=attn, position_ids=step_pos, use_cache=True, **{cache_kw: past})
        past = out[cache_kw]
        if params.greedy:
            logp = torch.log_softmax(out.logits[:, -1, :].float(), dim=-1)
            token = torch.argmax(logp, dim=-1)
        else:
            logp = sampling_logprobs(out.logits[:, -1, :], params.temperature, params.top_p)
            token = _sample(logp, generator)
        live = ~finished
        out_ids[live, t] = token[live]
        out_lp[live, t] = logp.gather(-1, token[:, None])[:, 0][live]
        lengths += live.long()
        finished |= torch.isin(token, stop) if len(stop) else torch.zeros_like(finished)
        if stop_text is not None:  # stop strings: look at the tail of each live row's text
            tail = max(len(x) for x in params.stop) + 8
            for i in torch.nonzero(live & ~finished).flatten().tolist():
                lo = max(0, int(lengths[i]) - tail)
                if any(x in stop_text(out_ids[i, lo : int(lengths[i])].tolist()) for x in params.stop):
                    finished[i] = True
        if bool(finished.all()):
            break
        # Finished rows keep being fed (their outputs are ignored): the batch shape stays fixed.
        step_ids = torch.where(finished, torch.full_like(token, pad_id), token)[:, None]
        step_pos = step_pos[:, -1:] + 1
        attn = torch.cat([attn, torch.ones((n, 1), dtype=attn.dtype, device=device)], dim=1)

    lengths_l, ids_l, lp_l = lengths.tolist(), out_ids.tolist(), out_lp.tolist()
    responses = [ids_l[i][: lengths_l[i]] for i in range(n)]
    logprobs = [lp_l[i][: lengths_l[i]] for i in range(n)]
    stopped = set(params.stop_ids)
    truncated = [not (r and r[-1] in stopped) for r in responses]
    return Generation(responses, logprobs, truncated)


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


class HFGenerator(Generator):
    """The torch / transformers backend (generator.backend 'hf'), CPU or GPU.

    gen = HFGenerator(model, tokenizer, task, SamplingParams.from_config(cfg.algorithm, tokenizer), seed=cfg.run.seed)
    """

    def __init__(
        self, model, tokenizer, task, sampling: SamplingParams, seed: int = 0, max_context: int | None = None
    ) -> None:
        self.model, self.tokenizer, self.task, self.sampling, self.seed = model.eval(), tokenizer, task, sampling, seed
        self.max_context = max_context or getattr(getattr(model, "config", None), "max_position_embeddings", None)

    def load_weights(self, weights: dict[str, Any]) -> None:
        load_weights_into(self.model, weights)

    def generate(self, prompts: list[list[int]], seeds: list[int], params: SamplingParams | None = None) -> Generation:
        params = params or self.sampling
        generators = [torch.Generator().manual_seed(s) for s in seeds]
        out = generate(
            self.model,
            prompts,
            params,
            self.tokenizer.pad_id,
            generators,
            stop_text=self.tokenizer.decode if params.stop else None,
        )
        return cut_at_stop_strings(out, self.tokenizer, params.stop)


@torch.no_grad()
def load_weights_into(model, weights: dict[str, Any]) -> None:
    """Copy {name: array} into the model's parameters and buffers in place (every parameter
    must be given; tied parameters once under either name)."""
    state = model.state_dict()
    unknown = [k for k in weights if k not in state]
    if unknown:
        raise KeyError(
            f"weights for unknown tensors {unknown[:5]}: trainer and generator models differ (check model.*)"
        )
    given = {state[k].data_ptr() for k in weights}  # tied parameters share storage
    missing = [name for name, p in model.named_parameters() if name not in weights and p.data_ptr() not in given]
    if missing:
        raise KeyError(f"weights missing for {missing[:5]}")
    for name, value in weights.items():
        target = state[name]
        src = torch.from_numpy(np.asarray(value)) if not isinstance(value, torch.Tensor) else value
        if tuple(src.shape) != tuple(target.shape):
            raise ValueError(f"weight {name}: shape {tuple(src.shape)} but the model has {tuple(target.shape)}")
        target.copy_(src.to(device=target.device, dtype=target.dtype))
