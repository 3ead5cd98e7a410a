"""Generator backend on torch / Hugging Face models (generator.backend 'hf', CPU or GPU): a batched
sampling loop with a KV cache that returns, for every response token, the log-probability it was
sampled with. What every backend shares (SamplingParams, Generation, the Generator base class with its
rollout, multi-turn episodes, trajectory_batch, derive_seed) is in backends/generator.py, re-exported here.

Sampling log-probabilities: log-softmax of (logits / temperature) after top-p filtering,
i.e. exactly the distribution the token was drawn from. With top_p = 1 this equals the
trainer's teacher-forced log-softmax(logits / temperature); with top_p < 1 tokens inside
the nucleus get a slightly higher log-probability than the unfiltered distribution gives.

Sampling is by inverse CDF: one uniform per row and token, from the row's own counter-based stream (RowStreams:
splitmix64 of the row's seed and its draw count, computed for all rows in one tensor op), so a row's tokens do not
depend on the rest of its batch, and a seed gives the same tokens whichever device holds the model (up to the
logits themselves).

Single-turn calls drop finished rows from the batch (and their keys and values) as they go, so a batch whose
answers are mostly short pays for its few long ones only on their rows; with one generator per row this samples
the same tokens as a fixed batch (log-probabilities may differ in the last bits: CPU matmuls of a few rows take
other kernels).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from rollout_hpc.models.logprobs import left_pad, position_ids_from_mask

from .episodes import Episode, GenerateFn, rollout_episodes
from .generator import (
    Generation,
    Generator,
    SamplingParams,
    cut_at_stop_strings,
    derive_seed,
    stop_string_end,
    trajectory_batch,
)

# The shared names stay importable from here (runtime/ and the tests import them from this module).
__all__ = [
    "Episode",
    "GenerateFn",
    "Generation",
    "Generator",
    "HFGenerator",
    "RowStreams",
    "SamplingParams",
    "cut_at_stop_strings",
    "derive_seed",
    "generate",
    "load_weights_into",
    "rollout_episodes",
    "sampling_logprobs",
    "stop_string_end",
    "trajectory_batch",
]


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


_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's constants


def _i64(x: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits (torch has no uint64 arithmetic)."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> on int64 keeps the sign)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


class RowStreams:
    """One random stream per batch row: draw k of the row with seed s is splitmix64's k-th output for s, in [0, 1).
    Counter-based, so all rows draw in one tensor op and a row's draws never depend on the others; `select` keeps
    some rows (with their counts) when a batch drops finished ones."""

    def __init__(self, seeds, counts: torch.Tensor | None = None) -> None:
        if not isinstance(seeds, torch.Tensor):
            seeds = torch.as_tensor([_i64(int(s) % (1 << 64)) for s in seeds], dtype=torch.int64)
        self.seeds = seeds
        self.counts = torch.zeros_like(seeds) if counts is None else counts

    def uniform(self) -> torch.Tensor:
        """The next draw of every row, float64 [rows]; advances each row's count."""
        self.counts = self.counts + 1
        z = self.seeds + self.counts * _i64(_GOLDEN)  # int64 arithmetic wraps: splitmix64's state, mod 2^64
        z = (z ^ _shr(z, 30)) * _i64(_MIX1)
        z = (z ^ _shr(z, 27)) * _i64(_MIX2)
        z = z ^ _shr(z, 31)
        return _shr(z, 11).to(torch.float64) * (1.0 / (1 << 53))

    def select(self, rows: torch.Tensor) -> RowStreams:
        return RowStreams(self.seeds[rows], self.counts[rows])


def _sample(logp: torch.Tensor, generator) -> torch.Tensor:
    """Inverse CDF: the first token whose cumulative probability exceeds the row's uniform (tokens of probability 0,
    outside a top-p nucleus, are never drawn). `generator`: RowStreams (one stream per row: a row's draw ignores the
    rest of the batch) or one torch.Generator for the batch."""
    if isinstance(generator, RowStreams):
        u = generator.uniform()
    else:
        u = torch.rand(logp.shape[0], generator=generator, dtype=torch.float64)
    cdf = torch.cumsum(torch.softmax(logp.double(), dim=-1), dim=-1)
    token = torch.searchsorted(cdf, (u.to(cdf.device) * cdf[:, -1])[:, None], right=True)[:, 0]
    return token.clamp_(max=logp.shape[-1] - 1)


