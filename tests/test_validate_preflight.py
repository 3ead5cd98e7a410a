"""What `rollout-hpc validate` (and `submit`, before anything is created) catch on the login node, each with the field,
the value and the fix: configs that used to pass validation and fail only after the queue wait (issue: reliability)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "configs" / "smoke.yaml"


def validate(*overrides: str, cwd: Path) -> subprocess.CompletedProcess:
    args = [a for o in overrides for a in ("--set", o)]
    return subprocess.run(
        [sys.executable, "-m", "rollout_hpc", "validate", str(QUICKSTART), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "override, says",
    [
        ("algorithm.group_size=1", "group_size to at least 2"),
        ("algorithm.max_new_tokens=100", "model.max_seq_len"),
        ("model.path=/nonexistent/model", "model.path /nonexistent/model is not a directory"),
        ("task.name=data/train.jsonl", "not a built-in task"),
        ("task.params.max_operand=-3", "max_operand must be an integer >= 1"),
        ("task.reward=missing_file.py:reward", "missing_file.py"),
        ("run.dir=$ROLLOUT_SURELY_UNSET/x", "$ROLLOUT_SURELY_UNSET is not set"),
        ("model.init_from=/nonexistent/run", "model.init_from"),
    ],
)
def test_refused_with_the_field_and_the_fix(tmp_path, override, says):
    done = validate(override, cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert says in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_model_directory_without_config_is_named(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "tokenizer.json").write_text("{}")
    done = validate(f"model.path={tmp_path / 'm'}", cwd=tmp_path)
    assert done.returncode == 2 and "no config.json" in done.stderr


def test_a_failed_submit_leaves_no_run_directory(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "rollout_hpc", "submit", str(QUICKSTART), "--set", "model.path=/nonexistent/model"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "model.path" in done.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_the_cli_starts_without_torch():
    """Every subcommand's module is imported to build --help: none may pull torch (seconds on a login node)."""
    code = (
        "import sys\nfrom rollout_hpc import cli\ntry:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip().endswith("False"), done.stdout + done.stderr
