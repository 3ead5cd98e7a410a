"""Post-hoc analysis on real trajectory logs written by the store's writer: summary vs an independent
pandas computation on the export, figures, report, samples, CLI errors, bounded memory, live and killed logs."""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import h5py
import matplotlib.image as mpimg
import numpy as np
import pandas as pd
import pytest
import torch
from synthetic_trajectories import synthetic_batch, write_synthetic_log

from rollout_hpc.analysis.export import export_run
from rollout_hpc.analysis.figures import FIGURES, write_run_figures
from rollout_hpc.analysis.report import write_report
from rollout_hpc.analysis.samples import load_samples, render_sample, select_rows
from rollout_hpc.analysis.summary import analyze_run, summarize
from rollout_hpc.cli import main
from rollout_hpc.store.checkpoint import save_checkpoint, weights_digest
from rollout_hpc.store.trajlog import TrajectoryLog, TrajectoryReader

LARGE_STEPS, LARGE_PER_STEP = 200, 1000  # 200k trajectories


@pytest.fixture(scope="module")
def large_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("large")
    write_synthetic_log(run, LARGE_STEPS, LARGE_PER_STEP, restart_at=120)
    return run


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("small")
    write_synthetic_log(run, 40, 64, multi_turn=True, lag=1)
    (run / "config.resolved.yaml").write_text("model: {}\n")  # built-in model: the char tokenizer
    return run


def test_summary_matches_pandas_on_the_export(large_run, tmp_path):
    analysis = analyze_run(large_run, chunk_rows=30_000)  # chunks that do not divide the steps
    exported = export_run(large_run, "parquet", tmp_path)
    frame = pd.read_parquet(exported["trajectories"][0])
    s = analysis.summary
    assert s["samples"] == exported["trajectories"][1] == len(frame) == LARGE_STEPS * LARGE_PER_STEP
    assert s["reward"]["mean"] == pytest.approx(frame["reward"].astype("float64").mean(), rel=1e-12)
    assert s["reward"]["std"] == pytest.approx(frame["reward"].astype("float64").std(ddof=0), rel=1e-9)
    assert s["tokens"] == int(frame["prompt_len"].sum() + frame["response_len"].sum())
    by_step = frame.groupby("step")["reward"].agg(["mean", "min", "max"])
    assert np.allclose(analysis.per_step["reward_mean"], by_step["mean"].to_numpy())
    assert np.array_equal(analysis.per_step["reward_min"], by_step["min"].to_numpy(np.float64))
    assert s["response_length"]["truncated_fraction"] == pytest.approx(frame["truncated"].mean())
    assert s["response_length"]["p50"] == pytest.approx(frame["response_len"].quantile(0.5, interpolation="lower"))
    steps = pd.read_parquet(exported["steps"][0])
    assert len(steps) == s["steps"] == LARGE_STEPS and s["restarts"] == 1
    assert s["reward"]["trend_per_step"] > 0  # the synthetic policy improves
    assert s["time_s"]["train_time"] == pytest.approx(steps["train_time"].sum())


def test_large_log_summarized_in_bounded_memory(large_run):
    with h5py.File(large_run / "trajectories.h5", "r") as f:
        data_bytes = sum(ds.size * ds.dtype.itemsize for ds in f["traj"].values())
    tracemalloc.start()
    summary = summarize(large_run, chunk_rows=16_384)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert summary["samples"] == LARGE_STEPS * LARGE_PER_STEP
    assert data_bytes > 40e6
    assert peak < data_bytes / 8, f"peak {peak / 1e6:.1f} MB for {data_bytes / 1e6:.1f} MB of data"


def test_figures_are_readable_pngs(small_run, tmp_path):
    paths = write_run_figures(analyze_run(small_run), tmp_path)
    assert [p.stem for p in paths] == list(FIGURES)
    for p in paths:
        image = mpimg.imread(p)
        assert image.shape == (450, 800, 4)
        assert image[..., :3].std() > 0.01  # something was drawn


def test_report_is_self_contained_html(small_run, tmp_path):
    page = write_report(small_run, tmp_path / "r.html").read_text()
    images = page.split('src="data:image/png;base64,')[1:]
    assert len(images) == len(FIGURES)
    assert base64.b64decode(images[0].split('"')[0])[:8] == b"\x89PNG\r\n\x1a\n"
    assert "best by reward" in page and "worst by reward" in page and "<script" not in page
    assert "turn 1:" in page  # multi-turn samples shown turn by turn


def test_samples_pick_by_reward_and_decode(small_run, capsys):
    with TrajectoryReader(small_run) as reader:
        rows = select_rows(reader, step=39, mode="best", k=64)
        rewards = [s["reward"] for s in load_samples(reader, rows)]
        assert rewards == sorted(rewards, reverse=True) and len(rewards) == 64
        worst = select_rows(reader, step=39, mode="worst", k=1)
        assert load_samples(reader, worst)[0]["reward"] == min(rewards)
        sample = load_samples(reader, worst)[0]
        prompt = int(sample["prompt_id"])
        picked = load_samples(reader, select_rows(reader, prompt=prompt, mode="random", k=10, seed=1))
        assert {s["prompt_id"] for s in picked} == {prompt} and len(picked) == 4  # the prompt's whole group
    text = render_sample(sample, lambda ids: "".join(chr(97 + int(i) % 26) for i in ids))
    assert "prompt: " + "".join(chr(97 + int(i) % 26) for i in sample["prompt_ids"]) in text
    assert main(["samples", str(small_run), "--best", "2", "--step", "5"]) == 0
    shown = capsys.readouterr().out
    assert shown.count("step 5 ") == 2 and "[" not in shown.split("prompt: ")[1].splitlines()[0]  # decoded, not ids