def _cache_kwarg(model) -> str:
    """transformers >= 5.24 calls the KV cache `cache`; older versions `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@dataclass
class CachedPrefix:
    """Tokens a row has run through the model: the start of the row's next prompt (a multi-turn episode's context
    grows by appending), whose keys and values need not be computed again. They stay where the call that computed
    them left them: row `row` of `source` (per layer (keys, values) [rows, heads, columns, dim]), in the columns
    where `mask` is true (in order; the others are padding)."""

    ids: list[int]
    source: list[tuple[torch.Tensor, torch.Tensor]]
    row: int
    mask: torch.Tensor  # bool [columns of source]

    def covers(self, prompt: Sequence[int]) -> int:
        """How many leading tokens of `prompt` this prefix holds (at most all but its last token)."""
        n = min(len(self.ids), len(prompt) - 1)
        if n <= 0:
            return 0
        same = np.asarray(self.ids[:n]) == np.asarray(prompt[:n])
        return n if same.all() else int(np.argmin(same))

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This row's keys and values of one layer, [heads, len(ids), dim]."""
        k, v = self.source[layer]
        return k[self.row][:, self.mask], v[self.row][:, self.mask]


def _prefix_cache(prefixes, held: list[int], device):
    """(mask [n, C], per layer (keys, values) [n, heads, C, dim]) holding each row's `held` prefix tokens.

    The common case, every row's whole prefix from one earlier call (an episode's turns): that call's cache rows
    as they are, padding columns and all (the same tensors when every row of that call comes back in its order, else
    one row selection a layer; the cache's update concatenates into new tensors, so they are never written). Else
    each row's first `held` tokens gathered right-aligned at C = max(held) (a reply cut at a stop string, episodes
    from different calls)."""
    users = [i for i, c in enumerate(held) if c]
    first = prefixes[users[0]]
    n = len(prefixes)
    whole = all(prefixes[i].source is first.source and held[i] == len(prefixes[i].ids) for i in users)
    if whole and len(users) == n:
        rows_l = [prefixes[i].row for i in users]
        mask = torch.stack([prefixes[i].mask for i in users])
        if rows_l == list(range(first.source[0][0].shape[0])):
            return mask, list(first.source)  # that call's rows in its order: its cache as it is (nothing copies it)
        rows = torch.tensor(rows_l, device=device)  # some episodes ended: one gather a layer
        return mask, [(sk.index_select(0, rows), sv.index_select(0, rows)) for sk, sv in first.source]
    if whole:
        C = first.mask.shape[0]
        mask = torch.zeros((n, C), dtype=torch.bool, device=device)
        for i in users:
            mask[i] = prefixes[i].mask
        rows = torch.tensor([prefixes[i].row for i in users], device=device)
        into = torch.tensor(users, device=device)
        layers = []
        for sk, sv in first.source:
            k, v = sk.new_zeros((n, *sk.shape[1:])), sv.new_zeros((n, *sv.shape[1:]))
            k[into], v[into] = sk[rows], sv[rows]
            layers.append((k, v))
        return mask, layers
    C = max(held)
    mask = torch.zeros((n, C), dtype=torch.bool, device=device)
    k0, v0 = first.source[0]
    layers = [(k0.new_zeros((n, k0.shape[1], C, k0.shape[3])), v0.new_zeros((n, v0.shape[1], C, v0.shape[3])))]
    layers += [(k.new_zeros(layers[0][0].shape), v.new_zeros(layers[0][1].shape)) for k, v in first.source[1:]]
    for i in users:
        mask[i, C - held[i] :] = True
        for layer, (k, v) in enumerate(layers):
            pk, pv = prefixes[i].kv(layer)
            k[i, :, C - held[i] :], v[i, :, C - held[i] :] = pk[:, : held[i]], pv[:, : held[i]]
    return mask, layers


