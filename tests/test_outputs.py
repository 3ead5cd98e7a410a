"""What a new user reads after a run (issue 15, item 7), on a real run: a dataset task trained under mpirun
(`rollout-hpc submit --local`), stopped with SIGUSR1 after step 2 and continued with `rollout-hpc resume --local`.
compare's labels and config differences, report's configuration, samples' reference answers, export's text
columns, the figures (no KL without a reference model, bands that stay within the data), the progress line's
small numbers, status's training step and checkpoint, analyze's restart count."""

from __future__ import annotations

import html
import json
import re
import shutil
import signal
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import yaml
from synthetic_trajectories import synthetic_batch
from test_mixing import write_config, write_data
from test_resume_local import Interruptible, cli

from rollout_hpc.analysis.export import TEXT_COLUMNS, export_run
from rollout_hpc.analysis.figures import kl_entropy_figure, reward_figure
from rollout_hpc.analysis.samples import load_decoder
from rollout_hpc.analysis.summary import analyze_run
from rollout_hpc.cli import main
from rollout_hpc.runtime.metrics import progress_line
from rollout_hpc.store.trajlog import TrajectoryLog

STEPS = 6
QUESTIONS = {f"{a}+{b}=": str(a + b) for a in range(4) for b in range(3)}  # 12 rows, answers 0..5


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> dict:
    """A run stopped after step 2 (SIGUSR1: checkpoint, exit 75) and resumed to its end; its outputs."""
    tmp = tmp_path_factory.mktemp("outputs")
    data = tmp / "sums.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in QUESTIONS.items()))
    config = tmp / "sums.yaml"
    config.write_text(f"""
run: {{name: sums, seed: 0}}
launcher: local
model: {{hidden_size: 32, num_layers: 1, num_heads: 2, max_seq_len: 32}}
task: {{name: dataset, reward: exact, params: {{train: {data}, prompt_key: question, answer_key: answer}}}}
algorithm: {{steps: {STEPS}, prompts_per_step: 2, group_size: 4, max_new_tokens: 1}}
checkpoint: {{every_steps: 2, keep_last: 3}}
""")
    run_dir = tmp / "a" / "run"
    first = Interruptible("submit", config, "--local", "--run-dir", run_dir, cwd=tmp)
    first.wait_for_step(2)
    first.proc.send_signal(signal.SIGUSR1)
    assert first.finish() == 75, first.output[-3000:]
    second = cli("resume", run_dir, "--local", cwd=tmp)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    return {"run_dir": run_dir, "tmp": tmp, "output": first.output + second.stdout}


def test_progress_line_has_no_negative_zero(resumed):
    for value in (-1e-9, -0.0, 0.0, -4e-5, 3e-7, -0.00004, 0.25, -0.25):
        line = progress_line(0, 1, {"kl": value, "reward_mean": value, "entropy": value})
        assert not re.search(r"-0(\.0+)?(?![.\de])", line), line  # "-0", "-0.00", "-0.0000"
        kl = float(line.split("kl ")[1].split()[0])
        assert kl == pytest.approx(value, abs=1e-12 if abs(value) < 1e-12 else 0.06 * abs(value))
    lines = [line for line in resumed["output"].splitlines() if line.startswith("step ")]
    assert len(lines) >= STEPS and not any(re.search(r" -0\.0+\b", line) for line in lines), lines


def test_analyze_counts_the_resume_as_a_restart(resumed):
    done = cli("analyze", resumed["run_dir"], "--json", cwd=resumed["tmp"])
    assert done.returncode == 0, done.stderr
    manifest = json.loads((resumed["run_dir"] / "manifest.json").read_text())
    assert len(manifest["local_runs"]) == 2 and len(manifest["resumes"]) == 1
    assert json.loads(done.stdout)["restarts"] == 1
    table = cli("analyze", resumed["run_dir"], cwd=resumed["tmp"]).stdout
    assert re.search(r"restarts\s+│\s+1\b", table) and "no reference model" in table  # kl_coef 0: no KL to show


