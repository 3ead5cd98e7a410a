"""Fewer prompt groups than trainer ranks (one prompt a step, two trainer ranks; or DAPO keeping few groups): the rank
without a share still takes part in the step's collectives, and the run finishes. A real local run."""

from __future__ import annotations

from pathlib import Path

from test_resume_local import cli

REPO = Path(__file__).resolve().parents[1]


def test_a_trainer_rank_without_groups_keeps_in_step(tmp_path):
    done = cli(
        "submit",
        REPO / "configs" / "smoke.yaml",
        "--set",
        "run.name=uneven",
        "--set",
        "algorithm.steps=3",
        "--set",
        "algorithm.prompts_per_step=1",
        "--set",
        "trainer.tasks_per_node=2",
        "--set",
        "eval=null",
        "--set",
        "warmup.sft_steps=2",
        "--set",
        "warmup.batch_size=1",
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "step 5/5" in done.stdout