def _plain(cache) -> bool:
    """Whether `cache` holds every layer's keys and values whole (what CachedPrefix reuses)."""
    return isinstance(cache, DynamicCache) and all(type(layer).__name__ == "DynamicLayer" for layer in cache.layers)


def _with_prefixes(model, prompts, prefixes, pad_id: int, device):
    """(input ids, attention mask, position ids, cache) of a first forward pass that runs only what each row's
    cached prefix does not hold: per row [prefix columns (padding masked) | pad | rest of the prompt]."""
    held = [p.covers(q) if p is not None else 0 for p, q in zip(prefixes, prompts)]
    ids, attn = left_pad([q[c:] for q, c in zip(prompts, held)], pad_id, device)
    positions = position_ids_from_mask(attn) + torch.tensor(held, dtype=torch.long, device=device)[:, None]
    if not any(held):
        return ids, attn, positions, None
    mask, layers = _prefix_cache(prefixes, held, device)
    cache = DynamicCache(ddp_cache_data=layers, config=model.config)
    return ids, torch.cat([mask.to(attn.dtype), attn], dim=1), positions, cache


def _kept_prefixes(prompts, responses, attn, cache, width: int) -> list[CachedPrefix]:
    """Each row's prompt and response but its last token (the model never ran on that one): the real columns of
    the first `width` (prefix and prompt), then the fed response tokens."""
    source = [(layer.keys, layer.values) for layer in cache.layers]
    columns = source[0][0].shape[2]
    fed = torch.tensor([max(len(r) - 1, 0) for r in responses], device=attn.device)
    after = torch.arange(columns - width, device=attn.device)[None, :] < fed[:, None]
    mask = torch.cat([attn[:, :width].bool(), after], dim=1)
    return [
        CachedPrefix(list(p) + list(r[: int(fed[i])]), source, i, mask[i])
        for i, (p, r) in enumerate(zip(prompts, responses))
    ]


def _logits_kwarg(model) -> dict:
    """Only the last position's logits (a step needs no others): a prompt's [rows, columns, vocab] would be large."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


def _stop_string_hits(stop_text, params: SamplingParams, out_ids, rows, check, t: int) -> list[int]:
    """Which batch rows of `check` (live rows, all with t + 1 tokens) end with a stop string in their text's tail."""
    if not check.numel():
        return []
    lo = max(0, t + 1 - (max(len(x) for x in params.stop) + 8))
    tails = out_ids[rows[check], lo : t + 1].tolist()  # one transfer for every row
    return [i for i, tail in zip(check.tolist(), tails) if any(x in stop_text(tail) for x in params.stop)]


