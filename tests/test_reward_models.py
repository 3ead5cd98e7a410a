"""Reward models (rewards.models, nodes: 0): a tiny sequence classifier and a tiny LLM judge made here and saved with
save_pretrained, scored for real; how rule and model rewards combine; the running normalization and its checkpoint
state; the record's reward parts through the ring layout and the HDF5 log; config errors. The run itself (local
launcher, interrupted and resumed): test_reward_models_run.py."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_hf import make_tiny_judge, make_tiny_qwen, make_tiny_reward_classifier

from rollout_hpc.config import ConfigError, RewardModelSpec, load_config
from rollout_hpc.envs.registry import check_task
from rollout_hpc.errors import UserError
from rollout_hpc.rewards.mixing import RewardMix, RunningNorm
from rollout_hpc.rewards.reward_models import (
    RewardModelError,
    check_reward_model,
    fill_template,
    load_reward_model,
    parse_score,
)
from rollout_hpc.store.checkpoint import load_latest_valid, save_checkpoint
from rollout_hpc.store.trajlog import TrajectoryLog, TrajectoryReader
from rollout_hpc.trajectory import TrajectoryBatch


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward_models")
    return {
        "classifier": make_tiny_reward_classifier(root / "classifier"),
        "two_labels": make_tiny_reward_classifier(root / "two_labels", num_labels=2, seed=1),
        "judge": make_tiny_judge(root / "judge", says="7"),
        "plain_judge": make_tiny_judge(root / "plain_judge", says="3", chat_template=False),
        "policy": make_tiny_qwen(root / "policy"),
    }


def spec(name, path, kind, **kw) -> RewardModelSpec:
    return RewardModelSpec(name=name, path=str(path), kind=kind, **kw)


# --- the models -----------------------------------------------------------------------------------------------------


def test_classifier_scores_depend_on_the_response_not_on_the_batching(models):
    rm = load_reward_model(spec("c", models["classifier"], "classifier", batch_size=2))
    responses = ["4", "5", "four", "the answer is 4", "no idea"]
    together = rm.score(["What is 2+2?"] * 5, responses, [None] * 5)
    assert together.dtype == np.float64 and np.isfinite(together).all()
    assert len(set(np.round(together, 6))) == 5  # a random head still tells these apart
    alone = np.array([rm.score(["What is 2+2?"], [r], [None])[0] for r in responses])
    np.testing.assert_allclose(alone, together, atol=1e-5)  # padding in a batch does not change a score


def test_classifier_reads_the_chat_and_cuts_the_start_of_long_inputs(models):
    rm = load_reward_model(spec("c", models["classifier"], "classifier", max_length=40))
    text = rm.conversation([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], "hello")
    assert "<|im_start|>system" in text and "<|im_start|>assistant\nhello<|im_end|>" in text
    enc = rm._encode([rm.conversation("q" * 500, "the end")])
    assert enc["input_ids"].shape[1] == 40
    assert rm.tokenizer.decode(enc["input_ids"][0]).endswith("the end<|im_end|>\n")  # the response's end is kept


def test_a_two_label_classifier_scores_the_probability_of_a_label(models):
    last = load_reward_model(spec("c", models["two_labels"], "classifier"))
    first = load_reward_model(spec("c", models["two_labels"], "classifier", positive_label=0))
    p1 = last.score(["q", "q"], ["a", "b"], [None, None])
    p0 = first.score(["q", "q"], ["a", "b"], [None, None])
    assert ((p1 > 0) & (p1 < 1)).all()
    np.testing.assert_allclose(p0 + p1, 1.0, atol=1e-6)
    with pytest.raises(RewardModelError, match="positive_label 5"):
        load_reward_model(spec("c", models["two_labels"], "classifier", positive_label=5))


def test_a_judge_reply_is_parsed_into_a_score(models):
    judge = load_reward_model(spec("j", models["judge"], "judge", pattern=r"(\d)", max_new_tokens=3))
    assert judge.score(["q1", "q2"], ["r1", "r2"], ["a", None]).tolist() == [7.0, 7.0]
    assert judge.last_replies == ["777", "777"]
    plain = load_reward_model(spec("j", models["plain_judge"], "judge", pattern=r"(\d+)", max_new_tokens=2))
    assert plain.prompt("q", "r", "a").startswith("Rate how well")  # no chat template: the text as it is
    assert plain.score(["q"], ["r"], ["a"]).tolist() == [33.0]


def test_a_judge_reply_that_does_not_parse_scores_nan(models):
    judge = load_reward_model(spec("j", models["judge"], "judge", max_new_tokens=4))  # default: \boxed{N}
    scores = judge.score(["q"], ["r"], ["a"])
    assert math.isnan(scores[0]) and judge.last_replies == ["7777"]


def test_the_judge_prompt_fills_the_fields_and_keeps_other_braces(models):
    judge = load_reward_model(
        spec("j", models["judge"], "judge", template="Q={question} R={response} A={answer}: answer \\boxed{N}")
    )
    text = judge.prompt("what?", "this {response}", 42)
    assert "Q=what? R=this {response} A=42: answer \\boxed{N}" in text  # a response is never re-filled
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    assert fill_template("{{literal}} {question}", "x", "y", "z") == "{literal} x"


@pytest.mark.parametrize(
    ("reply", "score"),
    [
        ("The rating is \\boxed{8}.", 8.0),
        ("\\boxed{ -2.5 }", -2.5),
        ("\\boxed{8} then \\boxed{3}", 8.0),
        ("eight", math.nan),
        ("\\boxed{}", math.nan),
    ],
)
def test_parse_score(reply, score):
    pattern = re.compile(RewardModelSpec.model_fields["pattern"].default)
    got = parse_score(pattern, reply)
    assert (math.isnan(got) and math.isnan(score)) or got == score
    assert math.isnan(parse_score(re.compile(r"(\w+)"), "inf"))  # a number, but not a finite one


def test_check_refuses_a_directory_of_the_wrong_kind(models, tmp_path):
    check_reward_model(spec("c", models["classifier"], "classifier"))
    check_reward_model(spec("j", models["judge"], "judge"))
    with pytest.raises(RewardModelError, match="rewards.models rm .*kind 'classifier' needs a sequence-classification"):
        check_reward_model(spec("rm", models["policy"], "classifier"))
    with pytest.raises(RewardModelError, match="kind 'judge' needs a causal LM"):
        check_reward_model(spec("rm", models["classifier"], "judge"))
    with pytest.raises(RewardModelError, match="is not a directory"):
        check_reward_model(spec("rm", tmp_path / "missing", "judge"))
    with pytest.raises(RewardModelError, match="no config.json"):
        check_reward_model(spec("rm", tmp_path, "judge"))


# --- config -----------------------------------------------------------------------------------------------------------


def rm_overrides(path, **kw) -> list[str]:
    fields = {"name": "rm", "path": str(path), "kind": "classifier", **kw}
    body = ", ".join(f"{k}: {v}" for k, v in fields.items())
    return [f"rewards.models=[{{{body}}}]"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"backend": "vllm"}, "backend 'vllm' serves judges"),
        (
            {"backend": "vllm", "kind": "judge"},
            "put it on the reward group (nodes: 1 or more) with rewards.group.gpus_per_task >= 1",
        ),
        ({"backend": "vllm", "kind": "judge", "nodes": 1}, "rewards.group.gpus_per_task >= 1, or use backend: hf"),
        ({"domains": "[math]"}, "domains names 'math', which is not a source"),
        ({"template": "'{question}'"}, "template is for kind 'judge'"),
        ({"kind": "judge", "pattern": "'no group'"}, "has no group"),
        ({"kind": "judge", "pattern": "'(unclosed'"}, "is not a regular expression"),
        ({"name": "'a b'"}, "reward model name 'a b'"),
    ],
)
def test_config_refuses_what_cannot_run(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, rm_overrides(tmp_path, **extra))


@pytest.mark.gpu  # skipped only where vLLM and a GPU are present
def test_a_vllm_judge_says_what_it_needs(models):
    import torch

    from rollout_hpc.errors import VLLMUnavailable

    try:
        import vllm  # noqa: F401

        if torch.cuda.is_available():
            pytest.skip("vLLM and a GPU are present")
    except ImportError:
        pass
    judge = spec("judge", models["judge"], "judge", backend="vllm", nodes=1)
    with pytest.raises(
        VLLMUnavailable, match=r"rewards.models judge: backend 'vllm' needs vLLM and a GPU.*use backend hf"
    ):
        load_reward_model(judge)
    assert load_config(
        None, [*rm_overrides(models["judge"], kind="judge", backend="vllm", nodes=1), "rewards.group.gpus_per_task=1"]
    )


def test_a_reward_group_is_a_third_het_component_after_the_trainers(tmp_path):
    from rollout_hpc.commands.prepare import allocation_layout, extra_components
    from rollout_hpc.launch.local import mpirun_command
    from rollout_hpc.launch.render import render_script

    two = (
        f"rewards.models=[{{name: a, path: {tmp_path}, kind: classifier, nodes: 2, tasks_per_node: 3}}, "
        f"{{name: b, path: {tmp_path}, kind: judge}}, {{name: c, path: {tmp_path}, kind: judge, nodes: 2, tasks_per_node: 3}}]"
    )
    cfg = load_config(None, [two, "rewards.group.gpus_per_task=1", "rewards.group.partition=rm", "trainer.nodes=2"])
    group = cfg.reward_group
    assert (group.nodes, group.tasks_per_node, group.gpus_per_task) == (2, 3, 1)
    assert cfg.world_size == cfg.generator.ranks + cfg.trainer.ranks + 6
    script = render_script(cfg, tmp_path / "run")
    assert script.count("#SBATCH hetjob") == 2 and "# het component 2: reward nodes" in script
    reward_lines = script.split("# het component 2: reward nodes")[1]
    assert "#SBATCH --nodes=2" in reward_lines and "#SBATCH --ntasks-per-node=3" in reward_lines
    assert "#SBATCH --partition=rm" in reward_lines and "#SBATCH --gpus-per-task=1" in reward_lines
    # one step over every component Slurm reports (SLURM_HET_SIZE 3 here)
    assert 'het_args=(--het-group="0-$((SLURM_HET_SIZE - 1))")' in script and 'srun "${het_args[@]}"' in script
    nodes = [w.split("=", 1)[1] for w in mpirun_command(cfg, tmp_path / "run") if w.startswith("ROLLOUT_NODE=")]
    assert nodes == ["gen0", "train0", "train1", "rm0", "rm1"]
    # plain sbatch: the allocation's third component sizes every model of the group
    env = {"SLURM_HET_SIZE": "3"} | {
        f"SLURM_{k}_HET_GROUP_{i}": v
        for i, (n, t) in enumerate([("1", "1"), ("2", "1"), ("4", "2(x4)")])
        for k, v in (("JOB_NUM_NODES", n), ("TASKS_PER_NODE", t))
    }
    layout = allocation_layout(env, extra=extra_components(cfg))
    assert layout[-4:] == [
        "rewards.models[0].nodes=4",
        "rewards.models[0].tasks_per_node=2",
        "rewards.models[2].nodes=4",
        "rewards.models[2].tasks_per_node=2",
    ]
    with pytest.raises(UserError, match="3 components"):
        allocation_layout(dict(env, SLURM_HET_SIZE="2"), extra=extra_components(cfg))
    with pytest.raises(UserError, match="a component after the trainers needs rewards.models with nodes > 0"):
        allocation_layout(env)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rewards.models[1].nodes=2"], "give them the same nodes and tasks_per_node"),
        (["algorithm.dynamic_sampling=true"], "set its nodes: 0, or turn dynamic_sampling off"),
        (["placement=colocated"], "or use placement: disaggregated"),
    ],
)
def test_config_refuses_a_reward_group_it_cannot_run(tmp_path, overrides, message):
    two = f"rewards.models=[{{name: a, path: {tmp_path}, kind: judge, nodes: 1}}, {{name: b, path: {tmp_path}, kind: judge, nodes: 1}}]"
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [two, *overrides])


def test_config_refuses_duplicate_names_and_no_reward_at_all(tmp_path):
    two = f"rewards.models=[{{name: a, path: {tmp_path}, kind: judge}}, {{name: a, path: {tmp_path}, kind: judge}}]"
    with pytest.raises(ConfigError, match="names must be unique"):
        load_config(None, [two])
    with pytest.raises(ConfigError, match="nothing would score a sample"):
        load_config(None, ["rewards.rule_weight=0"])


def test_validate_checks_the_model_directories(models, tmp_path):
    cfg = load_config(None, rm_overrides(models["classifier"]))
    check_task(cfg)
    bad = load_config(None, rm_overrides(models["judge"]))
    with pytest.raises(RewardModelError, match="kind 'classifier'"):
        check_task(bad)
    agentic = load_config(None, ["task.name=frozenlake", *rm_overrides(models["classifier"])])
    with pytest.raises(ConfigError, match="rewards.models score single-turn samples"):
        check_task(agentic)


# --- how rewards combine ------------------------------------------------------------------------------------------------


def mix_config(tmp_path, rule_weight=1.0, **models):
    entries = [
        f"{{name: {name}, path: {tmp_path}, kind: judge, {', '.join(f'{k}: {v}' for k, v in kw.items())}}}"
        for name, kw in models.items()
    ]
    return load_config(None, [f"rewards.rule_weight={rule_weight}", f"rewards.models=[{', '.join(entries)}]"]).rewards


def test_raw_reward_is_the_weighted_sum_with_parse_failures_filled(tmp_path):
    cfg = mix_config(tmp_path, 0.5, a={"weight": 2.0}, b={"weight": -1.0, "parse_failure_score": 3.0})
    mix = RewardMix(cfg, [])
    rule = np.array([1.0, 0.0])
    scores = np.array([[0.25, 1.0], [0.5, math.nan]])
    got = mix.raw_reward(rule, scores, np.zeros(2, np.uint8))
    np.testing.assert_allclose(got, [0.5 + 0.5 - 1.0, 0.0 + 1.0 - 3.0])
    m = mix.step_metrics(np.column_stack([rule, scores]), np.zeros(2, np.uint8))
    assert m["rm/b/parse_failures"] == 1 and m["rm/b/mean"] == 1.0 and m["rm/a/scored"] == 2


def test_a_model_scores_only_its_sources(tmp_path):
    cfg = SimpleNamespace(rule_weight=1.0, models=[spec("a", tmp_path, "judge", domains=["code"])])
    mix = RewardMix(cfg, ["math", "code"])  # (the config checks the names against task.params.train's sources)
    domain = np.array([0, 1, 1], np.uint8)
    assert mix.applies(domain)[:, 0].tolist() == [False, True, True]
    got = mix.raw_reward(np.array([1.0, 1.0, 0.0]), np.array([[9.0], [2.0], [3.0]]), domain)
    np.testing.assert_allclose(got, [1.0, 3.0, 3.0])  # the math sample's score (9) is not its reward
    m = mix.step_metrics(np.array([[1, 9.0], [1, 2.0], [0, 3.0]]), domain)
    assert m["rm/a/scored"] == 2 and m["rm/a/mean"] == 2.5


def test_trainer_reward_normalizes_by_the_running_statistics(tmp_path):
    cfg = mix_config(tmp_path, a={}, b={"normalize": "false"})
    mix, norm = RewardMix(cfg, []), RunningNorm(["a", "b"])
    step1 = np.array([[1.0, 2.0, 5.0], [0.0, 4.0, math.nan]])
    got = mix.reward(step1, np.zeros(2, np.uint8), norm)
    z = (np.array([2.0, 4.0]) - 3.0) / np.std([2.0, 4.0], ddof=1)
    np.testing.assert_allclose(got, [1.0 + z[0] + 5.0, 0.0 + z[1] + 0.0], rtol=1e-6)
    assert norm.count.tolist() == [2.0, 1.0]  # b's parse failure is not in its statistics


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.floats(-100, 100), min_size=1, max_size=20), min_size=1, max_size=6))
def test_running_statistics_equal_those_of_every_score_at_once(steps):
    norm = RunningNorm(["m"])
    for xs in steps:
        x = np.array(xs)[:, None]
        norm.update(x, np.ones_like(x, bool))
    every = np.concatenate([np.array(xs) for xs in steps])
    assert norm.count[0] == len(every)
    np.testing.assert_allclose(norm.mean[0], every.mean(), atol=1e-9, rtol=1e-9)
    if len(every) > 1:
        np.testing.assert_allclose(norm.std()[0], max(every.std(ddof=1), RunningNorm.EPS), rtol=1e-7, atol=1e-9)


def test_running_statistics_survive_a_checkpoint_by_name(tmp_path):
    norm = RunningNorm(["a", "b"])
    norm.update(np.array([[1.0, 2.0], [3.0, 6.0]]), np.ones((2, 2), bool))
    save_checkpoint(tmp_path, 3, {"reward_models": norm.state_dict(), "loop": {"step": 3}})
    _, state, _ = load_latest_valid(tmp_path)
    back = RunningNorm(["b", "new"])  # reordered, one removed, one added
    back.load_state_dict(state["reward_models"])
    assert back.count.tolist() == [2.0, 0.0] and back.mean.tolist() == [4.0, 0.0] and back.m2[0] == norm.m2[1]


# --- the record and the log ---------------------------------------------------------------------------------------------


def parts_batch(step_offset=0) -> TrajectoryBatch:
    return TrajectoryBatch.from_records(
        [
            {
                "prompt_id": step_offset + i,
                "response_ids": [1, 2],
                "reward": 1.0,
                "reward_parts": [1.0, 0.5 * i, math.nan],
            }
            for i in range(3)
        ]
    )


def test_reward_parts_travel_packed_and_into_the_log(tmp_path):
    batch = parts_batch()
    back = TrajectoryBatch.unpack(batch.pack())
    assert back.fixed["n_reward_parts"].tolist() == [3, 3, 3]
    np.testing.assert_array_equal(back.record(2)["reward_parts"], np.array([1.0, 1.0, np.nan], np.float32))
    log = TrajectoryLog.open_for_append(tmp_path, {"run_name": "t", "group_size": 1})
    log.append(batch, 0)
    log.append(TrajectoryBatch.from_records([{"prompt_id": 9, "response_ids": [3]}]), 1)  # no parts
    log.close()
    with TrajectoryReader(tmp_path) as r:
        got = r.batch(slice(0, 4))
    assert got.fixed["n_reward_parts"].tolist() == [3, 3, 3, 0]
    np.testing.assert_array_equal(got.reward_parts, batch.reward_parts)


def test_a_log_from_before_reward_parts_reads_and_takes_new_rows(tmp_path):
    log = TrajectoryLog.open_for_append(tmp_path, {"run_name": "t", "group_size": 1})
    log.append(TrajectoryBatch.from_records([{"prompt_id": 0, "response_ids": [1, 2]}]), 0)
    log.close()
    with h5py.File(tmp_path / "trajectories.h5", "r+") as f:  # what an older rollout-hpc wrote
        for name in ("reward_part_offsets", "reward_parts", "n_reward_parts"):
            del f["traj"][name]
    with TrajectoryReader(tmp_path) as r:
        assert r.rows == 1 and len(r.batch(slice(0, 1)).reward_parts) == 0
    log = TrajectoryLog.open_for_append(tmp_path, resume_step=0)
    log.append(parts_batch(step_offset=1), 1)
    log.close()
    with TrajectoryReader(tmp_path) as r:
        got = r.batch(slice(0, 4))
    assert got.fixed["n_reward_parts"].tolist() == [0, 3, 3, 3]
    np.testing.assert_array_equal(got.reward_parts, parts_batch().reward_parts)


def test_the_example_validates_with_the_tiny_models_of_the_tool(tmp_path):
    repo = Path(__file__).resolve().parents[1]
    made = subprocess.run(
        [sys.executable, str(repo / "tools/tiny_reward_models.py"), str(tmp_path / "models")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert made.returncode == 0, made.stderr
    sets = {
        "rewards.models[0].path": tmp_path / "models/reward-classifier",
        "rewards.models[1].path": tmp_path / "models/reward-judge",
        "task.params.train": repo / "configs/examples/data/arithmetic-digits.jsonl",
        "run.dir": tmp_path / "run",
    }
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    example = repo / "configs/examples/reward-model-cpu.yaml"
    done = subprocess.run(
        [sys.executable, "-m", "rollout_hpc", "validate", str(example), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    wrong = subprocess.run(  # the classifier's slot given the judge: named in one line, exit 2
        [
            sys.executable,
            "-m",
            "rollout_hpc",
            "validate",
            str(example),
            *args,
            "--set",
            f"rewards.models[0].path={tmp_path / 'models/reward-judge'}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert wrong.returncode == 2 and "rewards.models helpful" in wrong.stderr and "Traceback" not in wrong.stderr
