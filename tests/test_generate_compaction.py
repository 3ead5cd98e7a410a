"""generate_hf.generate drops finished rows from the batch (compaction): each row's tokens stay what the fixed-shape
loop samples, with per-row generators, greedy, stop tokens and stop strings."""

import math

import pytest
import torch
from transformers import DynamicCache

from rollout_hpc.backends.generate_hf import RowStreams, SamplingParams, generate
from rollout_hpc.config import ModelSection
from rollout_hpc.models import CharTokenizer, build_model

torch.set_num_threads(1)
TOK = CharTokenizer()
CFG = ModelSection(hidden_size=32, num_layers=2, num_heads=2, max_seq_len=64)


def with_eos_bias(eos_logit: float, seed: int = 0):
    """The tiny model with an untied lm_head whose EOS row is 0 and whose bias is `eos_logit` for EOS (0 elsewhere):
    EOS gets about the same probability at every step, so response lengths are long-tailed."""
    model = build_model(CFG, TOK.vocab_size, seed=seed).eval()
    with torch.no_grad():
        head = model.lm_head
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
        head.weight[TOK.eos_id] = 0.0
        head.bias = torch.nn.Parameter(torch.zeros(head.out_features))
        head.bias[TOK.eos_id] = eos_logit
    return model


@pytest.fixture(scope="module")
def long_tailed():
    return with_eos_bias(math.log(0.1 / 0.9 * (TOK.vocab_size - 1)))  # EOS ~ 10% a step


def batch(n_prompts: int = 6, samples: int = 4) -> list[list[int]]:
    texts = ["1+2=", "12+30=", "7=", "9-3=", "41+7=", "3*3="]
    return [TOK.encode_prompt(texts[i % len(texts)]) for i in range(n_prompts) for _ in range(samples)]


@pytest.fixture
def compactions(monkeypatch) -> list[int]:
    """Rows kept by each compaction (generate's one use of reorder_cache), appended as they happen."""
    kept: list[int] = []
    original = DynamicCache.reorder_cache

    def counting(self, idx):
        kept.append(len(idx))
        return original(self, idx)

    monkeypatch.setattr(DynamicCache, "reorder_cache", counting)
    return kept


def run(model, prompts, params, compact: bool, log: list[int], generator="rows", seed: int = 0, **kw):
    """(Generation, rows kept by each compaction): with generator 'rows' one random stream per row (as
    HFGenerator builds them)."""
    if generator == "rows":
        generator = RowStreams([seed + i for i in range(len(prompts))])
    before = len(log)
    out = generate(model, prompts, params, TOK.pad_id, generator, compact=compact, **kw)
    return out, log[before:]


def assert_same(a, b):
    assert a.response_ids == b.response_ids
    assert a.truncated == b.truncated
    for x, y in zip(a.logprobs, b.logprobs):
        assert len(x) == len(y)
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=1e-5, rtol=0)


def test_compaction_samples_what_the_fixed_batch_samples(long_tailed, compactions):
    prompts = batch()
    params = SamplingParams(max_new_tokens=40, stop_ids=(TOK.eos_id,))
    for seed in (0, 100):
        compacted, calls = run(long_tailed, prompts, params, True, compactions, seed=seed)
        fixed, none = run(long_tailed, prompts, params, False, compactions, seed=seed)
        assert_same(compacted, fixed)
        assert calls and not none, "the long-tailed batch must shrink (and the fixed one not)"
        assert calls == sorted(calls, reverse=True) and calls[-1] < len(prompts)
        lengths = [len(r) for r in compacted.response_ids]
        assert len(set(lengths)) >= 5, f"the rows should end at many different steps: {lengths}"