def test_cli_errors_for_files_that_are_not_logs(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hello")
    assert main(["analyze", str(tmp_path / "notes.txt")]) == 2
    assert "not an HDF5 file" in capsys.readouterr().err
    assert main(["analyze", str(tmp_path)]) == 2
    assert "no trajectory log here" in capsys.readouterr().err
    with TrajectoryLog.open_for_append(tmp_path / "run", {"run_name": "x"}):
        pass
    with h5py.File(tmp_path / "run" / "trajectories.h5", "r+") as f:
        f.attrs["layout_version"] = 7
    assert main(["analyze", str(tmp_path / "run"), "--json"]) == 2
    assert "layout version 7" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "run"), "--format", "csv", "--columns", "response_ids"]) == 2


def test_warnings_name_the_problem(tmp_path):
    rng = np.random.default_rng(0)
    with TrajectoryLog.open_for_append(tmp_path, {"run_name": "bad", "max_new_tokens": 16, "max_staleness": 0}) as log:
        for step in range(10):
            batch = synthetic_batch(rng, 32, step, max_new_tokens=16, lag=2)
            batch.fixed["reward"] = 1.0
            batch.fixed["truncated"] = np.arange(32) % 2 == 0
            log.append(batch, step)
            log.append_metrics(step, {})
    warnings = summarize(tmp_path)["warnings"]
    assert any(w.startswith("reward collapsed") for w in warnings)
    assert any("50% of responses hit max_new_tokens (16)" in w for w in warnings)
    assert any("staleness above the bound" in w and "max_staleness=0" in w for w in warnings)


def test_one_token_answers_are_not_reported_as_truncated(tmp_path):
    # max_new_tokens 1 (the quickstart): every response reaches the limit by design, which is not a problem to warn of.
    rng = np.random.default_rng(0)
    with TrajectoryLog.open_for_append(tmp_path, {"run_name": "one", "max_new_tokens": 1, "max_staleness": 0}) as log:
        for step in range(4):
            batch = synthetic_batch(rng, 32, step, max_new_tokens=1)
            batch.fixed["truncated"] = True
            log.append(batch, step)
            log.append_metrics(step, {})
    summary = summarize(tmp_path)
    assert summary["response_length"]["truncated_fraction"] == 1.0
    assert not any("hit max_new_tokens" in w for w in summary["warnings"])


_WRITER = (
    f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})  # synthetic_trajectories\n"
    + textwrap.dedent("""
    import sys, numpy as np
    from synthetic_trajectories import synthetic_batch
    from rollout_hpc.store.trajlog import TrajectoryLog
    rng = np.random.default_rng(0)
    log = TrajectoryLog.open_for_append(sys.argv[1], {"run_name": "live", "max_new_tokens": 16})
    for step in range(3):
        log.append(synthetic_batch(rng, 50, step), step)
        log.append_metrics(step, {"kl": 0.1})
    print("ready", flush=True)
    sys.stdin.readline()
""")
)


def test_live_and_killed_logs_are_analyzed(tmp_path, capsys):
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        live = summarize(tmp_path)  # the writer holds the file in SWMR mode
        assert live["samples"] == 150 and live["steps"] == 3 and not live["closed_cleanly"]
        assert any(w.startswith("log not closed") for w in live["warnings"])
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert main(["analyze", str(tmp_path), "--json"]) == 0
    dead = json.loads(capsys.readouterr().out)
    assert dead["samples"] == 150 and "writer was killed" in dead["log"]


def test_compare_writes_overlaid_curves(small_run, large_run, tmp_path, capsys):
    out = tmp_path / "cmp.png"
    assert main(["compare", str(small_run), str(large_run), "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert small_run.name in table and large_run.name in table and "200000" in table
    assert mpimg.imread(out).shape[:2] == (720, 1200)


def test_ckpt_command_reports_newest_valid(tmp_path, capsys, caplog):
    weights = {"w": torch.arange(6, dtype=torch.bfloat16)}
    save_checkpoint(tmp_path, 10, {"model": weights}, {"policy_version": 10})
    newest = save_checkpoint(
        tmp_path, 20, {"model": {"w": torch.zeros(6, dtype=torch.bfloat16)}}, {"policy_version": 20}
    )
    newest.write_bytes(newest.read_bytes()[:1000])
    assert main(["ckpt", str(tmp_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["step"] == 10 and info["policy_version"] == 10
    assert info["weights_sha256"] == weights_digest({"model": weights})
    [warning] = [r.getMessage() for r in caplog.records]  # one line naming the damaged and the used file
    assert "step-00000020.h5" in warning and "step-00000010.h5" in warning
    assert main(["ckpt", str(tmp_path / "nothing")]) == 2
