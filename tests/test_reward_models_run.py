"""A run with reward models in the generator ranks (rewards.models, nodes: 0), under the local launcher (real mpirun
ranks): a tiny classifier and a tiny judge made here score every sample next to the rule reward; the log's rewards
are the rule reward plus the normalized scores, recomputed here from the logged parts; the analysis tools show
each model. With the classifier on a reward group of its own (a third group of ranks), a run stopped with SIGUSR1,
resumed, ended by a SIGKILLed reward rank and resumed again ends with the weights of the first run, never stopped
(the normalization's statistics are in the checkpoint), every sample trained once. The same as a Slurm het job of
three components on the local Slurm cluster, warned and requeued."""

from __future__ import annotations

import json
import os
import re
import signal

import numpy as np
import pytest
from test_loop import _rank_pid
from test_resume_local import STEPS, Interruptible, assert_exactly_once, cli, weights_digest, write_run_config
from test_resume_slurm import warned_once_checkpointed
from test_submit_slurm import submitted_job
from tiny_hf import make_tiny_judge, make_tiny_reward_classifier

from rollout_hpc.config import load_config
from rollout_hpc.rewards.mixing import RewardMix, RunningNorm
from rollout_hpc.store.trajlog import TrajectoryReader

SAMPLES_PER_STEP = 8  # test_resume_local: PROMPTS x GROUP