def test_status_shows_the_training_step_and_newest_checkpoint(resumed):
    run_dir = resumed["run_dir"]
    done = cli("status", run_dir, "--json", cwd=resumed["tmp"])
    assert done.returncode == 0, done.stderr
    progress = json.loads(done.stdout)["progress"]
    newest = json.loads(cli("ckpt", run_dir, "--json", cwd=resumed["tmp"]).stdout)["step"]
    assert progress["steps_done"] == progress["total_steps"] == STEPS
    assert progress["checkpoint_step"] == newest and progress["checkpoint_age_s"] >= 0
    text = cli("status", run_dir, cwd=resumed["tmp"]).stdout
    assert f"step {STEPS}/{STEPS}" in text and f"newest checkpoint step {newest}" in text
    # Cheap to ask: no torch (seconds to import) on a login node.
    probe = (
        "import sys; from rollout_hpc.launch.status import training_progress; "
        f"p = training_progress({str(run_dir)!r}); print(p.steps_done, 'torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.split() == [
        str(STEPS),
        "False",
    ]


def test_samples_show_the_reference_answer(resumed, capsys):
    assert main(["samples", str(resumed["run_dir"]), "--random", "6", "--step", "4"]) == 0
    blocks = [b for b in capsys.readouterr().out.split("\n\n") if b.strip()]
    assert len(blocks) == 6
    for block in blocks:
        question = re.search(r"prompt: .*?(\d\+\d=)", block, re.S).group(1)  # the decoded prompt's question
        assert f"reference answer: {QUESTIONS[question]}\n" in block  # the file's answer for that question


def test_export_has_decoded_text_columns(resumed, tmp_path):
    run_dir = resumed["run_dir"]
    decode = load_decoder(run_dir)
    written = export_run(run_dir, "parquet", tmp_path / "t", ["prompt_ids", "response_ids"], 5, decode)
    frame = pd.read_parquet(written["trajectories"][0])  # chunks of 5 rows: offsets restart in every chunk
    assert len(frame) == written["trajectories"][1] == STEPS * 2 * 4
    for text, ids in TEXT_COLUMNS.items():
        assert frame[text].tolist() == [decode(np.asarray(v)) for v in frame[ids]]
    assert all(re.search(r"\d\+\d=", t) for t in frame["prompt_text"])
    assert main(["export", str(run_dir), "--format", "csv", "--out", str(tmp_path / "c")]) == 0
    assert set(TEXT_COLUMNS) <= set(pd.read_csv(tmp_path / "c" / "trajectories.csv").columns)
    assert main(["export", str(run_dir), "--no-text", "--out", str(tmp_path / "n")]) == 0
    assert not set(TEXT_COLUMNS) & set(pd.read_parquet(tmp_path / "n" / "trajectories.parquet").columns)


