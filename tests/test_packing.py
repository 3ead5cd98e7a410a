"""Padding-free packing (trainer.packing, rollout_hpc/models/packing.py): a micro-batch's sequences share one row
with position ids restarting at 0, and that changes nothing but the work done on padding. Log-probs and entropies
equal the unpacked ones (built-in Llama, a Hugging Face Qwen2 directory, Mistral, Qwen3; sdpa and eager attention;
chunked and full logits), gradients equal the unpacked micro-batch path (GRPO, PPO with its critic), the token
budget counts real tokens, and generation with its KV cache is untouched.

In-process, one trainer rank (the torch backend over MPI.COMM_SELF), like tests/test_trainer_memory.py."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
from test_trainer_memory import ALGOS, VOCAB, assert_grads_close, make_cfg, model_for, rl_batch, step_gradients, world  # noqa: F401
from test_trainers import check_backend, run_backend
from tiny_hf import make_tiny_qwen

from rollout_hpc.backends import micro_batches as MB
from rollout_hpc.backends import token_scores as S
from rollout_hpc.backends import trainer as T
from rollout_hpc.config import ConfigError, load_config
from rollout_hpc.models import build_model
from rollout_hpc.models.packing import PackedRow


def test_layout_round_trips():
    attn = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    row = PackedRow.of(attn)
    assert row.n_tokens == 9
    assert row.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0]]
    x = torch.arange(15.0).reshape(3, 5)
    assert row.pack(x).tolist() == [[0, 1, 2, 5, 6, 7, 8, 9, 10]]
    assert torch.equal(row.unpack(row.pack(x)), x * attn)
    # the first token of each sequence is never scored (its predecessor in the row is another sequence's)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 0], [1, 0, 0, 0, 0]])
    assert row.scored(mask).long().tolist() == [[0, 1, 1, 0, 0, 1, 1, 0, 0]]
    assert row.scored(None).long().tolist() == [[0, 1, 1, 0, 1, 1, 1, 1, 0]]
    # a micro-batch with no real token still gives a forward of one token
    assert PackedRow.of(torch.zeros(2, 3, dtype=torch.long)).n_tokens == 1


def _hf_models(tmp_path):
    """(name, model) for every architecture packing is meant for, tiny and random."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM

    cfg = make_cfg()
    qwen2 = build_model(
        load_config(None, [f"model.path={make_tiny_qwen(tmp_path / 'qwen2')}"]).model, VOCAB, seed=0
    )  # loaded from a Hugging Face directory, like model.path
    small = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return [
        ("built-in llama", model_for(cfg)),
        ("qwen2 directory", qwen2),
        ("mistral", MistralForCausalLM(MistralConfig(**small, sliding_window=8))),  # windows inside sequences too
        ("qwen3", Qwen3ForCausalLM(Qwen3Config(**small, head_dim=8))),
    ]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_scores_equal_unpacked(tmp_path, attn):
    cfg = make_cfg()
    tensors = rl_batch(cfg, n_groups=2, seed=3)
    ids, am, mask = tensors["input_ids"], tensors["attention_mask"], tensors["mask"]
    for name, model in _hf_models(tmp_path):
        model.set_attn_implementation(attn)
        model.eval()
        for chunk in (7, None):
            for positions in (mask, None):
                want = S.lm_token_scores(model, ids, am, 0.7, chunk, positions)
                got = S.lm_token_scores(model, ids, am, 0.7, chunk, positions, packing=True)
                real = am.clone()
                real[:, 0] = 0  # unpacked scores padding too (garbage nobody reads); packed gives 0 there
                for w, g, what in zip(want, got, ("logp", "entropy")):
                    torch.testing.assert_close(g, w * real, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} {what}: {m}")
        # raw outputs (logits; the critic's values) unpack to the same [B, T, ...] layout
        want = S.model_logits(model, ids, am)
        got = S.model_logits(model, ids, am, packing=True)
        torch.testing.assert_close(got, want * am[..., None], rtol=1e-5, atol=1e-5)
    # the check has teeth: without restarting positions the sequences see each other
    row = PackedRow.of(am)
    model = _hf_models(tmp_path)[0][1].eval()
    leaky = row.unpack(model(input_ids=row.pack(ids), use_cache=False).logits)
    assert (leaky - S.model_logits(model, ids, am) * am[..., None]).abs().max() > 1e-2