@torch.no_grad()
def generate(
    model,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    pad_id: int,
    generator: torch.Generator | RowStreams | None = None,
    stop_text: Callable[[list[int]], str] | None = None,
    prefixes: Sequence[CachedPrefix | None] | None = None,
    compact: bool = True,
    watch: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], bool] | None = None,
) -> Generation:
    """Sample one response per prompt (token lists) with a KV cache; prompts are left-padded.
    `generator`: one CPU torch.Generator for the batch, or one per prompt. `stop_text` (a decode function)
    is needed for params.stop: a row ends at the token after which its text's tail contains a stop string
    (the caller cuts exactly with cut_at_stop_strings). `prefixes` (one per row, None: none): what earlier calls
    ran of each prompt (the start it shares is not run again); then the result's `prefixes` are each row's for the
    next call. `compact`: drop finished rows from the batch as they go (without prefixes, with per-row generators or
    greedy; False: the batch keeps its shape). `watch(t, finished, out_ids, lengths)`, after each token t (every row's
    finished flag, tokens so far and lengths, in prompt order): True stops generation there (unfinished rows are then
    returned as far as they got, truncated)."""
    n = len(prompts)
    if n == 0:
        return Generation([], [], [])
    if params.stop and stop_text is None:
        raise ValueError("stop strings need stop_text (the tokenizer's decode)")
    if isinstance(generator, (list, tuple)):
        raise TypeError("one random stream per row is RowStreams(seeds), not a list of generators")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (start prompts with the tokenizer's BOS)")
    device = next(model.parameters()).device
    if prefixes is None:
        ids, attn = left_pad(prompts, pad_id, device)
        positions, past = position_ids_from_mask(attn), None
    else:
        ids, attn, positions, past = _with_prefixes(model, prompts, prefixes, pad_id, device)
    width = attn.shape[1]  # columns of the prompts (and their cached prefixes)
    stop = torch.tensor(sorted(params.stop_ids), dtype=torch.long, device=device)
    out_ids = torch.full((n, params.max_new_tokens), pad_id, dtype=torch.long, device=device)
    out_lp = torch.zeros((n, params.max_new_tokens), dtype=torch.float32, device=device)
    lengths = torch.zeros(n, dtype=torch.long, device=device)
    # Finished rows leave the batch (their keys and values too) once enough have finished, so a long-tailed batch
    # does not pay full-batch steps for its longest answers. Not with prefixes (the next turn reuses the whole
    # cache), nor with one generator for the batch: its draws depend on the batch shape, per-row ones do not.
    compact = compact and prefixes is None and (params.greedy or isinstance(generator, RowStreams))
    rows = torch.arange(n, device=device)  # batch row -> row of the result (the identity until a compaction)
    finished = torch.zeros(n, dtype=torch.bool, device=device)  # per batch row

    cache_kw, logits_kw = _cache_kwarg(model), _logits_kwarg(model)
    step_ids, step_pos = ids, positions
    for t in range(params.max_new_tokens):
        out = model(
            input_ids=step_ids,
            attention_mask=attn,
            position_ids=step_pos,
            use_cache=True,
            **{cache_kw: past},
            **logits_kw,
        )
        past = out[cache_kw]
        if params.greedy:
            logp = torch.log_softmax(out.logits[:, -1, :].float(), dim=-1)
            token = torch.argmax(logp, dim=-1)
        else:
            logp = sampling_logprobs(out.logits[:, -1, :], params.temperature, params.top_p)
            token = _sample(logp, generator)
        live = ~finished
        # Tensor ops only (no host sync): finished rows write what they held (padding, log-prob 0).
        out_ids[rows, t] = torch.where(live, token, pad_id)
        out_lp[rows, t] = torch.where(live, logp.gather(-1, token[:, None])[:, 0], 0.0)
        lengths[rows] += live.long()
        if len(stop):
            finished |= torch.isin(token, stop)
        if stop_text is not None:  # stop strings: decode the tail of each row still going
            hits = _stop_string_hits(stop_text, params, out_ids, rows, torch.nonzero(~finished).flatten(), t)
            if hits:
                finished[hits] = True
        done = int(finished.sum())  # the step's one host sync
        if watch is not None:  # the caller may stop here (runtime.rollout_scheduler: the step's groups are known)
            every = torch.ones(n, dtype=torch.bool, device=device)  # rows compacted away had finished
            every[rows] = finished
            if watch(t, every, out_ids, lengths):
                break
        if done == len(rows):
            break
        # Rows finished but still in the batch are fed padding (their outputs are ignored).
        step_ids = torch.where(finished, torch.full_like(token, pad_id), token)[:, None]
        step_pos = step_pos[:, -1:] + 1
        attn = torch.cat([attn, torch.ones((len(rows), 1), dtype=attn.dtype, device=device)], dim=1)
        # Compact once a quarter of the batch has finished since the last time: each compaction copies the cache.
        if compact and 4 * done >= len(rows) and hasattr(past, "reorder_cache"):
            keep = torch.nonzero(~finished).flatten()
            # reorder_cache: the row selection beam search uses; unlike batch_select_indices it also covers the
            # states of linear-attention layers.
            past.reorder_cache(keep)
            rows, finished, attn = rows[keep], finished[keep], attn[keep]
            step_ids, step_pos = step_ids[keep], step_pos[keep]
            if isinstance(generator, RowStreams):
                generator = generator.select(keep)

    lengths_l, ids_l, lp_l = lengths.tolist(), out_ids.tolist(), out_lp.tolist()
    responses = [ids_l[i][: lengths_l[i]] for i in range(n)]
    logprobs = [lp_l[i][: lengths_l[i]] for i in range(n)]
    stopped = set(params.stop_ids)
    truncated = [not (r and r[-1] in stopped) for r in responses]
    kept = None
    if prefixes is not None:  # a cache of another kind (sliding windows, linear attention): recompute next time
        kept = _kept_prefixes(prompts, responses, attn, past, width) if _plain(past) else [None] * n
    return Generation(responses, logprobs, truncated, kept)


class HFGenerator(Generator):
    """The torch / transformers backend (generator.backend 'hf'), CPU or GPU.

    gen = HFGenerator(model, tokenizer, task, SamplingParams.from_config(cfg.algorithm, tokenizer), seed=cfg.run.seed)
    """

    def __init__(
        self,
        model,
        tokenizer,
        task,
        sampling: SamplingParams,
        seed: int = 0,
        max_context: int | None = None,
        partial_weights: bool = False,
    ) -> None:
        self.model, self.tokenizer, self.task, self.sampling, self.seed = model.eval(), tokenizer, task, sampling, seed
        self.max_context = max_context or getattr(getattr(model, "config", None), "max_position_embeddings", None)
        # model.lora: a sync holds only the merged adapted layers (the rest is the frozen base this rank built too)
        self.partial_weights = partial_weights
        self._prefixes: dict = {}  # cache key -> CachedPrefix (generate(..., cache_keys=...))

    def load_weights(self, weights: dict[str, Any]) -> None:
        self.forget_prefixes()  # keys and values of the old weights
        load_weights_into(self.model, weights, complete=not self.partial_weights)

    def generate(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        params: SamplingParams | None = None,
        cache_keys=None,
        watch=None,
    ) -> Generation:
        params = params or self.sampling
        generators = RowStreams(seeds)
        prefixes = None
        if cache_keys is not None:  # rows whose earlier calls' keys and values are kept (episodes); others are dropped
            prefixes = [self._prefixes.get(k) for k in cache_keys]
            self._prefixes = {}
        out = generate(
            self.model,
            prompts,
            params,
            self.tokenizer.pad_id,
            generators,
            stop_text=self.tokenizer.decode if params.stop else None,
            prefixes=prefixes,
            watch=watch,
        )
        if cache_keys is not None:
            assert out.prefixes is not None  # generate() returns them when given prefixes
            self._prefixes, out.prefixes = dict(zip(cache_keys, out.prefixes)), None
        return cut_at_stop_strings(out, self.tokenizer, params.stop)

    def forget_prefixes(self) -> None:
        self._prefixes = {}


@torch.no_grad()
def load_weights_into(model, weights: dict[str, Any], complete: bool = True) -> None:
    """Copy {name: array} into the model's parameters and buffers in place (with `complete`, every parameter
    must be given; tied parameters once under either name)."""
    state = model.state_dict()
    unknown = [k for k in weights if k not in state]
    if unknown:
        raise KeyError(
            f"weights for unknown tensors {unknown[:5]}: trainer and generator models differ (check model.*)"
        )
    given = {state[k].data_ptr() for k in weights}  # tied parameters share storage
    missing = [name for name, p in model.named_parameters() if name not in weights and p.data_ptr() not in given]
    if missing and complete:
        raise KeyError(f"weights missing for {missing[:5]}")
    for name, value in weights.items():
        target = state[name]
        src = torch.from_numpy(np.asarray(value)) if not isinstance(value, torch.Tensor) else value
        if tuple(src.shape) != tuple(target.shape):
            raise ValueError(f"weight {name}: shape {tuple(src.shape)} but the model has {tuple(target.shape)}")
        target.copy_(src.to(device=target.device, dtype=target.dtype))
