"""A damaged trajectory log (truncated, bytes flipped or zeroed, cut to a few bytes) blocks neither the tools nor the
run: `analyze`, `export`, `samples`, `plot`, `report` read every complete step before the damage and warn once,
naming the file and the step from which data is lost; `resume` keeps the damaged file aside, continues with its
readable steps and logs every step after the checkpoint exactly once. Real HDF5 files, a real local run."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pyarrow.parquet as pq
import pytest
from synthetic_trajectories import write_synthetic_log
from test_resume_local import cli

from rollout_hpc.cli import main
from rollout_hpc.store import trajlog
from rollout_hpc.store.trajlog import TrajectoryLog, TrajectoryReader

STEPS, PER_STEP = 40, 512  # 20480 rows: three row chunks, many token chunks


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pristine") / "trajectories.h5"
    write_synthetic_log(path, STEPS, PER_STEP)
    return path


def _chunk(path: Path, dataset: str, index: int) -> tuple[int, int]:
    """(file offset, size) of chunk `index` of a dataset, as stored now."""
    with h5py.File(path, "r", libver="latest", swmr=True, locking=False) as f:
        info = f[dataset].id.get_chunk_info(index)
        return info.byte_offset, info.size


def damage(pristine: Path, run_dir: Path, kind: str) -> Path:
    """A copy of the log in run_dir, damaged one way."""
    run_dir.mkdir()
    path = run_dir / "trajectories.h5"
    shutil.copy(pristine, path)
    data = bytearray(path.read_bytes())
    if kind.startswith("truncate"):
        data = data[: int(len(data) * float(kind.split("-")[1]))]
    elif kind == "flip-reward":  # bytes flipped inside the second chunk of a per-row column
        offset, size = _chunk(path, "traj/reward", 1)
        for i in range(offset + size // 2, offset + size // 2 + 16):
            data[i] ^= 0xFF
    elif kind == "zero-tokens":  # a 4 KiB block zeroed inside a middle chunk of the response tokens
        offset, size = _chunk(path, "traj/response_ids", 3)
        data[offset + 16 : offset + 16 + min(4096, size - 16)] = bytes(min(4096, size - 16))
    path.write_bytes(bytes(data))
    return path


def original_rows(pristine: Path, columns: list[str]) -> dict[str, np.ndarray]:
    with TrajectoryReader(pristine) as r:
        return {c: r.column(c) for c in columns}


def run(*argv: str) -> int:
    """One CLI command, as in a new process (which warns once about each damaged file)."""
    getattr(trajlog, "_WARNED", set()).clear()
    return main(list(argv))


def warned_step(caplog, path: Path) -> int:
    """The step from which the one warning line says data is lost."""
    lines = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    caplog.clear()
    assert len(lines) == 1, lines  # one warning, whatever the number of readers a command opens
    assert str(path) in lines[0]
    found = re.search(r"data from step (\d+) on is lost|none of its steps can be read", lines[0])
    assert found, lines[0]
    return int(found.group(1)) if found.group(1) else 0


@pytest.mark.parametrize("kind", ["truncate-0.5", "truncate-0.9", "flip-reward", "zero-tokens"])
def test_tools_read_every_step_before_the_damage(pristine, tmp_path, capsys, caplog, kind):
    path = damage(pristine, tmp_path / "run", kind)
    out_dir = tmp_path / "export"
    assert run("export", str(path), "--columns", "step", "reward", "response_ids", "--out", str(out_dir)) == 0
    lost_from = warned_step(caplog, path)
    assert 0 < lost_from < STEPS  # the damage is in the middle: the steps before it are read
    exported = pq.read_table(out_dir / "trajectories.parquet").to_pydict()
    before = original_rows(pristine, ["step", "reward"])
    keep = before["step"] < lost_from
    assert exported["step"] == before["step"][keep].tolist()  # every complete step before the damage, nothing else
    assert np.array_equal(np.array(exported["reward"], np.float32), before["reward"][keep])
    n = int(keep.sum())
    with TrajectoryReader(pristine) as r:  # the last row kept has its tokens whole
        assert exported["response_ids"][-1] == r.ragged_chunk("response_ids", n - 1, n)[1].tolist()
    steps_table = pq.read_table(out_dir / "steps.parquet").to_pydict()
    assert steps_table["step"] == list(range(lost_from))

    capsys.readouterr()
    assert run("analyze", str(path), "--json") == 0
    assert '"steps": ' + str(lost_from) in capsys.readouterr().out and warned_step(caplog, path) == lost_from
    assert run("samples", str(path), "--step", "0", "--best", "1") == 0
    assert warned_step(caplog, path) == lost_from
    if kind == "truncate-0.9":  # the figures too (slow: matplotlib)
        assert run("report", str(path), "--out", str(tmp_path / "report.html")) == 0
        assert warned_step(caplog, path) == lost_from
        assert run("plot", str(path), "--out", str(tmp_path / "plots")) == 0
        assert (tmp_path / "plots" / "reward.png").is_file()


def test_a_log_cut_to_a_few_bytes_is_one_line_not_a_traceback_or_a_hang(pristine, tmp_path):
    path = damage(pristine, tmp_path / "run", "truncate-0.0002")  # 40-odd bytes: inside the superblock
    # HDF5's SWMR reader used to retry the cut superblock for hours
    done = subprocess.run(
        [sys.executable, "-m", "rollout_hpc", "analyze", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and f"{path} is damaged beyond reading" in done.stderr


def test_reopening_a_damaged_log_keeps_it_aside_and_logs_each_step_once(pristine, tmp_path):
    """What every resume does (the ranks open the log with the checkpoint's step): the readable steps are kept,
    the steps after the checkpoint are logged again by the resumed run, the lost ones are named."""
    path = damage(pristine, tmp_path / "run", "truncate-0.9")
    with TrajectoryReader(path) as r:
        lost_from = int(r.lost_from_step)
    checkpoint_step = STEPS - 8  # the checkpoint covers steps 0..31; the run redoes 32..39
    log = TrajectoryLog.open_for_append(path, {}, resume_step=checkpoint_step - 1)
    repaired = log.reconciled["repaired"]
    assert repaired["lost"] == (lost_from, checkpoint_step - 1) and repaired["steps_kept"] == (0, lost_from - 1)
    aside = tmp_path / "run" / repaired["kept_as"]
    assert aside.is_file() and aside.read_bytes() == path.with_name(aside.name).read_bytes()
    rng = np.random.default_rng(1)
    from synthetic_trajectories import synthetic_batch

    for step in range(checkpoint_step, STEPS):  # the resumed run
        log.append(synthetic_batch(rng, PER_STEP, step), step)
        log.append_metrics(step, {})
    log.close()
    with TrajectoryReader(path) as r:
        assert r.damage is None
        steps = r.column("step")
        uids = list(zip(steps.tolist(), r.column("prompt_id").tolist(), r.column("sample_idx").tolist()))
        assert len(uids) == len(set(uids))  # nothing logged twice
        assert sorted(set(steps.tolist())) == list(range(lost_from)) + list(range(checkpoint_step, STEPS))
        assert r.metrics()["step"].tolist() == list(range(lost_from)) + list(range(checkpoint_step, STEPS))
        keep = original_rows(pristine, ["step", "reward"])
        n = int((keep["step"] < lost_from).sum())
        assert np.array_equal(r.column("reward", 0, n), keep["reward"][:n])

    few = damage(pristine, tmp_path / "few", "truncate-0.0002")  # used to raise IndexError in consistency_flags
    with TrajectoryLog.open_for_append(few, {"run_name": "x"}, resume_step=9) as log:
        assert log.reconciled == {} and log.rows == 0  # a new log; the old one kept aside
    assert len(list(few.parent.glob("trajectories.damaged-*.h5"))) == 1


def test_resume_continues_a_run_whose_log_is_truncated(tmp_path, finished_run):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    log = run_dir / "trajectories.h5"
    log.write_bytes(log.read_bytes()[: log.stat().st_size // 2])

    done = cli("resume", run_dir, "--local", "--set", "algorithm.steps=6", cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    line = next(line for line in output.splitlines() if "was damaged" in line)
    assert f"{log} was damaged (truncated: " in line and "kept it as trajectories.damaged-" in line
    assert "training state in the checkpoint is intact" in line
    lost = re.search(r"lost: the log rows of steps (\d+)\.\.(\d+)", line)
    assert lost and int(lost.group(2)) == 3  # the checkpoint covered steps 0..3
    assert len(list(run_dir.glob("trajectories.damaged-*.h5"))) == 1
    with TrajectoryReader(run_dir) as r:
        uids = list(zip(*(r.column(n).tolist() for n in ("step", "prompt_id", "sample_idx"))))
    assert len(uids) == len(set(uids))  # exactly once from the checkpoint on
    steps = {s for s, _, _ in uids}
    assert steps == set(range(int(lost.group(1)))) | {4, 5}
