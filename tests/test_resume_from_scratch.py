"""A resume with no valid checkpoint left never restarts from step 0 silently over a logged run: it is refused with
the number of logged steps, and `--from-scratch` starts again while keeping the old log aside. Real local runs."""

from __future__ import annotations

import shutil

from test_resume_local import assert_exactly_once, cli

from rollout_hpc.store.trajlog import TrajectoryReader


def test_no_checkpoint_left_refuses_then_from_scratch_keeps_the_old_log(tmp_path, finished_run):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    shutil.rmtree(run_dir / "checkpoints")  # deleted by hand (or every one damaged and set aside by a first resume)
    (run_dir / "checkpoints").mkdir()

    refused = cli("resume", run_dir, "--local", cwd=tmp_path)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "4 logged steps" in refused.stderr and "--from-scratch" in refused.stderr
    with TrajectoryReader(run_dir) as r:
        assert r.metric_rows == 4  # nothing was touched

    again = cli("resume", run_dir, "--local", "--from-scratch", "--set", "algorithm.steps=4", cwd=tmp_path)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    kept = list(run_dir.glob("trajectories.discarded-*.h5"))
    assert len(kept) == 1
    with TrajectoryReader(kept[0]) as r:
        assert r.metric_rows == 4  # the old log, whole
    assert_exactly_once(run_dir, steps=4)  # the new log: the run from step 0, each sample once
