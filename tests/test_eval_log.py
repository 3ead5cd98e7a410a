"""The eval table of the trajectory log (validation during training) and reward errors, end to end on real HDF5 files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import h5py
import matplotlib.image as mpimg
import numpy as np
import pytest
from synthetic_trajectories import synthetic_batch

from rollout_hpc.analysis.export import export_run
from rollout_hpc.analysis.figures import FIGURES, eval_figure, write_run_figures
from rollout_hpc.analysis.report import write_report
from rollout_hpc.analysis.summary import analyze_run, summarize
from rollout_hpc.cli import main
from rollout_hpc.store.trajlog import STANDARD_EVAL_METRICS, TrajectoryLog, TrajectoryReader, read_eval
from rollout_hpc.trajectory import REWARD_ERROR, REWARD_TIMEOUT

META = {"run_name": "evals", "group_size": 4, "max_new_tokens": 16, "max_staleness": 0}
ROOT = Path(__file__).resolve().parents[1]


def _eval(step: int) -> dict[str, float]:
    return {
        "accuracy": 0.1 + 0.05 * step,
        "mean_reward": 0.2 + 0.05 * step,
        "pass_at_k": 0.3 + 0.05 * step,
        "mean_at_k": 0.15 + 0.05 * step,
        "k": 4,
        "prompts": 16,
        "samples": 64,
        "response_len_mean": 9.5,
        "reward_errors": 0,
    }


def _write_run(run, steps=8, eval_every=2, errors=None) -> None:
    """`steps` train steps of 16 trajectories; an eval at every `eval_every`-th policy version (0 too).
    errors: {step: [(row, status), ...]} rewards that failed."""
    rng = np.random.default_rng(0)
    with TrajectoryLog.open_for_append(run, META) as log:
        for step in range(steps):
            if step % eval_every == 0:
                log.append_eval(step, _eval(step))
            batch = synthetic_batch(rng, 16, step)
            for row, status in (errors or {}).get(step, []):
                batch.fixed["reward_status"][row] = status
                batch.fixed["reward"][row] = 0.0
            log.append(batch, step)
            log.append_metrics(step, {"kl": 0.01})


def test_append_eval_round_trip_and_new_columns(tmp_path):
    with TrajectoryLog.open_for_append(tmp_path, META) as log:
        log.append_eval(0, {"accuracy": 0.25, "pass_at_k": 0.5, "k": 4})
        log.append_eval(5, {"accuracy": 0.5, "my_score": 7.0, "time": 123.0})  # a new name: a new column
        assert log.eval_rows == 2
    with TrajectoryReader(tmp_path) as r:
        assert r.eval_rows == 2 and r.eval_names()[: len(STANDARD_EVAL_METRICS)] == list(STANDARD_EVAL_METRICS)
        e = r.eval_metrics()
        assert list(e["step"]) == [0, 5] and list(e["accuracy"]) == [0.25, 0.5]
        assert e["pass_at_k"][0] == 0.5 and np.isnan(e["pass_at_k"][1])
        assert np.isnan(e["my_score"][0]) and e["my_score"][1] == 7.0
        assert e["time"][1] == 123.0 and e["time"][0] > 1e9  # time defaults to now
        assert r.metric_rows == 0 and r.metrics()["step"].size == 0  # the per-step table is separate
    assert read_eval(tmp_path)[1] == {"step": 5.0, "time": 123.0, "accuracy": 0.5, "my_score": 7.0}
    with pytest.raises(Exception, match="not a number"):
        with TrajectoryLog.open_for_append(tmp_path) as log:
            log.append_eval(6, {"accuracy": "high"})


def test_no_eval_rows_reads_empty(tmp_path):
    _write_run(tmp_path, steps=3, eval_every=100)  # step 0 only ...
    with h5py.File(tmp_path / "trajectories.h5", "r+") as f:  # ... then none
        f["eval/values"].resize((0, f["eval/values"].shape[1]))
        f["eval/committed"][0] = 0
    with TrajectoryReader(tmp_path) as r:
        assert r.eval_rows == 0 and r.eval_metrics() == {}
    assert read_eval(tmp_path) == [] and summarize(tmp_path)["eval"] is None


_LIVE_WRITER = textwrap.dedent("""
    import os, sys
    from rollout_hpc.store.trajlog import TrajectoryLog
    log = TrajectoryLog.open_for_append(sys.argv[1], {"run_name": "live"})
    mode = sys.argv[2]
    for step in range(3):
        log.append_eval(step, {"accuracy": step / 10})
        print(step, flush=True)
        if mode == "lockstep":
            sys.stdin.readline()
    if mode == "die":
        # a row written but not committed: values resized and filled, counter not advanced
        ds = log._eval["values"]
        ds.resize((ds.shape[0] + 1, ds.shape[1]))
        ds[-1] = 99.0
        log._f.flush()
        print("partial", flush=True)
        os._exit(0)  # no close: HDF5 still marks the file open for writing
    log.close()
