"""The trainer at real sizes, checked at small ones: token-budget micro-batches give the unsplit gradients
(every algorithm, both aggregations, policy and PPO critic), chunked log-probs equal full-logit ones,
gradient checkpointing changes nothing, the LR schedule and its resume, mini-batch epochs.

In-process, one trainer rank (torch.distributed over MPI.COMM_SELF); DeepSpeed over two ranks is in
tests/test_trainers.py."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rollout_hpc.backends import trainer as T
from rollout_hpc.config import ConfigError, load_config
from rollout_hpc.models import build_model
from rollout_hpc.runtime import objective, records

VOCAB = 40


@pytest.fixture(scope="module")
def world():
    from mpi4py import MPI

    return SimpleNamespace(group_comm=MPI.COMM_SELF, group_rank=0, group_size=1, local_rank=0)


def make_cfg(*overrides):
    return load_config(
        None,
        [
            "model.hidden_size=32",
            "model.num_layers=2",
            "model.num_heads=4",
            "model.max_seq_len=64",
            "algorithm.max_grad_norm=1e9",
            "algorithm.group_size=4",
            *overrides,
        ],
    )


def model_for(cfg):
    return build_model(cfg.model, VOCAB, seed=0)


def rl_batch(cfg, n_groups=4, seed=0):
    """A step's tensors as records.collate makes them: varying prompt/response lengths, right-padded."""
    g = torch.Generator().manual_seed(seed)
    B = n_groups * cfg.algorithm.group_size
    plen = torch.randint(2, 6, (B,), generator=g)
    rlen = torch.randint(1, 12, (B,), generator=g)
    Tm = int((plen + rlen).max())
    ids = torch.randint(3, VOCAB, (B, Tm), generator=g)
    attn = torch.zeros(B, Tm, dtype=torch.long)
    mask = torch.zeros(B, Tm)
    for i in range(B):
        attn[i, : plen[i] + rlen[i]] = 1
        mask[i, plen[i] : plen[i] + rlen[i]] = 1
    ids = ids * attn
    mask[1, -1] = 0  # a multi-turn style hole is fine too
    old = -torch.rand(B, Tm, generator=g) * 3 * mask
    rewards = torch.randint(0, 2, (B,), generator=g).float()
    rewards[: cfg.algorithm.group_size] = 1.0  # one all-equal group (dynamic sampling drops it)
    return {
        "input_ids": ids,
        "attention_mask": attn,
        "mask": mask,
        "old_logprobs": old,
        "rewards": rewards,
        "response_len": rlen.float(),
    }


def grads_after(trainer, fn):
    """Run fn() (one optimize) with the optimizer step disabled; the accumulated gradients by name."""
    step = trainer.optimizer.step
    trainer.optimizer.step = lambda *a, **k: None
    try:
        stats = fn()
    finally:
        trainer.optimizer.step = step
    return {n: p.grad.detach().clone() for n, p in trainer.module.named_parameters() if p.grad is not None}, stats


def assert_grads_close(a, b, rtol=2e-4, atol=1e-6):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")


ALGOS = ["grpo", "ppo", "dapo", "rloo", "reinforce_pp"]


def step_gradients(world, cfg, reference=None):
    """One train step of the policy (and of PPO's critic) on rl_batch(cfg), optimizer steps off:
    (policy gradients, stats, critic gradients or None, the critic's values or None, reference log-probs).
    reference(model, tensors) -> the KL reference's log-probs (default: fixed random ones)."""
    from rollout_hpc.runtime.critic import Critic

    model = model_for(cfg)
    trainer = T.make_trainer(cfg, copy.deepcopy(model), world)
    tensors = rl_batch(cfg)
    critic = Critic(cfg, model, world) if cfg.algorithm.name == "ppo" else None
    values = critic.values(tensors["input_ids"], tensors["attention_mask"]) if critic else None
    if reference is None:
        ref = -torch.rand(tensors["mask"].shape, generator=torch.Generator().manual_seed(5)) * tensors["mask"]
    else:
        ref = reference(model, tensors)
    objective.add_advantages(cfg, tensors, ref, values)
    if critic:  # a critic that is not all zeros, so its gradients are informative
        tensors["returns"] = (
            tensors["returns"]
            + torch.randn(tensors["returns"].shape, generator=torch.Generator().manual_seed(7)) * tensors["mask"]
        )
    agg = cfg.algorithm.loss_agg
    g, stats = grads_after(trainer, lambda: trainer.train_step(tensors, objective.make_loss_fn(cfg), agg=agg))
    cg = grads_after(critic.trainer, lambda: critic.train_step(tensors))[0] if critic else None
    return g, stats, cg, values, ref


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("name", ALGOS)
def test_micro_batches_give_unsplit_gradients(world, name, agg):
    base = [
        f"algorithm.name={name}",
        f"algorithm.loss_agg={agg}",
        "algorithm.kl_coef=0.05",
        "algorithm.entropy_coef=0.01",
    ]
    results = {}
    for label, extra in {
        "whole": [],
        "tokens": ["trainer.max_tokens_per_microbatch=40"],
        "rows": ["trainer.micro_batch_size=3"],
    }.items():
        results[label] = step_gradients(world, make_cfg(*base, *extra))[:3]
    g0, s0, c0 = results["whole"]
    assert s0["micro_batches"] == 1
    for label in ("tokens", "rows"):
        g, s, c = results[label]
        assert s["micro_batches"] > 2, label
        assert_grads_close(g0, g)
        assert s["loss"] == pytest.approx(s0["loss"], rel=1e-5, abs=1e-7)
        if agg == "token_mean":  # token-weighted statistics are exact under token_mean
            assert s["clip_frac"] == pytest.approx(s0["clip_frac"], abs=1e-6)
        if c0 is not None:
            assert_grads_close(c0, c)