def test_compare_labels_runs_apart_and_shows_config_differences(resumed, tmp_path, capsys):
    other = tmp_path / "b" / "run"  # the same basename as resumed's a/run, and the same run.name
    shutil.copytree(resumed["run_dir"], other)
    config = yaml.safe_load((other / "config.resolved.yaml").read_text())
    config["algorithm"]["lr"] *= 2
    (other / "config.resolved.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    assert main(["compare", str(resumed["run_dir"]), str(other), "--out", str(tmp_path / "cmp.png")]) == 0
    shown = capsys.readouterr().out
    assert "a/run" in shown and "b/run" in shown and "run'" not in shown
    [row] = [line for line in shown.splitlines() if "algorithm.lr" in line]
    assert str(config["algorithm"]["lr"]) in row and str(config["algorithm"]["lr"] / 2) in row
    assert "algorithm.steps" not in shown  # the same in both


def test_report_holds_the_resolved_config(resumed, tmp_path):
    assert main(["report", str(resumed["run_dir"]), "--out", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text()
    shown = page.split("<details>")[1].split("<pre>")[1].split("</pre>")[0]
    assert html.unescape(shown) == (resumed["run_dir"] / "config.resolved.yaml").read_text()
    assert "<th>algorithm.lr</th>" in page and "reference answer:" in page


def test_no_kl_figure_without_a_reference_model(resumed):
    analysis = analyze_run(resumed["run_dir"])
    assert analysis.summary["kl_coef"] == 0 and "kl" in analysis.per_step  # the metric is logged all the same
    fig = kl_entropy_figure(analysis)
    [ax] = fig.axes
    assert "no reference model" in ax.get_title()
    assert [line.get_label() for line in ax.get_lines()] == ["entropy"]


def test_reward_bands_of_a_binary_reward_stay_within_the_data(tmp_path):
    rng = np.random.default_rng(0)
    with TrajectoryLog.open_for_append(tmp_path, {"run_name": "binary", "max_new_tokens": 16}) as log:
        for step in range(20):
            batch = synthetic_batch(rng, 32, step)
            batch.fixed["reward"] = (rng.random(32) < 0.1 + 0.03 * step).astype(np.float32)
            log.append(batch, step)
            log.append_metrics(step, {})
    analysis = analyze_run(tmp_path)
    assert analysis.summary["reward"]["binary"]
    [ax] = reward_figure(analysis).axes
    bands = ax.collections
    assert [b.get_label() for b in bands] == ["mean ± std (within min - max)"]  # no min - max band: it is 0..1
    y = np.concatenate([p.vertices[:, 1] for p in bands[0].get_paths()])
    assert y.min() >= 0 and y.max() <= 1  # std alone would reach below 0 at the early steps
    assert (analysis.per_step["reward_mean"] - analysis.per_step["reward_std"] < 0).any()
    fig = ax.figure
    fig.tight_layout()
    fig.canvas.draw()
    legend, plot = ax.get_legend().get_window_extent(), ax.get_window_extent()
    assert legend.x0 >= plot.x1 and legend.x1 <= fig.bbox.x1  # beside the plot (covering nothing), still on the page


def test_samples_of_a_mixed_dataset_name_the_source_and_its_answer(tmp_path, capsys):
    """Two sources, one prompt of each in turn (quotas 2 + 2 of 4 per step): prompt id i is source i % 4 < 2. The
    answers come from the rows frozen in RUN_DIR/data, not the source files, which change after submit."""
    write_data(tmp_path, n_words=4)
    config = write_config(tmp_path, "mix", steps=2, weights=(1, 1))  # 4 prompts a step: quotas 2 + 2
    sums = [json.loads(line)["answer"] for line in (tmp_path / "sums.jsonl").read_text().splitlines()]
    words = [json.loads(line)["a"] for line in (tmp_path / "words.jsonl").read_text().splitlines()]
    run_dir = tmp_path / "run"
    assert main(["submit", str(config), "--dry-run", "--run-dir", str(run_dir)]) == 0
    (tmp_path / "words.jsonl").write_text(json.dumps({"q": "say nothing", "a": "changed"}) + "\n")  # after the freeze
    sources = ["sums", "words"]
    rng = np.random.default_rng(0)
    with TrajectoryLog.open_for_append(run_dir, {"run_name": "mix", "domains": sources}) as log:
        batch = synthetic_batch(rng, 16, 0, group_size=2)  # prompt ids 0..7
        batch.fixed["domain"] = (batch.fixed["prompt_id"] % 4 >= 2).astype(np.uint8)
        log.append(batch, 0)
        log.append_metrics(0, {})
    capsys.readouterr()
    for prompt in range(8):
        assert main(["samples", str(run_dir), "--prompt", str(prompt), "--best", "1"]) == 0
        shown = capsys.readouterr().out
        answer = re.search(r"reference answer: (\S+)", shown).group(1)
        if prompt % 4 < 2:
            assert "source sums" in shown and answer in sums
        else:
            assert "source words" in shown and answer in words
