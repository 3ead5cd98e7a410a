"""The scale model (rollout_hpc.scale): the simulation against closed forms it must reproduce, the planner's
candidates and recommendation, the 1,000-node plan's speed, profile files, and `plan` on the command line."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollout_hpc.config import load_config
from rollout_hpc.scale.plan import candidate_layouts, plan, recommended, run_shape
from rollout_hpc.scale.profile import Costs, Machine, Profile, ProfileError, Workload, bcast_stages, fit_linear
from rollout_hpc.scale.roofline import roofline_profile
from rollout_hpc.scale.simulate import Layout, simulate

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_7B = REPO / "configs" / "examples" / "grpo-7b-vllm-deepspeed.yaml"


def make_profile(lengths=(10,), **costs) -> Profile:
    base = dict(
        gen_fixed_s=0.0,
        gen_row_s=0.0,
        gen_token_s=0.01,
        gen_token_row_s=0.0,
        train_fixed_s=0.0,
        train_token_s=0.0,
        reward_s_per_sample=0.0,
        log_s_per_sample=0.0,
        mpi_alpha_s=0.0,
        mpi_gb_per_s=1e9,
        bcast_alpha_s=0.0,
        bcast_gb_per_s=1e9,
        ring_gb_per_s=1e9,
        fs_write_gb_per_s=1.0,
        fs_read_gb_per_s=1.0,
        startup_s=0.0,
    )
    base.update(costs)
    workload = Workload(
        response_lengths=list(lengths),
        prompt_len_mean=10.0,
        max_new_tokens=max(lengths),
        record_bytes_per_token=8.0,
        record_fixed_bytes=64.0,
        weight_bytes=1 << 20,
        checkpoint_bytes=1 << 30,
        weight_chunk_bytes=1 << 20,
    )
    machine = Machine("test", 8, 0, 1, 1, shared_host=False, nodes_measured=2, ranks_measured=2)
    return Profile(Costs(**base), workload, machine)


def cfg_for(tmp_path: Path, *overrides: str):
    return load_config(
        None,
        [
            "algorithm.prompts_per_step=16",
            "algorithm.group_size=4",
            "algorithm.steps=50",
            "checkpoint.every_steps=0",
            "slurm.time=10-00:00:00",
            *overrides,
        ],
    )


def lay(g=1, t=1, k=0, placement="disaggregated", tpn=1):
    return Layout(placement, g, t, k, tpn, tpn)


def shape(cfg, **kw):
    return dataclasses.replace(run_shape(cfg), node_mtbf_h=1e12, **kw)


def test_on_policy_step_is_the_sum_of_its_parts(tmp_path):
    # Fixed lengths: generation 10 tokens x 10 ms; training 64 samples x 20 tokens x 1 ms; no overlap on-policy.
    p = make_profile(lengths=(10,), gen_token_s=0.01, train_token_s=0.001, reward_s_per_sample=0.001)
    cfg = cfg_for(tmp_path)
    pred = simulate(p, lay(), shape(cfg))
    gen, reward, train = 10 * 0.01, 64 * 0.001, 64 * 20 * 0.001
    assert pred.step_s == pytest.approx(gen + reward + train + pred.sync_s, rel=1e-3)
    assert pred.samples_per_s == pytest.approx(64 / pred.step_s)
    assert pred.staleness == 0


def test_staleness_overlaps_generation_with_training(tmp_path):
    # Generation 0.1 s and training 0.1 s a step: on-policy 0.2 s, one step of staleness ~0.1 s (the slower one).
    p = make_profile(lengths=(10,), gen_token_s=0.01, train_token_s=0.1 / (64 * 20))
    cfg = cfg_for(tmp_path)
    on = simulate(p, lay(k=0), shape(cfg))
    off = simulate(p, lay(k=1), shape(cfg))
    assert on.step_s == pytest.approx(0.2, rel=0.01)
    assert off.step_s == pytest.approx(0.1, rel=0.05)
    assert 0.5 < off.staleness <= 1.0
    assert off.gen_idle < on.gen_idle


def test_the_step_waits_for_its_longest_response(tmp_path):
    # Half the responses 2 tokens, half 100: with 64 samples a step one of them is long almost surely.
    p = make_profile(lengths=[2] * 50 + [100] * 50, gen_token_s=0.01)
    cfg = cfg_for(tmp_path)
    pred = simulate(p, lay(), shape(cfg))
    assert pred.gen_s == pytest.approx(1.0, rel=0.01)  # 100 tokens x 10 ms, not the mean's 51
    few = load_config(
        None,
        ["algorithm.prompts_per_step=1", "algorithm.group_size=2", "checkpoint.every_steps=0", "algorithm.steps=400"],
    )
    two = simulate(p, lay(), shape(few))
    assert 0.65 < two.gen_s < 0.85  # two samples a step: one of them long with probability 3/4 (0.755 s)


def test_more_generator_ranks_share_the_rows(tmp_path):
    p = make_profile(lengths=(10,), gen_token_s=0.0, gen_token_row_s=0.001)
    cfg = cfg_for(tmp_path)
    one, four = simulate(p, lay(g=1), shape(cfg)), simulate(p, lay(g=4), shape(cfg))
    assert four.gen_s == pytest.approx(one.gen_s / 4, rel=1e-6)


def test_broadcast_grows_with_log_of_the_ranks(tmp_path):
    p = make_profile(bcast_gb_per_s=1.0)  # 1 MiB weights, one chunk
    cfg = cfg_for(tmp_path)
    times = {g: simulate(p, lay(g=g), shape(cfg)).sync_s for g in (1, 3, 7, 15)}
    one_stage = (1 << 20) / 1e9
    assert [times[g] / one_stage for g in (1, 3, 7, 15)] == pytest.approx([1, 2, 3, 4])
    assert bcast_stages(1000) == 10


def test_checkpoint_writers_share_the_file_system(tmp_path):
    p = make_profile(fs_write_gb_per_s=2.0)
    p.costs.fs_aggregate_gb_per_s = 10.0
    cfg = cfg_for(tmp_path, "trainer.backend=deepspeed", "checkpoint.every_steps=10")
    one = simulate(p, lay(t=1), shape(cfg))
    many = simulate(p, lay(t=20), shape(cfg))
    assert one.checkpoint_s == pytest.approx((1 << 30) / 2e9)  # one writer at its own speed
    assert many.checkpoint_s == pytest.approx((1 << 30) / 10e9)  # 20 writers share 10 GB/s
    torch_cfg = cfg_for(tmp_path, "checkpoint.every_steps=10")
    assert simulate(p, lay(t=20), shape(torch_cfg)).checkpoint_s == pytest.approx(one.checkpoint_s)  # rank 0 writes


def test_interruptions_cost_more_on_more_nodes(tmp_path):
    p = make_profile(lengths=(10,), gen_token_s=0.01, startup_s=60)
    cfg = cfg_for(tmp_path, "algorithm.steps=1000", "checkpoint.every_steps=100")
    few = simulate(p, lay(g=1, t=1), dataclasses.replace(run_shape(cfg), node_mtbf_h=1.0))
    many = simulate(p, lay(g=50, t=50), dataclasses.replace(run_shape(cfg), node_mtbf_h=1.0))
    assert many.interruptions > few.interruptions * 10
    assert many.effective_samples_per_s < many.samples_per_s
    limited = simulate(
        p,
        lay(),
        dataclasses.replace(
            run_shape(cfg_for(tmp_path, "slurm.time=00:00:30", "slurm.signal_lead_seconds=10", "algorithm.steps=1000")),
            node_mtbf_h=1e12,
        ),
    )
    assert limited.interruptions >= 1  # the run is longer than one allocation: it is requeued


def test_candidates_cover_every_split_and_colocated(tmp_path):
    cfg = cfg_for(tmp_path)
    layouts = candidate_layouts(cfg, 4, max_staleness=1)
    disagg = {(x.generator_nodes, x.trainer_nodes, x.max_staleness) for x in layouts if x.placement == "disaggregated"}
    assert disagg == {(g, 4 - g, k) for g in (1, 2, 3) for k in (0, 1)}
    assert any(x.placement == "colocated" and x.generator_nodes == x.trainer_nodes == 4 for x in layouts)
    big = candidate_layouts(cfg, 1000, max_staleness=0)
    splits = [x.generator_nodes for x in big if x.placement == "disaggregated"]
    assert 1 in splits and 999 in splits and 500 in splits and len(splits) < 120


def test_plan_recommends_the_fastest_and_says_how_to_apply_it(tmp_path):
    # Generation is 3x the training: the best split gives the generators more nodes.
    p = make_profile(lengths=(10,), gen_token_s=0.0, gen_token_row_s=0.003, train_token_s=0.001 / 20)
    cfg = cfg_for(tmp_path)
    predictions = plan(p, cfg, 8, max_staleness=1)
    assert all(
        a.effective_samples_per_s >= b.effective_samples_per_s - 1e-6 for a, b in zip(predictions, predictions[1:])
    )
    best = recommended(predictions)
    split = next(x.layout for x in predictions if x.layout.placement == "disaggregated")
    assert split.generator_nodes > split.trainer_nodes
    assert f"generator.nodes={best['generator_nodes']}" in best["overrides"]
    assert best["samples_per_s"] == pytest.approx(predictions[0].samples_per_s)


def test_a_thousand_node_plan_takes_seconds():
    cfg = load_config(EXAMPLE_7B, ["algorithm.steps=1000", "algorithm.prompts_per_step=4096"])
    profile = roofline_profile(cfg, params=7.6e9)
    t0 = time.perf_counter()
    predictions = plan(profile, cfg, 1000, max_staleness=2)
    elapsed = time.perf_counter() - t0
    assert elapsed < 60, elapsed
    assert len(predictions) > 100
    assert all(math.isfinite(p.step_s) and p.step_s > 0 for p in predictions)


def test_fit_linear_never_returns_a_negative_cost():
    coef = fit_linear([[1], [2], [3], [4]], [1.0, 0.9, 1.1, 1.0])  # flat: slope ~0, never negative
    assert coef[0] == pytest.approx(1.0, abs=0.1) and coef[1] >= 0
    exact = fit_linear([[1, 2], [2, 1], [3, 5], [4, 0]], [1 + 2 * 1 + 3 * 2, 1 + 2 * 2 + 3, 1 + 6 + 15, 1 + 8])
    assert exact == pytest.approx([1, 2, 3])


def test_profile_files_round_trip_and_bad_ones_are_named(tmp_path):
    p = make_profile(lengths=(3, 4))
    path = tmp_path / "p.json"
    p.save(path)
    assert Profile.load(path) == p
    with pytest.raises(ProfileError, match="no such profile.*rollout-hpc profile"):
        Profile.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ProfileError, match="bad.json is not a profile"):
        Profile.load(tmp_path / "bad.json")
    raw = json.loads(path.read_text())
    raw["version"] = 99
    (tmp_path / "old.json").write_text(json.dumps(raw))
    with pytest.raises(ProfileError, match="version 99"):
        Profile.load(tmp_path / "old.json")
    del raw["costs"]["train_token_s"]
    raw["version"] = 1
    (tmp_path / "cut.json").write_text(json.dumps(raw))
    with pytest.raises(ProfileError, match="train_token_s"):
        Profile.load(tmp_path / "cut.json")


def rollout(*args, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rollout_hpc", *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_plan_json_for_the_7b_example_on_1000_nodes():
    done = rollout(
        "plan", EXAMPLE_7B, "--nodes", "1000", "--params", "7.6e9", "--json", "--set", "algorithm.prompts_per_step=4096"
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    rec = out["recommended"]
    assert {"generator_nodes", "trainer_nodes", "placement", "max_staleness", "step_s", "samples_per_s"} <= set(rec)
    assert rec["generator_nodes"] + rec["trainer_nodes"] == 1000 or rec["placement"] == "colocated"
    assert out["layouts"][0]["step_s"] == pytest.approx(rec["step_s"])


def test_plan_table_and_errors(tmp_path):
    done = rollout("plan", EXAMPLE_7B, "--nodes", "8", "--params", "7.6e9")
    assert done.returncode == 0, done.stderr
    assert "recommended:" in done.stdout and "--set generator.nodes=" in done.stdout
    no_size = rollout("plan", EXAMPLE_7B, "--nodes", "8")
    assert no_size.returncode == 2 and "--params" in no_size.stderr  # /models/... is not here to count
    missing = rollout("plan", EXAMPLE_7B, "--nodes", "8", "--profile", tmp_path / "none.json")
    assert missing.returncode == 2 and "rollout-hpc profile" in missing.stderr
    no_run = rollout("plan", "--check", tmp_path, "--profile", tmp_path / "none.json")
    assert no_run.returncode == 2 and "not a run directory" in no_run.stderr