def test_budget_counts_real_tokens():
    attn = torch.zeros(10, 20, dtype=torch.long)
    lengths = [3, 20, 5, 5, 5, 1, 2, 19, 4, 4]
    for i, n in enumerate(lengths):
        attn[i, :n] = 1
    parts = MB.split_micro_batches(attn, max_tokens=24, packing=True)
    assert np.concatenate(parts).tolist() == list(range(10))
    for p in parts:
        assert sum(lengths[i] for i in p) <= 24 or len(p) == 1
    padded = MB.split_micro_batches(attn, max_tokens=24)
    assert len(parts) < len(padded)  # padding no longer counts: fewer, fuller micro-batches
    assert [len(p) for p in MB.split_micro_batches(attn, max_rows=4, packing=True)] == [4, 4, 2]


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("name", ALGOS)
def test_packed_gradients_equal_unpacked(world, name, agg):  # noqa: F811  (the fixture)
    base = [
        f"algorithm.name={name}",
        f"algorithm.loss_agg={agg}",
        "algorithm.kl_coef=0.05",
        "algorithm.entropy_coef=0.01",
    ]
    variants = {
        "unpacked": [],
        "packed budget": ["trainer.packing=true", "trainer.max_tokens_per_microbatch=40"],
    }
    if (name, agg) == ("grpo", "token_mean"):  # the whole share in one row; a row bound with checkpointing
        variants["packed"] = ["trainer.packing=true"]
        variants["packed rows"] = [
            "trainer.packing=true",
            "trainer.micro_batch_size=3",
            "trainer.gradient_checkpointing=true",
        ]
    results = {}
    for label, extra in variants.items():
        cfg = make_cfg(*base, *extra)
        score = partial(T.score_tokens, cfg=cfg)  # the KL reference, scored (packed) by this config
        results[label] = step_gradients(
            world, cfg, lambda m, t: score(m.eval(), t["input_ids"], t["attention_mask"], positions=t["mask"])
        )
    g0, s0, c0, v0, ref0 = results.pop("unpacked")
    for label, (g, s, c, values, ref) in results.items():
        torch.testing.assert_close(ref, ref0, rtol=1e-5, atol=1e-5)  # the reference model is scored packed too
        assert_grads_close(g0, g)
        assert s["loss"] == pytest.approx(s0["loss"], rel=1e-5, abs=1e-7), label
        assert s["entropy"] == pytest.approx(s0["entropy"], rel=1e-5), label
        if label != "packed":
            assert s["micro_batches"] > 2, label
        if c0 is not None:  # values V(x_<t) equal wherever token t-1 is real (packed: 0 after the last one)
            am = rl_batch(make_cfg())["attention_mask"]
            after_real = torch.nn.functional.pad(am[:, :-1], (1, 0))
            torch.testing.assert_close(values, v0 * after_real, rtol=1e-5, atol=1e-5)
            assert_grads_close(c0, c)


def test_generation_with_kv_cache_is_untouched(world):  # noqa: F811
    """The generators' path (model.generate, KV cache) never sees packing; its sampling log-probs equal what a
    packed trainer scores for the same tokens, and the model object is the same after a packed step."""
    cfg = make_cfg("trainer.packing=true", "trainer.max_tokens_per_microbatch=40")
    model = model_for(cfg).eval()
    prompts = [torch.tensor([[5, 9, 11]]), torch.tensor([[7, 3, 3, 20, 8, 6]])]

    def generate():
        rows, scores = [], []
        for p in prompts:
            out = model.generate(
                input_ids=p,
                attention_mask=torch.ones_like(p),
                max_new_tokens=6,
                min_new_tokens=6,
                do_sample=False,
                use_cache=True,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            logits = torch.stack(out.logits, 1)[0].float()
            new = out.sequences[0, p.shape[1] :]
            rows.append(out.sequences[0])
            scores.append(torch.log_softmax(logits, -1).gather(-1, new[:, None])[:, 0])
        return rows, scores

    rows, gen_lp = generate()
    settings = (model.config._attn_implementation, model.config.use_cache)
    trainer = T.make_trainer(cfg, model, world)  # no copy: the generator's model is the trainer's
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    mask = torch.zeros(len(rows), width)
    for i, (r, p) in enumerate(zip(rows, prompts)):
        ids[i, : len(r)], attn[i, : len(r)], mask[i, p.shape[1] : len(r)] = r, 1, 1
    lp, _ = trainer.logprobs(ids, attn, mask)
    for i, p in enumerate(prompts):
        torch.testing.assert_close(lp[i, p.shape[1] : len(rows[i])], gen_lp[i], rtol=1e-4, atol=1e-5)
    tensors = {"input_ids": ids, "attention_mask": attn, "loss_mask": mask}
    trainer.train_step(tensors, T.cross_entropy_loss_fn, mask_key="loss_mask")
    assert (model.config._attn_implementation, model.config.use_cache) == settings
    model.eval()
    rows_after, _ = generate()  # generation still runs (weights moved, so the tokens may differ)
    assert [len(r) for r in rows_after] == [len(r) for r in rows]


def test_packing_refuses_what_it_cannot_keep_apart(world):  # noqa: F811
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = make_cfg("trainer.packing=true")
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=64))
    with pytest.raises(ConfigError, match="trainer.packing.*gpt2"):
        T.make_trainer(cfg, gpt2, world)
    with pytest.raises(ConfigError, match="trainer.packing"):
        make_cfg("trainer.packing=true", "trainer.backend=megatron")


def test_deepspeed_zero3_packed(tmp_path):
    """Two DeepSpeed ZeRO-3 ranks, each micro-batch one packed row of <= 24 real tokens (the packed forward runs
    inside the engine: parameter gathering, hooks): the loss falls, the replicas agree, a resume is exact. (That
    packed equals unpacked is shown in-process above; tests/test_trainers.py compares DeepSpeed with DDP.)"""
    check_backend(
        run_backend(
            tmp_path,
            [
                "trainer.backend=deepspeed",
                "trainer.zero_stage=3",
                "trainer.tasks_per_node=2",
                "trainer.packing=true",
                "trainer.max_tokens_per_microbatch=24",
            ],
        )
    )