""")


def _writer(path, mode):
    return subprocess.Popen(
        [sys.executable, "-c", _LIVE_WRITER, str(path), mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def test_reader_follows_the_eval_rows_of_a_live_writer(tmp_path):
    proc = _writer(tmp_path, "lockstep")
    try:
        assert proc.stdout.readline().strip() == "0"
        reader = TrajectoryReader(tmp_path)  # opened while the writer holds the file in SWMR mode
        for step in range(3):
            if step:
                assert proc.stdout.readline().strip() == str(step)
            reader.refresh()
            assert reader.eval_rows == step + 1
            assert np.allclose(reader.eval_metrics()["accuracy"], np.arange(step + 1) / 10)
            proc.stdin.write("\n")
            proc.stdin.flush()
        assert proc.wait(timeout=60) == 0
        reader.refresh()
        assert reader.closed_cleanly and reader.eval_rows == 3
        reader.close()
    finally:
        proc.kill()


def test_killed_writer_keeps_committed_eval_rows(tmp_path):
    proc = _writer(tmp_path, "die")
    assert [proc.stdout.readline().strip() for _ in range(4)] == ["0", "1", "2", "partial"]
    assert proc.wait(timeout=60) == 0
    with h5py.File(tmp_path / "trajectories.h5", "r", libver="latest", swmr=True, locking=False) as f:
        assert f["eval/values"].shape[0] == 4 and int(f["eval/committed"][0]) == 3
    with TrajectoryReader(tmp_path) as r:  # trusts the counter, not the extent
        assert not r.closed_cleanly and r.eval_rows == 3 and list(r.eval_metrics()["step"]) == [0, 1, 2]
    with TrajectoryLog.open_for_append(tmp_path) as log:  # reconcile drops the partial row
        assert log.reconciled["writer_killed"] and log.reconciled["eval_rows_dropped"] == 1
        assert log.eval_rows == 3
        log.append_eval(3, {"accuracy": 0.3})
    with TrajectoryReader(tmp_path) as r:
        assert r.closed_cleanly and np.allclose(r.eval_metrics()["accuracy"], [0, 0.1, 0.2, 0.3])
    with h5py.File(tmp_path / "trajectories.h5", "r") as f:  # truncated in the file, not just hidden
        assert f["eval/values"].shape[0] == 4 and not (f["eval/values"][:, 2] == 99.0).any()


def test_resume_drops_evals_after_the_resume_step(tmp_path):
    _write_run(tmp_path, steps=8, eval_every=2)  # evals at 0, 2, 4, 6
    # resuming from the checkpoint after step 3 (MetricsSink: resume_step = steps_done - 1 = 3): the resumed
    # run starts at policy version 4 and evaluates it again; the evals of versions 0 and 2 are kept.
    with TrajectoryLog.open_for_append(tmp_path, resume_step=3) as log:
        assert log.reconciled["eval_rows_after_resume_step"] == 2 and log.eval_rows == 2
        log.append_eval(4, {"accuracy": 0.9})
    with TrajectoryReader(tmp_path) as r:
        assert r.eval_rows == 3
        e = r.eval_metrics(dedupe=False)
        assert list(e["step"]) == [0, 2, 4] and e["accuracy"][-1] == 0.9
        assert list(r.metrics()["step"]) == [0, 1, 2, 3]


def test_duplicate_eval_step_keeps_the_last(tmp_path):
    with TrajectoryLog.open_for_append(tmp_path, META) as log:
        for step, acc in ((0, 0.1), (2, 0.2), (2, 0.25), (1, 0.15)):
            log.append_eval(step, {"accuracy": acc})
    with TrajectoryReader(tmp_path) as r:
        assert list(r.eval_metrics()["accuracy"]) == [0.1, 0.15, 0.25]
        assert len(r.eval_metrics(dedupe=False)["accuracy"]) == 4


def test_old_log_without_eval_group_or_reward_status(tmp_path):
    _write_run(tmp_path, steps=3, eval_every=100)
    with h5py.File(tmp_path / "trajectories.h5", "r+") as f:  # what a log of an older rollout-hpc looks like
        del f["eval"]
        del f["traj/reward_status"]
    with TrajectoryReader(tmp_path) as r:  # readable as is
        assert r.eval_rows == 0 and r.eval_metrics() == {} and r.eval_names() == []
        assert not r.has_column("reward_status") and not r.column("reward_status").any()
        assert r.column("reward_status").shape == (48,) and not r.batch([0, 5]).fixed["reward_status"].any()
    s = summarize(tmp_path)
    assert s["eval"] is None and s["reward_errors"] == 0 and s["samples"] == 48
    with TrajectoryLog.open_for_append(tmp_path) as log:  # the missing objects are created before SWMR starts
        assert log.reconciled["upgraded"] == ["/eval", "/traj/reward_status"]
        log.append(synthetic_batch(np.random.default_rng(1), 16, 3), 3)
        log.append_metrics(3, {})
        log.append_eval(4, {"accuracy": 0.5})
    with TrajectoryReader(tmp_path) as r:
        assert r.rows == 64 and r.has_column("reward_status") and r.column("reward_status").shape == (64,)
        assert list(r.eval_metrics()["step"]) == [4]


def test_summary_eval_lists_and_reward_errors(tmp_path):
    _write_run(
        tmp_path, steps=8, eval_every=2, errors={1: [(0, REWARD_ERROR), (3, REWARD_TIMEOUT)], 5: [(2, REWARD_ERROR)]}
    )
    s = summarize(tmp_path)
    e = s["eval"]
    assert set(STANDARD_EVAL_METRICS) <= set(e)
    assert e["step"] == [0, 2, 4, 6] and all(isinstance(v, int) for v in e["step"])
    assert e["accuracy"] == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert e["pass_at_k"] == pytest.approx([0.3, 0.4, 0.5, 0.6]) and e["k"] == [4.0] * 4
    assert s["eval_accuracy"] == {
        "first": pytest.approx(0.1),
        "last": pytest.approx(0.4),
        "best": pytest.approx(0.4),
        "best_step": 6,
        "first_step": 0,
        "last_step": 6,
        "evals": 4,
    }
    assert s["reward_errors"] == 3 and s["reward_timeouts"] == 1
    assert any("stand-in reward of 0" in w and "raised for 2" in w for w in s["warnings"])
    assert json.dumps(s)  # JSON-able


def test_cli_analyze_shows_eval_and_reward_errors(tmp_path):
    _write_run(tmp_path, errors={2: [(1, REWARD_TIMEOUT)]})
    cli = ROOT / ".venv" / "bin" / "rollout-hpc"
    argv = [str(cli)] if cli.exists() else [sys.executable, "-m", "rollout_hpc.cli"]
    env = {**os.environ, "COLUMNS": "200"}
    proc = subprocess.run(
        argv + ["analyze", str(tmp_path), "--json"], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["eval"]["step"] == [0, 2, 4, 6] and data["eval"]["accuracy"] == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert data["reward_errors"] == 1 and data["reward_timeouts"] == 1
    table = subprocess.run(argv + ["analyze", str(tmp_path)], capture_output=True, text=True, env=env, timeout=120)
    assert table.returncode == 0, table.stderr
    assert "eval accuracy first → last" in table.stdout and "0.1 → 0.4" in table.stdout
    assert "eval best (step)" in table.stdout and "0.4 (step 6)" in table.stdout
    assert "reward errors (timeouts)" in table.stdout


def test_analyze_without_evals(tmp_path, capsys):
    _write_run(tmp_path, steps=3, eval_every=100)
    with h5py.File(tmp_path / "trajectories.h5", "r+") as f:
        del f["eval"]
    assert main(["analyze", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["eval"] is None and data["eval_accuracy"] is None and data["reward_errors"] == 0
    assert main(["analyze", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "eval accuracy" not in table and "eval best" not in table and "reward errors" not in table


def test_plot_writes_the_eval_figure(tmp_path, capsys):
    run = tmp_path / "run"
    _write_run(run)
    assert main(["plot", str(run), "--out", str(tmp_path / "plots")]) == 0
    assert "eval.png" in capsys.readouterr().out
    image = mpimg.imread(tmp_path / "plots" / "eval.png")
    assert image.shape == (450, 800, 4) and image[..., :3].std() > 0.01
    assert "eval" in FIGURES
    # without evals the figure says so (the note is drawn, not an error)
    bare = tmp_path / "bare"
    _write_run(bare, steps=2, eval_every=100)
    with h5py.File(bare / "trajectories.h5", "r+") as f:
        del f["eval"]
    analysis = analyze_run(bare)
    assert analysis.eval == {}
    fig = eval_figure(analysis)
    assert any("no eval in this log" in t.get_text() for t in fig.axes[0].texts)
    assert [p.stem for p in write_run_figures(analysis, tmp_path / "bare_plots")] == list(FIGURES)


def test_report_and_export_include_evals(tmp_path):
    _write_run(tmp_path)
    page = write_report(tmp_path, tmp_path / "r.html").read_text()
    assert "Validation during training" in page and page.count('src="data:image/png;base64,') == len(FIGURES)
    assert "pass_at_k" in page
    written = export_run(tmp_path, "csv", tmp_path / "export")
    assert written["eval"][1] == 4
    header = (tmp_path / "export" / "eval.csv").read_text().splitlines()[0]
    assert header.replace('"', "").split(",")[:3] == ["step", "time", "accuracy"]


def test_compare_shows_both_eval_curves(tmp_path, capsys):
    a, b = tmp_path / "run_a", tmp_path / "run_b"
    _write_run(a)
    _write_run(b, eval_every=4)
    out = tmp_path / "cmp.png"
    assert main(["compare", str(a), str(b), "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "eval best (step)" in table and "0.4 (step 6)" in table and "0.3 (step 4)" in table
    assert mpimg.imread(out).shape[:2] == (1080, 1200)  # a third row of panels: eval accuracy, pass@k
