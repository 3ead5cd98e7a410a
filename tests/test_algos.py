"""Algorithms against values worked out by hand (the arithmetic is in the comments)."""

import math

import pytest
import torch

from rollout_hpc.algos import (
    ALGORITHMS,
    ESTIMATORS,
    aggregate,
    compute_advantages,
    discounted_returns,
    dynamic_sampling_filter,
    entropy_from_logits,
    gae,
    groups_to_refill,
    kl_penalty,
    overlong_penalty,
    policy_loss,
    value_loss,
    value_targets,
    whiten,
)
from rollout_hpc.cli import main as cli_main
from rollout_hpc.config import load_config
from rollout_hpc.errors import ConfigError

torch.set_num_threads(1)


def t(x):
    return torch.as_tensor(x, dtype=torch.float32)


def close(a, b, tol=1e-5):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float32), t(b), atol=tol, rtol=0)


# --- aggregation -------------------------------------------------------------


def test_token_mean_and_seq_mean():
    values = t([[1, 2, 3], [4, 0, 0], [9, 9, 9]])
    mask = t([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # third row: no valid token, must not count
    # token_mean: (1+2+3+4)/4 = 2.5
    close(aggregate(values, mask, "token_mean"), 2.5)
    # seq_mean: row means 6/3 = 2 and 4/1 = 4 -> (2+4)/2 = 3
    close(aggregate(values, mask, "seq_mean"), 3.0)
    with pytest.raises(ValueError, match="loss_agg"):
        aggregate(values, mask, "sum")


# --- advantages --------------------------------------------------------------


def test_grpo_group_normalised():
    rewards = t([1, 0, 0, 1, 2, 2, 2, 2])
    mask = torch.ones(8, 2)
    mask[1, 1] = 0
    adv = compute_advantages("grpo", rewards, 4, mask, eps=0.0)
    # group 1: mean 0.5, unbiased std sqrt(4*0.25/3) = 0.577350 -> +-0.5/0.577350 = +-0.866025
    # group 2: all equal -> 0 / (0 + eps)... with eps=0 that is 0/0, so check eps>0 below
    a = 0.866025
    close(adv[:4], [[a, a], [-a, 0], [-a, -a], [a, a]])
    adv = compute_advantages("grpo", rewards, 4, mask, eps=1e-6)
    close(adv[4:], torch.zeros(4, 2))
    # scale_by_std=False (Dr. GRPO): r - mean = +-0.5
    adv = compute_advantages("grpo", rewards, 4, mask, scale_by_std=False)
    close(adv[:4, 0], [0.5, -0.5, -0.5, 0.5])
    # DAPO uses the same estimator
    close(
        compute_advantages("dapo", rewards, 4, mask, eps=1e-6), compute_advantages("grpo", rewards, 4, mask, eps=1e-6)
    )


def test_rloo_leave_one_out():
    mask = torch.ones(4, 1)
    adv = compute_advantages("rloo", t([1, 0, 0, 1]), 4, mask)
    # i=0: baseline (0+0+1)/3 = 1/3 -> 2/3;  i=1: baseline (1+0+1)/3 = 2/3 -> -2/3
    close(adv[:, 0], [2 / 3, -2 / 3, -2 / 3, 2 / 3])
    with pytest.raises(ValueError, match="group_size"):
        compute_advantages("rloo", t([1, 0]), 1, torch.ones(2, 1))


def test_rloo_sequence_kl_in_reward():
    mask = torch.ones(2, 2)
    logprobs = t([[-1, -1], [-1, -1]])
    ref = t([[-1.5, -1.2], [-1, -1]])
    # k1 per token: [0.5, 0.2] and [0, 0]; sums 0.7 and 0 -> rewards 1 - 0.1*0.7 = 0.93 and 0
    # leave-one-out with G=2: 0.93 - 0 = 0.93 and 0 - 0.93 = -0.93
    adv = compute_advantages(
        "rloo", t([1, 0]), 2, mask, logprobs=logprobs, ref_logprobs=ref, kl_coef=0.1, kl_estimator="k1"
    )
    close(adv, [[0.93, 0.93], [-0.93, -0.93]])


def test_reinforce_pp_global_normalisation():
    mask = t([[1, 1, 1], [1, 1, 0]])
    adv = compute_advantages("reinforce_pp", t([1, 0]), 1, mask, gamma=1.0, eps=0.0)
    # returns (gamma 1, reward on the last valid token): [1,1,1] and [0,0,-]
    # over the 5 valid tokens: mean 0.6, unbiased var (3*0.16 + 2*0.36)/4 = 0.3, std 0.547723
    # -> 0.4/0.547723 = 0.730297 and -0.6/0.547723 = -1.095445
    close(adv, [[0.730297, 0.730297, 0.730297], [-1.095445, -1.095445, 0.0]])


def test_discounted_returns_with_token_kl_and_env_tokens():
    # gamma 0.5, reward 1 on the last token: [0.25, 0.5, 1]
    close(discounted_returns(t([[0, 0, 1]]), torch.ones(1, 3), 0.5), [[0.25, 0.5, 1.0]])
    # middle token is environment text (mask 0): skipped, so G0 = 0.5 * G2 = 0.5
    close(discounted_returns(t([[0, 0, 1]]), t([[1, 0, 1]]), 0.5), [[0.5, 0.0, 1.0]])
    # token-level KL in the reward: k1 = [0.5, 0, 0], kl_coef 0.1 -> rewards [-0.05, 0, 1]; gamma 1 -> [0.95, 1, 1]
    # whitening [0.95, 1, 1]: mean 0.983333, unbiased std sqrt((0.033333^2 + 2*0.016667^2)/2) = 0.028868
    adv = compute_advantages(
        "reinforce_pp",
        t([1]),
        1,
        torch.ones(1, 3),
        logprobs=t([[-1.0, -1, -1]]),
        ref_logprobs=t([[-1.5, -1, -1]]),
        kl_coef=0.1,
        kl_estimator="k1",
        eps=0.0,
    )
    close(adv, [[-1.154701, 0.577350, 0.577350]])


def test_gae_three_tokens():
    rewards = t([[0, 0, 1]])
    values = t([[0.5, 0.6, 0.7]])
    adv, ret = gae(rewards, values, torch.ones(1, 3), gamma=0.9, lam=0.8)
    # t=2: delta = 1 + 0.9*0 - 0.7 = 0.3                        A2 = 0.3
    # t=1: delta = 0 + 0.9*0.7 - 0.6 = 0.03  A1 = 0.03 + 0.72*0.3   = 0.246
    # t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04  A0 = 0.04 + 0.72*0.246 = 0.21712
    close(adv, [[0.21712, 0.246, 0.3]])
    close(ret, [[0.71712, 0.846, 1.0]])  # A + V
    # the middle token is environment text: t=0 bootstraps from V2: delta = 0.9*0.7 - 0.5 = 0.13, A0 = 0.13 + 0.72*0.3 = 0.346
    adv, _ = gae(rewards, values, t([[1, 0, 1]]), gamma=0.9, lam=0.8)
    close(adv, [[0.346, 0.0, 0.3]])


def test_ppo_advantages_and_value_targets_use_gae():
    mask = torch.ones(1, 3)
    values = t([[0.5, 0.6, 0.7]])
    p = dict(values=values, gamma=0.9, lam=0.8)
    close(compute_advantages("ppo", t([1.0]), 1, mask, normalize=False, **p), [[0.21712, 0.246, 0.3]])
    close(value_targets(t([1.0]), mask, **p), [[0.71712, 0.846, 1.0]])
    normalized = compute_advantages("ppo", t([1.0]), 1, mask, **p)
    close(normalized, whiten(t([[0.21712, 0.246, 0.3]]), mask))
    with pytest.raises(ValueError, match="values"):
        compute_advantages("ppo", t([1.0]), 1, mask)


def test_compute_advantages_rejects_unknown_names_and_params():
    with pytest.raises(ValueError, match="algorithm.name"):
        compute_advantages("a2c", t([1.0]), 1, torch.ones(1, 1))
    with pytest.raises(TypeError, match="lamda"):
        compute_advantages("grpo", t([1.0, 0.0]), 2, torch.ones(2, 1), lamda=0.9)
    with pytest.raises(ValueError, match="group_size"):
        compute_advantages("grpo", t([1.0, 0.0, 1.0]), 2, torch.ones(3, 1))


def test_registry_says_what_each_algorithm_needs():
    assert set(ALGORITHMS) == {"grpo", "dr_grpo", "ppo", "dapo", "rloo", "reinforce_pp"}
    assert [n for n, s in ALGORITHMS.items() if s.needs_critic] == ["ppo"]
    assert ALGORITHMS["grpo"].kl_in == "loss" and ALGORITHMS["reinforce_pp"].kl_in == "reward"
    assert ALGORITHMS["dapo"].dynamic_sampling and not ALGORITHMS["grpo"].dynamic_sampling
    assert {row.advantage for row in ALGORITHMS.values()} == set(ESTIMATORS)  # no estimator without a row


def test_dr_grpo_centres_on_the_group_mean_without_the_std():
    # group 1: rewards 3, 1, 1, 3 -> mean 2 -> +1, -1, -1, +1 (GRPO would divide by std 1.1547: +-0.866)
    # group 2: 0, 0, 0, 4 -> mean 1 -> -1, -1, -1, +3 (GRPO: std 2 -> -0.5, -0.5, -0.5, +1.5)
    rewards, mask = t([3, 1, 1, 3, 0, 0, 0, 4]), torch.ones(8, 3)
    mask[7, 2] = 0
    adv = compute_advantages("dr_grpo", rewards, 4, mask)
    close(adv[:, 0], [1, -1, -1, 1, -1, -1, -1, 3])
    assert adv[7, 2] == 0 and torch.equal(adv[:, 0], adv[:, 1])
    close(adv, compute_advantages("grpo", rewards, 4, mask, scale_by_std=False))
    close(compute_advantages("grpo", rewards, 4, mask, eps=0.0)[4:, 0], [-0.5, -0.5, -0.5, 1.5])
    with pytest.raises(ValueError, match="group_size >= 2"):
        compute_advantages("dr_grpo", t([1.0]), 1, torch.ones(1, 1))


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_row_is_a_config_value_and_listed_by_schema(name, capsys):
    # A row is all it takes: the config accepts its name (and checks group_size against the row), `schema` lists it.
    cfg = load_config(None, [f"algorithm.name={name}", "algorithm.group_size=2"])
    assert cfg.algorithm.name == name
    if ALGORITHMS[name].min_group_size > 1:
        with pytest.raises(ConfigError, match=f"at least {ALGORITHMS[name].min_group_size}"):
            load_config(None, [f"algorithm.name={name}", "algorithm.group_size=1"])
    assert cli_main(["schema", "algorithm"]) == 0
    listed = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"algorithm.name {name}:")]
    assert len(listed) == 1 and ALGORITHMS[name].summary in listed[0] and ALGORITHMS[name].advantage in listed[0]


