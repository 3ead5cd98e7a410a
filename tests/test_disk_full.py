"""A full file system is a clear message, not `[Errno 28]` under h5py tracebacks: it names the file, the file system
and the space a checkpoint needs; a checkpoint that cannot fit is refused before anything is written, one that
runs out of space mid-write leaves nothing partial; the launcher lives on to record the exit; after space is
freed, `resume` continues exactly once. Real tmpfs file systems (mounted as root), a real local run."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_resume_local import assert_exactly_once, cli, write_run_config

from rollout_hpc.errors import UserError
from rollout_hpc.launch import rundir
from rollout_hpc.store import checkpoint

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


@pytest.fixture
def small_fs(tmp_path):
    """A 20 MB tmpfs, unmounted afterwards."""
    mount = tmp_path / "fs"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(mount: Path, leave: int) -> Path:
    """A filler file that leaves `leave` bytes free (or none: a live run writing beside it can take the last of
    the space between the measure and the write, which is a full file system all the same)."""
    filler = mount / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        todo = max(0, shutil.disk_usage(mount).free - leave)
        chunk = b"\0" * (1 << 20)
        while todo > 0:
            try:
                todo -= os.write(fd, chunk[: min(todo, len(chunk))])
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                break
    finally:
        os.close(fd)
    return filler


def leftovers(directory: Path) -> list[str]:
    return [p.name for p in directory.rglob("*") if ".tmp" in p.name]


def test_a_checkpoint_that_cannot_fit_is_refused_and_one_cut_short_leaves_nothing(small_fs, caplog):
    run_dir = small_fs / "run"
    run_dir.mkdir()
    big = {"model": {"w": np.ones(2_000_000, np.float32)}}  # 8 MB
    checkpoint.save_checkpoint(run_dir, 1, {"model": {"w": np.ones(10, np.float32)}})
    fill(small_fs, 8_000_000 + 4096)  # the raw bytes fit, the file (metadata too) does not
    with pytest.raises(UserError) as cut:
        checkpoint.save_checkpoint(run_dir, 2, big)
    text = str(cut.value)
    assert f"ran out of space writing checkpoint {run_dir}/checkpoints/step-00000002.h5" in text
    assert f"file system {small_fs} (tmpfs)" in text and "needs about 8.00 MB" in text
    assert f"rollout-hpc resume {run_dir}" in text
    assert leftovers(run_dir) == [] and [c.step for c in checkpoint.list_checkpoints(run_dir)] == [1]

    (small_fs / "filler").unlink()
    with caplog.at_level(logging.WARNING, "rollout_hpc.store.checkpoint"):
        checkpoint.save_checkpoint(run_dir, 2, big)  # fits, but two more of its size would not: warned early
    warned = [r.getMessage() for r in caplog.records if "little space left for checkpoints" in r.getMessage()]
    assert (
        len(warned) == 1 and f"file system {small_fs} (tmpfs)" in warned[0] and "step-00000002.h5 is 8.0" in warned[0]
    )
    fill(small_fs, 6_000_000)
    with pytest.raises(UserError) as refused:
        checkpoint.save_checkpoint(run_dir, 3, big)  # refused before a byte is written
    assert f"not enough space for checkpoint {run_dir}/checkpoints/step-00000003.h5" in str(refused.value)
    assert "(the previous checkpoint, step-00000002.h5, is 8.0" in str(refused.value)
    assert leftovers(run_dir) == []

    # the manifest on a file system with no room at all: a clear error, the old manifest intact, no 0-byte temp file
    (run_dir / "manifest.json").write_text('{"name": "x"}\n')
    fill(small_fs, 0)
    with pytest.raises(UserError, match=f"cannot write {run_dir}/manifest.json: file system {small_fs} "):
        rundir.update_manifest(run_dir, lambda m: m.update(padding="x" * 65536))
    assert rundir.read_manifest(run_dir) == {"name": "x"} and leftovers(run_dir) == []


def test_a_run_that_fills_its_disk_says_so_records_its_exit_and_resumes_exactly_once(small_fs, tmp_path):
    steps = 9
    config = write_run_config(tmp_path, "full", steps=steps, sleep=0.1)  # checkpoints after steps 3 and 6
    run_dir = small_fs / "run"
    first = run_dir / "checkpoints" / "step-00000003.h5"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout_hpc", "submit", str(config), "--local", "--run-dir", str(run_dir)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 240
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    filler = fill(small_fs, first.stat().st_size // 2)  # the step-6 checkpoint cannot fit
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 2, output[-3000:]
    assert f"not enough space for checkpoint {run_dir}/checkpoints/step-00000006.h5: it needs about " in output, output
    assert "(the previous checkpoint, step-00000003.h5, is " in output
    assert f"file system {small_fs} (tmpfs): " in output and "Traceback" not in output and "Errno 28" not in output
    record = json.loads((run_dir / "manifest.json").read_text())["local_runs"][-1]
    assert record["exit_code"] == 2  # the launcher lived on to record it
    status = cli("status", run_dir, cwd=tmp_path)
    assert "LOST" not in status.stdout + status.stderr
    assert leftovers(run_dir) == []  # no .tmp checkpoint, no 0-byte .manifest.json.tmp*

    filler.unlink()
    done = cli("resume", run_dir, "--local", cwd=tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert f"resuming from step-00000003.h5: step 3 of {steps}" in done.stdout
    assert_exactly_once(run_dir, steps=steps)


FILL_THE_LOG = """
import sys
import numpy as np
from synthetic_trajectories import synthetic_batch
from rollout_hpc.errors import UserError
from rollout_hpc.store.trajlog import TrajectoryLog
log = TrajectoryLog.open_for_append(sys.argv[1], {})
rng = np.random.default_rng(0)
try:
    for step in range(1000):
        log.append(synthetic_batch(rng, 2000, step), step)
        log.append_metrics(step, {})
except UserError as exc:
    print(exc)
"""


def test_the_trajectory_log_stops_with_a_message_before_the_disk_is_full(small_fs, repo_root):
    """HDF5 writing into a full disk prints h5py destructor tracebacks and may crash the process."""
    done = subprocess.run(
        [sys.executable, "-c", FILL_THE_LOG, str(small_fs / "run")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(repo_root / "tests"), os.environ.get("PYTHONPATH", "")])},
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert f"no space left to log trajectories to {small_fs}/run/trajectories.h5: file system {small_fs} (tmpfs)" in (
        done.stdout
    )