def test_rows_keep_their_own_lengths_and_tokens(long_tailed, compactions):
    prompts = batch()
    params = SamplingParams(max_new_tokens=40, stop_ids=(TOK.eos_id,))
    out, calls = run(long_tailed, prompts, params, True, compactions, seed=7)
    assert calls
    for r, lp, trunc in zip(out.response_ids, out.logprobs, out.truncated):
        assert len(lp) == len(r) >= 1
        assert TOK.eos_id not in r[:-1]  # a row ends at its first EOS, whatever the others do
        assert trunc == (r[-1] != TOK.eos_id) and (not trunc or len(r) == 40)
    # a row sampled alone (its own generator, no other rows) gets the same tokens
    for i in (0, 5, 11, 23):
        alone = generate(long_tailed, [prompts[i]], params, TOK.pad_id, RowStreams([7 + i]))
        assert alone.response_ids[0] == out.response_ids[i]


def test_all_rows_finishing_at_once(compactions):
    certain = with_eos_bias(50.0)  # EOS first, always
    prompts = batch(3, 2)
    params = SamplingParams(max_new_tokens=8, stop_ids=(TOK.eos_id,))
    out, calls = run(certain, prompts, params, True, compactions)
    assert out.response_ids == [[TOK.eos_id]] * len(prompts) and out.truncated == [False] * len(prompts)
    assert not calls  # the loop ends before any compaction
    never = SamplingParams(max_new_tokens=5)  # no stop token: every row runs to max_new_tokens
    model = with_eos_bias(0.0)
    a, calls = run(model, prompts, never, True, compactions)
    b, _ = run(model, prompts, never, False, compactions)
    assert_same(a, b)
    assert not calls and [len(r) for r in a.response_ids] == [5] * len(prompts) and all(a.truncated)


def test_greedy(compactions):
    model = build_model(CFG, TOK.vocab_size, seed=3).eval()
    prompts = [TOK.encode_prompt(t) for t in ("1+2=", "12+30=", "7=", "9-3=", "41+7=", "3*3=", "8/2=", "5-5=")]
    with torch.no_grad():  # EOS's logit near the top of the others: greedy ends some rows early, at different steps
        logits = model(torch.tensor([p[:3] for p in prompts])).logits
        top = logits[..., [i for i in range(TOK.vocab_size) if i != TOK.eos_id]].max(-1).values
    model = with_eos_bias(float(top.quantile(0.8)), seed=3)
    params = SamplingParams(max_new_tokens=24, stop_ids=(TOK.eos_id,), greedy=True)
    a, calls = run(model, prompts, params, True, compactions, generator=None)
    b, _ = run(model, prompts, params, False, compactions, generator=None)
    assert_same(a, b)
    assert calls, [len(r) for r in a.response_ids]


def test_one_generator_for_the_batch_is_not_compacted(long_tailed, compactions):
    """Its draws depend on the batch shape: compacting would change every later row's tokens."""
    prompts = batch()
    params = SamplingParams(max_new_tokens=40, stop_ids=(TOK.eos_id,))
    a, calls = run(long_tailed, prompts, params, True, compactions, generator=torch.Generator().manual_seed(3))
    b, _ = run(long_tailed, prompts, params, False, compactions, generator=torch.Generator().manual_seed(3))
    assert not calls and a.response_ids == b.response_ids and a.logprobs == b.logprobs


def test_stop_strings_with_compaction(long_tailed, compactions):
    prompts = batch()
    params = SamplingParams(max_new_tokens=30, stop_ids=(TOK.eos_id,), stop=("0", "1", "2", "3", "ab"))
    a, calls = run(long_tailed, prompts, params, True, compactions, stop_text=TOK.decode)
    b, _ = run(long_tailed, prompts, params, False, compactions, stop_text=TOK.decode)
    assert_same(a, b)
    assert calls
    ended_by_string = 0
    for r in a.response_ids:
        text = TOK.decode(r)
        if r[-1] != TOK.eos_id and len(r) < 30:  # ended by a stop string: its last token completes the first one
            assert any(s in text for s in params.stop) and not any(s in TOK.decode(r[:-1]) for s in params.stop)
            ended_by_string += 1
    assert ended_by_string