def test_split_respects_budget_and_equal_counts():
    attn = torch.zeros(10, 20, dtype=torch.long)
    for i, n in enumerate([3, 20, 5, 5, 5, 1, 2, 19, 4, 4]):
        attn[i, :n] = 1
    parts = T.split_micro_batches(attn, max_tokens=24)
    assert np.concatenate(parts).tolist() == list(range(10))
    for p in parts:
        longest = int(attn[p].sum(1).max())
        assert len(p) * longest <= 24 or len(p) == 1
    more = T.split_micro_batches(attn, max_tokens=24, min_parts=len(parts) + 3)
    assert len(more) == len(parts) + 3 and np.concatenate(more).tolist() == list(range(10))
    assert len(T.split_micro_batches(attn[:2], max_rows=1, min_parts=4)) == 4  # empty parts pad the count
    assert len(T.split_micro_batches(attn)) == 1


def test_chunked_logprobs_equal_full_logits():
    cfg = make_cfg()
    model = model_for(cfg).eval()
    tensors = rl_batch(cfg, seed=3)
    ids, attn, mask = tensors["input_ids"], tensors["attention_mask"], tensors["mask"]
    full_lp, full_ent = T.token_logprobs(T.model_logits(model, ids, attn), ids, 0.7)
    for chunk in (1, 7, 1024):
        lp, ent = T.lm_token_scores(model, ids, attn, 0.7, chunk)  # every position
        torch.testing.assert_close(lp, full_lp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, full_ent, rtol=1e-5, atol=1e-5)
        lp, ent = T.lm_token_scores(model, ids, attn, 0.7, chunk, positions=mask)  # response tokens only
        torch.testing.assert_close(lp, full_lp * mask, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, full_ent * mask, rtol=1e-5, atol=1e-5)
    # and the gradients through the chunked path (each chunk recomputed in backward)
    m1, m2 = copy.deepcopy(model), copy.deepcopy(model)
    T.token_logprobs(T.model_logits(m1, ids, attn), ids, 0.7)[0].mul(mask).sum().backward()
    T.lm_token_scores(m2, ids, attn, 0.7, 5, positions=mask)[0].sum().backward()
    for (n, p1), (_, p2) in zip(m1.named_parameters(), m2.named_parameters()):
        torch.testing.assert_close(p1.grad, p2.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_chunked_path_never_builds_full_logits(monkeypatch):
    """The output projection only ever sees chunk_tokens rows at a time."""
    cfg = make_cfg()
    model = model_for(cfg)
    tensors = rl_batch(cfg, n_groups=8, seed=4)
    seen = []
    model.lm_head.register_forward_hook(lambda mod, inp, out: seen.append(inp[0].shape))
    T.lm_token_scores(model, tensors["input_ids"], tensors["attention_mask"], 1.0, 16, positions=tensors["mask"])
    assert seen and all(s[0] <= 16 and len(s) == 2 for s in seen)


def test_trainer_logprobs_and_reference_scoring_match(world):
    cfg = make_cfg("trainer.max_tokens_per_microbatch=50", "trainer.logprob_chunk_tokens=8")
    model = model_for(cfg)
    tensors = rl_batch(cfg, seed=6)
    trainer = T.make_trainer(cfg, copy.deepcopy(model), world)
    lp, ent = trainer.logprobs(tensors["input_ids"], tensors["attention_mask"], tensors["mask"])
    full_lp, full_ent = T.token_logprobs(
        T.model_logits(model.eval(), tensors["input_ids"], tensors["attention_mask"]), tensors["input_ids"]
    )
    torch.testing.assert_close(lp, full_lp * tensors["mask"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, full_ent * tensors["mask"], rtol=1e-5, atol=1e-5)
    ref = T.score_tokens(model, tensors["input_ids"], tensors["attention_mask"], cfg, tensors["mask"])
    torch.testing.assert_close(ref, full_lp * tensors["mask"], rtol=1e-5, atol=1e-5)


def test_gradient_checkpointing_same_gradients(world):
    out = []
    for on in ("false", "true"):
        cfg = make_cfg(f"trainer.gradient_checkpointing={on}", "trainer.micro_batch_size=5")
        trainer = T.make_trainer(cfg, model_for(cfg), world)
        tensors = rl_batch(cfg, seed=2)
        objective.add_advantages(cfg, tensors, None, None)
        out.append(grads_after(trainer, lambda: trainer.train_step(tensors, objective.make_loss_fn(cfg)))[0])
    assert_grads_close(out[0], out[1], rtol=1e-5)


def test_gradient_checkpointing_recomputes(world):
    cfg = make_cfg("trainer.gradient_checkpointing=true")
    trainer = T.make_trainer(cfg, model_for(cfg), world)
    calls = []
    mlp = trainer.module.model.layers[0].mlp
    forward = mlp.forward  # (module hooks do not fire in torch's recompute: count calls of forward itself)
    mlp.forward = lambda *a, **k: (calls.append(1), forward(*a, **k))[1]
    tensors = rl_batch(cfg, seed=2)
    objective.add_advantages(cfg, tensors, None, None)
    trainer.train_step(tensors, objective.make_loss_fn(cfg))
    assert len(calls) == 2  # forward, and again in backward


def test_lr_schedule_values():
    def lrs(*over):
        a = make_cfg("algorithm.lr=1.0", "algorithm.steps=10", *over).algorithm
        return [T.lr_at(a, s) for s in range(10)]

    assert lrs() == [1.0] * 10
    assert lrs("algorithm.warmup_steps=4") == [0.25, 0.5, 0.75] + [1.0] * 7
    lin = lrs("algorithm.lr_schedule=linear", "algorithm.warmup_steps=2", "algorithm.min_lr_ratio=0.1")
    assert lin[:2] == [0.5, 1.0] and lin[-1] == pytest.approx(0.1) and lin[2] == 1.0
    assert all(x > y for x, y in zip(lin[2:], lin[3:]))
    cos = lrs("algorithm.lr_schedule=cosine")
    assert (
        cos[0] == 1.0
        and cos[-1] == pytest.approx(0.0, abs=1e-12)
        and cos[5] == pytest.approx(0.5 * (1 + np.cos(np.pi * 5 / 9)))
    )
    # mini-batches x epochs: the schedule counts optimizer updates
    a = make_cfg(
        "algorithm.lr=1.0", "algorithm.steps=5", "algorithm.mini_batches=2", "algorithm.lr_schedule=linear"
    ).algorithm
    assert T.lr_at(a, 9) == pytest.approx(0.0) and T.lr_at(a, 4) > 0.5
    # warmup_ratio: a fraction of all optimizer updates (10 steps x 2 mini-batches: 0.2 -> 4 updates)
    a = make_cfg("algorithm.lr=1.0", "algorithm.steps=10", "algorithm.mini_batches=2", "algorithm.warmup_ratio=0.2")
    assert [T.lr_at(a.algorithm, s) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    with pytest.raises(ConfigError, match="warmup_steps .* and algorithm.warmup_ratio .* both set"):
        make_cfg("algorithm.warmup_steps=2", "algorithm.warmup_ratio=0.1")


def _digest(trainer):
    import hashlib

    h = hashlib.sha256()
    for k, v in sorted(trainer.full_weights().items()):
        h.update(k.encode() + v.tobytes())
    return h.hexdigest()


def test_resume_mid_warmup_is_bitwise(world):
    """Save after 2 of 6 steps inside an 4-step warmup (cosine after it), load into a fresh trainer, finish:
    the weights equal an uninterrupted run's bit for bit, and every step used the scheduled LR."""
    over = [
        "algorithm.lr=0.01",
        "algorithm.steps=6",
        "algorithm.warmup_steps=4",
        "algorithm.lr_schedule=cosine",
        "algorithm.weight_decay=0.1",
        "algorithm.adam_betas=[0.8,0.95]",
        "algorithm.adam_eps=1e-6",
        "algorithm.max_grad_norm=1.0",
        "trainer.micro_batch_size=5",
    ]
    cfg = make_cfg(*over)
    tensors = rl_batch(cfg, seed=9)
    objective.add_advantages(cfg, tensors, None, None)
    loss_fn = objective.make_loss_fn(cfg)
    model = model_for(cfg)

    straight = T.make_trainer(cfg, copy.deepcopy(model), world)
    lrs = [straight.train_step(tensors, loss_fn)["lr"] for _ in range(6)]
    assert lrs == [T.lr_at(cfg.algorithm, s) for s in range(6)] and lrs[0] == pytest.approx(0.0025)
    assert (
        straight.optimizer.param_groups[0]["betas"] == (0.8, 0.95) and straight.optimizer.param_groups[0]["eps"] == 1e-6
    )

    first = T.make_trainer(cfg, copy.deepcopy(model), world)
    for _ in range(2):
        first.train_step(tensors, loss_fn)
    state = copy.deepcopy(first.state_dict_for_checkpoint())
    assert state["lr_schedule"] == {"name": "cosine", "step": 2, "lr": T.lr_at(cfg.algorithm, 2)}
    resumed = T.make_trainer(cfg, model_for(make_cfg(*over, "run.seed=1")), world)
    resumed.load_checkpoint_state(state)
    rest = [resumed.train_step(tensors, loss_fn)["lr"] for _ in range(4)]
    assert rest == lrs[2:]
    assert _digest(resumed) == _digest(straight)


def test_mini_batch_epochs(world):
    cfg = make_cfg("algorithm.mini_batches=2", "algorithm.epochs=3", "algorithm.lr=0.01", "algorithm.max_grad_norm=1.0")
    model = model_for(cfg)
    trainer = T.make_trainer(cfg, copy.deepcopy(model), world)
    tensors = rl_batch(cfg, seed=11)
    # on-policy behaviour log-probs: the first update's ratio is 1, later ones move off it and get clipped
    lp, _ = trainer.logprobs(tensors["input_ids"], tensors["attention_mask"], tensors["mask"])
    tensors["old_logprobs"] = lp
    objective.add_advantages(cfg, tensors, None, None)
    seen = []
    real = trainer.train_step
    trainer.train_step = lambda b, f, **k: seen.append(real(b, f, **k)) or seen[-1]
    stats = objective.train_updates(cfg, trainer, None, tensors, objective.make_loss_fn(cfg))
    assert stats["updates"] == 6 and trainer.steps_done == 6 and len(seen) == 6
    assert seen[0]["approx_kl"] == pytest.approx(0.0, abs=1e-6) and seen[0]["clip_frac"] == 0.0
    assert stats["clip_frac"] > 0 and stats["clip_frac"] == pytest.approx(np.mean([s["clip_frac"] for s in seen]))
    assert stats["approx_kl"] == pytest.approx(np.mean([s["approx_kl"] for s in seen]))
    # more mini-batches than rows: the empty ones are weight-0 updates, every rank runs the same count
    small = records.select_rows(tensors, np.arange(2))
    cfg8 = make_cfg("algorithm.mini_batches=4")
    t8 = T.make_trainer(cfg8, copy.deepcopy(model), world)
    assert objective.train_updates(cfg8, t8, None, small, objective.make_loss_fn(cfg8))["updates"] == 4


def test_default_is_one_update_of_the_whole_share(world):
    cfg = make_cfg()
    a, t = cfg.algorithm, cfg.trainer
    assert (a.mini_batches, a.epochs, t.max_tokens_per_microbatch, t.micro_batch_size, t.gradient_checkpointing) == (
        1,
        1,
        None,
        None,
        False,
    )
    assert (a.lr_schedule, a.warmup_steps, a.weight_decay, tuple(a.adam_betas)) == ("constant", 0, 0.0, (0.9, 0.99))
    trainer = T.make_trainer(cfg, model_for(cfg), world)
    tensors = rl_batch(cfg)
    objective.add_advantages(cfg, tensors, None, None)
    stats = objective.train_updates(cfg, trainer, None, tensors, objective.make_loss_fn(cfg))
    assert stats["micro_batches"] == 1 and "updates" not in stats and stats["lr"] == a.lr