@pytest.fixture(scope="module")
def rewards_yaml(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("rms")
    classifier = make_tiny_reward_classifier(root / "classifier", seed=3)
    judge = make_tiny_judge(root / "judge", says="7")
    # The judge's replies ("7777...") never match the default \boxed{N} pattern: every one is a parse failure,
    # scored parse_failure_score.
    return f"""
rewards:
  rule_weight: 1.0
  models:
    - {{name: helpful, path: {classifier}, kind: classifier, weight: 0.5, batch_size: 3}}
    - {{name: judge, path: {judge}, kind: judge, weight: 0.25, normalize: false, parse_failure_score: 2.0,
        max_new_tokens: 4}}
"""


@pytest.fixture(scope="module")
def whole(tmp_path_factory, rewards_yaml):
    tmp = tmp_path_factory.mktemp("whole")
    config = write_run_config(tmp, "whole", sleep=0.0, extra=rewards_yaml)  # the reference: nothing to interrupt
    done = cli("submit", config, "--local", "--run-dir", tmp / "w", cwd=tmp)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return tmp / "w", done.stdout


def test_the_logged_reward_is_the_rule_plus_the_normalized_scores(whole):
    run_dir, stdout = whole
    assert "rm helpful " in stdout and "rm judge n/a (8 unparsed)" in stdout  # the progress line
    # and the models' throughput: samples per second of scoring (runtime/scoring_rate.py), in the log too
    assert re.search(r"  rm \d+ samples/s", stdout), stdout[-2000:]
    with TrajectoryReader(run_dir) as r:
        rates = r.metrics()["rm_samples_per_s"]
    assert np.nanmin(rates) > 0 and np.isfinite(rates).sum() >= STEPS - 1
    cfg = load_config(run_dir / "config.resolved.yaml")
    mix, norm = RewardMix(cfg.rewards, []), RunningNorm(["helpful", "judge"])
    with TrajectoryReader(run_dir) as r:
        batch = r.batch(slice(0, r.rows))
        steps = r.column("step")
    assert (batch.fixed["n_reward_parts"] == 3).all()
    parts = batch.reward_parts.reshape(len(batch), 3).astype(np.float64)
    assert np.isnan(parts[:, 2]).all()  # every judge reply unparsed
    assert len(np.unique(parts[:, 1])) > SAMPLES_PER_STEP  # the classifier tells responses apart
    expect = np.concatenate(
        [mix.reward(parts[steps == s], batch.fixed["domain"][steps == s], norm) for s in range(STEPS)]
    )
    order = np.argsort(steps, kind="stable")
    np.testing.assert_allclose(batch.fixed["reward"][order], expect, rtol=1e-5, atol=1e-6)
    rule = parts[:, 0]
    assert not np.allclose(batch.fixed["reward"], rule)  # the models count


def test_the_analysis_tools_show_each_model(whole, tmp_path):
    run_dir, _ = whole
    done = cli("analyze", run_dir, "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    models = json.loads(done.stdout)["reward_models"]
    assert set(models) == {"helpful", "judge"}
    assert models["helpful"]["step"] == list(range(STEPS))
    assert models["helpful"]["scored"] == [SAMPLES_PER_STEP] * STEPS and models["helpful"]["parse_failures_total"] == 0
    assert all(np.isfinite(models["helpful"]["mean"])) and all(s > 0 for s in models["helpful"]["std"])
    assert models["judge"]["parse_failures"] == [SAMPLES_PER_STEP] * STEPS
    samples = cli("samples", run_dir, "--step", str(STEPS - 1), "--best", "1", cwd=tmp_path)
    assert samples.returncode == 0, samples.stderr
    assert "reward parts: rule " in samples.stdout and ", judge unparsed" in samples.stdout
    report = cli("report", run_dir, "--out", tmp_path / "r.html", cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    html = (tmp_path / "r.html").read_text()
    assert "<h2>Reward models</h2>" in html and f'<td class="num">{SAMPLES_PER_STEP * STEPS}</td>' in html


def test_a_reward_group_stopped_and_with_a_reward_rank_killed_resumes_to_the_weights_of_one_never_stopped(
    whole, rewards_yaml, tmp_path
):
    """The classifier on a reward group of its own (a third group of ranks between generators and trainers), the
    judge on the generator ranks: the same scores, so the same weights as the run where both score on the generator
    ranks; a SIGUSR1 stop and a SIGKILLed reward rank lose nothing and train nothing twice."""
    grouped = rewards_yaml.replace("batch_size: 3}", "batch_size: 3, nodes: 1}")
    assert grouped != rewards_yaml
    cut = tmp_path / "cut"
    config = write_run_config(tmp_path, "cut", extra=grouped)
    run = Interruptible("submit", config, "--local", "--run-dir", cut, cwd=tmp_path)
    run.wait_for_step(4)
    run.proc.send_signal(signal.SIGUSR1)
    assert run.finish() == 75, run.output[-3000:]
    assert "reward rank 2: scored" in run.output  # the group scored, then passed the generators' END on
    assert re.search(r"  rm \d+ samples/s", run.output)  # the reward rank's throughput reaches the progress line

    run = Interruptible("resume", cut, "--local", cwd=tmp_path)
    run.wait_for_step(10)  # past the checkpoint of step 9 (every 3)
    mpirun_pid = json.loads((cut / "manifest.json").read_text())["local_runs"][-1]["pid"]
    os.kill(_rank_pid(mpirun_pid, "rm0"), signal.SIGKILL)
    code = run.finish()
    assert code not in (0, 75), run.output[-3000:]
    assert "nothing checkpointed is lost" in run.output and f"rollout-hpc resume {cut}" in run.output

    done = cli("resume", cut, "--local", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert weights_digest(cut) == weights_digest(whole[0])
    assert_exactly_once(cut, STEPS)
    with TrajectoryReader(cut) as a, TrajectoryReader(whole[0]) as b:
        np.testing.assert_array_equal(np.sort(a.column("reward")), np.sort(b.column("reward")))


@pytest.mark.slurm
def test_a_three_component_slurm_het_job_warned_and_requeued_matches_the_local_run(
    slurm_cluster, whole, rewards_yaml, tmp_path
):
    """The reward group as het component 2 on the local Slurm cluster (one node each for generators, trainers and
    the classifier): USR1 to the batch shell once a checkpoint exists -> checkpoint, exit 75, requeue -> the run
    finishes with the weights of the local run where both models score on the generator ranks."""
    grouped = rewards_yaml.replace("batch_size: 3}", "batch_size: 3, nodes: 1}")
    config = write_run_config(tmp_path, "het", launcher="slurm", extra=grouped)
    run_dir = tmp_path / "het"
    job_id = submitted_job(cli("submit", config, "--run-dir", run_dir, cwd=tmp_path))
    assert (run_dir / "job.sbatch").read_text().count("#SBATCH hetjob") == 2
    log = warned_once_checkpointed(slurm_cluster, run_dir, job_id)
    assert "reward rank 2: scored" in log
    nodes = {r["NodeList"] for r in slurm_cluster.job_records(int(job_id))}
    assert len(slurm_cluster.job_records(int(job_id))) == 3 and len(nodes) == 3, nodes
    assert weights_digest(run_dir) == weights_digest(whole[0])
    assert_exactly_once(run_dir, STEPS)