# --- losses ------------------------------------------------------------------


def _ratios_to_logprobs(ratios):
    old = torch.full_like(ratios, -1.0)
    return old + torch.log(ratios), old


def test_policy_loss_clipped_surrogate_both_aggregations():
    ratios = t([[1.5, 0.5, 1.0], [0.5, 1.0, 1.0]])
    adv = t([[1, 1, -1], [-1, 0, 0]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    logprobs, old = _ratios_to_logprobs(ratios)
    # per token -min(rA, clip(r,0.8,1.2)A):
    #   r=1.5,A=1:  -min(1.5, 1.2) = -1.2  (clipped, upper bound)
    #   r=0.5,A=1:  -min(0.5, 0.8) = -0.5  (unclipped)
    #   r=1.0,A=-1: 1.0
    #   r=0.5,A=-1: -min(-0.5, -0.8) = 0.8 (clipped, lower bound)
    loss, stats = policy_loss(logprobs, old, adv, mask, clip_eps=0.2, agg="token_mean")
    close(loss, (-1.2 - 0.5 + 1.0 + 0.8) / 4)  # 0.025
    loss, _ = policy_loss(logprobs, old, adv, mask, clip_eps=0.2, agg="seq_mean")
    close(loss, ((-1.2 - 0.5 + 1.0) / 3 + 0.8) / 2)  # 0.283333
    assert stats["clip_frac"] == pytest.approx(0.5)
    assert stats["clip_frac_high"] == pytest.approx(0.25)
    assert stats["clip_frac_low"] == pytest.approx(0.25)
    # approx_kl = mean(old - new) = -(ln1.5 + ln0.5 + 0 + ln0.5)/4 = 0.245207
    assert stats["approx_kl"] == pytest.approx(0.245207, abs=1e-5)
    assert stats["ratio_max"] == pytest.approx(1.5, abs=1e-5)


def test_clip_higher_is_asymmetric():
    ratios = t([[1.25, 0.5]])
    adv = t([[1, -1]])
    mask = torch.ones(1, 2)
    # symmetric eps 0.2: -min(1.25, 1.2) = -1.2 (clipped, no gradient) and 0.8 -> mean -0.2
    lp, old = _ratios_to_logprobs(ratios)
    lp.requires_grad_(True)
    loss, stats = policy_loss(lp, old, adv, mask, clip_eps=0.2)
    close(loss, -0.2)
    assert stats["clip_frac"] == pytest.approx(1.0)
    loss.backward()
    close(lp.grad, [[0.0, 0.0]])
    # clip-higher 0.28: the upper bound moves to 1.28, so r=1.25 is unclipped: -1.25; the lower side is unchanged
    lp2, _ = _ratios_to_logprobs(ratios)
    lp2.requires_grad_(True)
    loss, stats = policy_loss(lp2, old, adv, mask, clip_eps=0.2, clip_eps_high=0.28)
    close(loss, (-1.25 + 0.8) / 2)
    assert stats["clip_frac"] == pytest.approx(0.5) and stats["clip_frac_high"] == 0.0
    loss.backward()
    # d/dlogp of -A*r/2 with r = exp(logp - old): -r/2 = -0.625 for the first token
    close(lp2.grad, [[-0.625, 0.0]])


def test_value_loss_clipping():
    values, old, returns = t([[1.0, 0.0, 0.6]]), t([[0.5, 0.5, 0.5]]), t([[2.0, 0.0, 0.0]])
    # token0: V_clip = 0.5 + 0.2 = 0.7; max((1-2)^2, (0.7-2)^2) = max(1, 1.69) = 1.69  (clipped)
    # token1: V_clip = 0.5 - 0.2 = 0.3; max(0, 0.09) = 0.09                          (clipped)
    # token2: within the clip range: 0.36 both ways
    loss, stats = value_loss(values, old, returns, torch.ones(1, 3), clip_eps_value=0.2)
    close(loss, 0.5 * (1.69 + 0.09 + 0.36) / 3)  # 0.356667
    assert stats["vf_clip_frac"] == pytest.approx(2 / 3)


def test_kl_estimators():
    lp, ref = t([-1.0, -2.0]), t([-2.0, -1.0])  # log ratios +1 and -1
    close(kl_penalty(lp, ref, "k1"), [1.0, -1.0])
    close(kl_penalty(lp, ref, "k2"), [0.5, 0.5])
    # k3 = exp(-x) + x - 1: x=1 -> e^-1 = 0.367879; x=-1 -> e - 2 = 0.718282
    close(kl_penalty(lp, ref, "k3"), [math.exp(-1), math.e - 2])
    close(kl_penalty(t([-21.0]), t([-1.0]), "k3"), [10.0])  # clamped
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalty(lp, ref, "k4")


def test_entropy_from_logits():
    # uniform over 2: ln 2;  probs [0.25, 0.75]: -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.562335
    close(entropy_from_logits(t([[0.0, 0.0], [0.0, math.log(3)]])), [math.log(2), 0.562335])


# --- DAPO batch pieces -------------------------------------------------------


def test_dynamic_sampling_drops_all_equal_groups():
    ds = dynamic_sampling_filter(t([1, 1, 1, 0, 1, 0, 0, 0, 0]), 3)
    assert ds.keep.tolist() == [False] * 3 + [True] * 3 + [False] * 3
    assert (ds.kept_groups, ds.dropped_groups) == (1, 2)
    assert groups_to_refill(target_groups=3, kept_groups=ds.kept_groups) == 2
    assert groups_to_refill(target_groups=1, kept_groups=2) == 0


def test_overlong_penalty_ramp():
    # max 8, buffer 4: no penalty up to 4 tokens, then -(L-4)/4, and -1 beyond 8
    close(overlong_penalty([3, 4, 5, 6, 8, 9], max_new_tokens=8, overlong_buffer=4), [0, 0, -0.25, -0.5, -1, -1])
    close(overlong_penalty([7], 8, 4, penalty=0.5), [-0.375])  # -0.5 * 3/4
    close(overlong_penalty([8], 8, 0), [0.0])  # buffer 0 = off
    with pytest.raises(ValueError, match="overlong_buffer"):
        overlong_penalty([1], 4, 5)
