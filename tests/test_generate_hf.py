"""HF generator backend on the built-in tiny model: shapes, stopping, logprobs, determinism, episodes."""

import numpy as np
import pytest
import torch

from rollout_hpc.backends.generate_hf import (
    Generation,
    HFGenerator,
    SamplingParams,
    generate,
    load_weights_into,
    rollout_episodes,
    sampling_logprobs,
)
from rollout_hpc.config import ModelSection, TaskSection
from rollout_hpc.envs import Level, SokobanEnv, load_task
from rollout_hpc.envs.registry import TaskError
from rollout_hpc.models import CharTokenizer, build_model, response_logprobs
from rollout_hpc.trajectory import TrajectoryBatch

torch.set_num_threads(1)
TOK = CharTokenizer()
CFG = ModelSection(hidden_size=32, num_layers=2, num_heads=2, max_seq_len=64)


@pytest.fixture(scope="module")
def model():
    return build_model(CFG, TOK.vocab_size, seed=0).eval()


def prompts():
    # different lengths, so left padding matters
    return [TOK.encode_prompt(t) for t in ("1+2=", "12+30=", "7=", "9-3=")]


def test_shapes_and_logprobs_match_teacher_forcing(model):
    params = SamplingParams(max_new_tokens=6, temperature=1.0)  # no stop token: every response is 6 long
    gen = generate(model, prompts(), params, TOK.pad_id, torch.Generator().manual_seed(1))
    assert [len(r) for r in gen.response_ids] == [6] * 4
    assert [len(lp) for lp in gen.logprobs] == [6] * 4
    assert gen.truncated == [True] * 4
    assert all(0 <= t < TOK.vocab_size for r in gen.response_ids for t in r)
    with torch.no_grad():
        scores = response_logprobs(model, prompts(), gen.response_ids, TOK.pad_id)
    torch.testing.assert_close(torch.tensor(gen.logprobs), scores.logprobs, atol=1e-4, rtol=0)
    # and against one unpadded forward pass per sequence
    for p, r, lp in zip(prompts(), gen.response_ids, gen.logprobs):
        with torch.no_grad():
            logits = model(torch.tensor([p + r])).logits[0, len(p) - 1 : -1]
        expect = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(lp), expect, atol=1e-4, rtol=0)


def test_temperature_logprobs_are_of_the_scaled_distribution(model):
    params = SamplingParams(max_new_tokens=4, temperature=0.7)
    gen = generate(model, prompts(), params, TOK.pad_id, torch.Generator().manual_seed(2))
    with torch.no_grad():
        scores = response_logprobs(model, prompts(), gen.response_ids, TOK.pad_id, temperature=0.7)
    torch.testing.assert_close(torch.tensor(gen.logprobs), scores.logprobs, atol=1e-4, rtol=0)


def test_top_p_filter():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    # nucleus 0.7: mass before each token 0, 0.5, 0.8, 0.95 -> keep the first two, renormalised 0.625 / 0.375
    lp = sampling_logprobs(logits, 1.0, 0.7)
    torch.testing.assert_close(lp.exp(), torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    torch.testing.assert_close(sampling_logprobs(logits, 1.0, 1.0).exp(), torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    # sampled tokens never leave the nucleus
    model = build_model(CFG, TOK.vocab_size, seed=5).eval()
    gen = generate(
        model, prompts(), SamplingParams(max_new_tokens=5, top_p=0.3), TOK.pad_id, torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        scores = response_logprobs(model, prompts(), gen.response_ids, TOK.pad_id)
    # a filtered, renormalised probability is at least the unfiltered one
    assert (torch.tensor(gen.logprobs) >= scores.logprobs - 1e-5).all()


def test_stops_at_eos(model):
    biased = build_model(CFG, TOK.vocab_size, seed=0).eval()
    with torch.no_grad():
        biased.model.norm.weight.zero_()  # final hidden state 0 -> all logits 0 -> uniform over the vocabulary
    params = SamplingParams(max_new_tokens=40, stop_ids=(TOK.eos_id,))
    gen = generate(biased, prompts() * 8, params, TOK.pad_id, torch.Generator().manual_seed(3))
    ended = [r for r, t in zip(gen.response_ids, gen.truncated) if not t]
    assert ended, "with a uniform distribution over 99 tokens and 40 draws some response must hit EOS"
    for r, lp, t in zip(gen.response_ids, gen.logprobs, gen.truncated):
        assert len(r) == len(lp) <= 40
        if not t:
            assert r[-1] == TOK.eos_id and TOK.eos_id not in r[:-1]
        else:
            assert len(r) == 40 and TOK.eos_id not in r
        np.testing.assert_allclose(lp, -np.log(TOK.vocab_size), rtol=1e-5)


def test_same_seed_same_samples(model):
    params = SamplingParams(max_new_tokens=6, stop_ids=(TOK.eos_id,))
    a = generate(model, prompts(), params, TOK.pad_id, torch.Generator().manual_seed(11))
    b = generate(model, prompts(), params, TOK.pad_id, torch.Generator().manual_seed(11))
    c = generate(model, prompts(), params, TOK.pad_id, torch.Generator().manual_seed(12))
    assert a.response_ids == b.response_ids and a.logprobs == b.logprobs
    assert a.response_ids != c.response_ids


def test_generator_rollout_builds_trajectory_records(model):
    task = load_task(TaskSection(name="arithmetic", params={"max_operand": 4, "ops": "+"}))
    gen = HFGenerator(model, TOK, task, SamplingParams(max_new_tokens=3, stop_ids=(TOK.eos_id,)), seed=7)
    dataset = task.prompts(0)
    batch = gen.rollout(dataset, [4, 5], group_size=3, gen_rank=2, policy_version=9)
    again = TrajectoryBatch.unpack(batch.pack())  # a valid record: packs and unpacks
    assert len(again) == 6
    assert again.fixed["prompt_id"].tolist() == [4, 4, 4, 5, 5, 5]
    assert again.fixed["sample_idx"].tolist() == [0, 1, 2, 0, 1, 2]
    assert set(again.fixed["gen_rank"]) == {2} and set(again.fixed["policy_version"]) == {9}
    for i in range(6):
        r = again.record(i)
        item = dataset[r["prompt_id"]]
        assert TOK.decode(r["prompt_ids"]) == item.text
        assert r["reward"] == task.reward(item, TOK.decode(r["response_ids"]))
        assert r["loss_mask"].tolist() == [1] * r["response_len"]
        assert r["truncated"] == int(r["response_ids"][-1] != TOK.eos_id)
    # same seed and prompts -> the same records (resumed runs sample the same)
    b2 = HFGenerator(model, TOK, task, gen.sampling, seed=7).rollout(dataset, [4, 5], 3, 2, 9)
    assert np.array_equal(b2.response_ids, batch.response_ids) and np.array_equal(b2.logprobs, batch.logprobs)
    # each sample has its own random stream: prompt 5 alone gets the same responses as in the batch
    alone = gen.rollout(dataset, [5], 3, 2, 9)
    assert [alone.record(i)["response_ids"].tolist() for i in range(3)] == [
        batch.record(i)["response_ids"].tolist() for i in range(3, 6)
    ]


def test_multi_turn_episode_masks_environment_tokens():
    level = Level.from_text("#####\n#@  #\n# $ #\n#  .#\n#####")
    script = iter(["D", "R", "x", "U", "R", "D"])  # the third reply is invalid

    def scripted(prompts, live):  # a policy that replies from the script, with known logprobs
        ids = [TOK.encode(next(script)) + [TOK.eos_id] for _ in prompts]
        return Generation(ids, [[-0.5] * len(r) for r in ids], [False] * len(ids))

    env = SokobanEnv(max_turns=10, instructions=False)
    (ep,) = rollout_episodes([env], [level], scripted, TOK, max_new_tokens=2)
    assert len(ep.turn_starts) == 6 and not ep.truncated
    assert ep.reward == pytest.approx(5 * -0.05 - 0.1 + 1.0)
    resp = np.array(ep.response_ids)
    mask = np.array(ep.loss_mask)
    for k, start in enumerate(ep.turn_starts):
        assert TOK.decode(resp[start : start + 2]) in "DRxURD"[k]
        assert mask[start : start + 2].tolist() == [1, 1]
    # everything between turns is the environment's observation, masked out, with logprob 0
    obs = resp[mask == 0]
    assert "invalid action" in TOK.decode(obs) and "#####" in TOK.decode(obs)
    assert np.all(np.array(ep.logprobs)[mask == 0] == 0) and np.all(np.array(ep.logprobs)[mask == 1] == -0.5)
    assert TOK.decode(ep.prompt_ids) == "#####\n#@  #\n# $ #\n#  .#\n#####\n"
    with pytest.raises(TaskError, match="model.max_seq_len"):
        rollout_episodes([SokobanEnv()], [level], scripted, TOK, max_new_tokens=2, max_context=40)


def test_multi_turn_rollout_with_the_model_and_context_limit(model):
    task = load_task(TaskSection(name="sokoban", params={"max_turns": 3, "instructions": False}))
    gen = HFGenerator(
        model, TOK, task, SamplingParams(max_new_tokens=2, stop_ids=(TOK.eos_id,)), seed=1, max_context=64
    )
    batch = gen.rollout(task.prompts(0), [0], group_size=2, gen_rank=0, policy_version=0)
    assert len(batch) == 2
    for i in range(2):
        r = batch.record(i)
        assert 1 <= r["n_turns"] <= 3
        assert r["prompt_len"] + r["response_len"] <= 64  # no turn starts that would not fit
        assert r["truncated"] == (r["reward"] < 0.5)  # not solved = ended by max_turns or the context
        assert r["loss_mask"][r["turn_starts"]].all()
        # the recorded logprobs of the model's tokens are what the whole trajectory, teacher-forced, gives them
        with torch.no_grad():
            scores = response_logprobs(model, [r["prompt_ids"].tolist()], [r["response_ids"].tolist()], TOK.pad_id)
        policy = r["loss_mask"].astype(bool)
        np.testing.assert_allclose(r["logprobs"][policy], scores.logprobs[0].numpy()[policy], atol=1e-4)


def test_load_weights_in_place(model):
    other = build_model(CFG, TOK.vocab_size, seed=1)
    weights = {k: v.numpy() for k, v in other.state_dict().items()}
    target = build_model(CFG, TOK.vocab_size, seed=0)
    load_weights_into(target, weights)
    assert all(torch.equal(target.state_dict()[k], other.state_dict()[k]) for k in weights)
    with pytest.raises(KeyError, match="unknown"):
        load_weights_into(target, {"nope": np.zeros(1)})
    with pytest.raises(KeyError, match="missing"):
        load_weights_into(target, {"lm_head.weight": weights["lm_head.weight"]})


@pytest.mark.gpu  # skipped only where vLLM and a GPU are present
def test_vllm_backend_explains_what_is_missing():
    """Without vLLM or a GPU the backend says how to get one or to use 'hf' (runs everywhere)."""
    from rollout_hpc.backends.generate_vllm import NEEDS, VLLMGenerator, VLLMUnavailable

    try:
        import vllm  # noqa: F401

        has_vllm = torch.cuda.is_available()
    except ImportError:
        has_vllm = False
    if has_vllm:
        pytest.skip("vLLM and a GPU are present; see test_vllm_generates_like_the_sampler")
    with pytest.raises(VLLMUnavailable, match="use backend hf"):
        VLLMGenerator(CFG, TOK, None, SamplingParams())
    assert "pip install vllm" in NEEDS


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and vLLM")
def test_vllm_generates_like_the_sampler(model):
    """On a GPU node: vLLM's sampling logprobs equal teacher-forced ones, and weight updates apply."""
    pytest.importorskip("vllm")
    from rollout_hpc.backends.generate_vllm import VLLMGenerator

    task = load_task(TaskSection(name="arithmetic", params={"max_operand": 4, "ops": "+"}))
    gen = VLLMGenerator(
        CFG,
        TOK,
        task,
        SamplingParams(max_new_tokens=4, stop_ids=(TOK.eos_id,)),
        seed=0,
        model=model,
        gpu_memory_utilization=0.2,
    )
    out = gen.generate(prompts(), [1, 2, 3, 4])
    with torch.no_grad():
        scores = response_logprobs(model, prompts(), out.response_ids, TOK.pad_id)
    for i, lp in enumerate(out.logprobs):
        torch.testing.assert_close(torch.tensor(lp), scores.logprobs[i, : len(lp)], atol=2e-3, rtol=0)
    other = build_model(CFG, TOK.vocab_size, seed=9)
    gen.load_weights({k: v.numpy() for k, v in other.state_dict().items()})
    out2 = gen.generate(prompts(), [1, 2, 3, 4])
    with torch.no_grad():
        scores2 = response_logprobs(other, prompts(), out2.response_ids, TOK.pad_id)
    torch.testing.assert_close(
        torch.tensor(out2.logprobs[0]), scores2.logprobs[0, : len(out2.logprobs[0])], atol=2e-3, rtol=0
    )
    batch = gen.rollout(task.prompts(0), [0, 1], 2, 0, 0)
    assert len(TrajectoryBatch.unpack(batch.pack())) == 4


def test_the_sampler_draws_from_the_distribution_and_never_outside_the_nucleus():
    from rollout_hpc.backends.generate_hf import RowStreams, _sample, sampling_logprobs

    torch.manual_seed(0)
    logits = torch.randn(1, 12) * 2
    rows = 40_000
    for top_p in (1.0, 0.7):
        logp = sampling_logprobs(logits.expand(rows, -1), 1.0, top_p)
        tokens = _sample(logp, RowStreams(range(rows)))  # one draw from each of 40,000 streams
        freq = torch.bincount(tokens, minlength=12).double() / rows
        p = logp[0].exp().double()
        assert torch.all(freq[p == 0] == 0)  # outside the nucleus: never
        assert torch.allclose(freq, p, atol=4 * (0.25 / rows) ** 0.5)  # 4 standard errors at worst
    both, alone = RowStreams([5, 6]), RowStreams([6])
    for _ in range(3):
        assert both.uniform()[1].item() == alone.uniform().item()  # a row's stream ignores the other rows
    kept = both.select(torch.tensor([1]))
    assert kept.uniform().item() == alone.uniform().item()  # a selected row keeps its place in its stream
