"""Every example config under configs/examples loads and renders a job script bash accepts; the multi-domain
(math + code) example passes `rollout-hpc validate` against the sample data shipped beside it; `--set` addresses
list items (a mixture's sources) by index."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rollout_hpc.config import ConfigError, load_config
from rollout_hpc.launch.render import render_script

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "configs" / "examples").glob("*.yaml"))
DATA = REPO / "configs" / "examples" / "data"


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_loads_and_renders(path, tmp_path):
    cfg = load_config(path, [f"run.dir={tmp_path / 'run'}"])
    script = render_script(cfg, tmp_path / "run")
    (tmp_path / "job.sbatch").write_text(script)
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")]).returncode == 0
    assert "#SBATCH" in script
    # One component per group (a reward or environment group: one more); colocated: one for generators and trainers
    components = 1 if cfg.placement == "colocated" else len(cfg.het_groups)
    assert script.count("#SBATCH hetjob") == components - 1


def test_mixture_example_validates_on_the_sample_data(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_hf import make_tiny_qwen

    model = make_tiny_qwen(tmp_path / "model")
    sets = {
        "model.path": model,
        "run.dir": tmp_path / "run",
        "task.params.train[0].path": DATA / "math-word-problems.jsonl",
        "task.params.train[1].path": DATA / "code-problems.jsonl",
        "task.params.train[1].answer_key": "tests",
        "task.params.val[0].path": DATA / "math-word-problems.jsonl",
        "task.params.val.1.path": DATA / "code-problems.jsonl",  # the dotted index form
        "task.params.val[1].answer_key": "tests",
    }
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollout_hpc",
            "validate",
            str(REPO / "configs/examples/grpo-math-code-mix.yaml"),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    # The quotas of 16 prompts a step at weights 3:1, and both sources' sizes, are reported.
    assert "math 16 rows, 12 a step" in done.stdout and "code 8 rows, 4 a step" in done.stdout


def test_set_addresses_list_items_by_index(tmp_path):
    path = REPO / "configs/examples/grpo-math-code-mix.yaml"
    cfg = load_config(path, ["task.params.train[1].weight=3", "task.params.train.0.path=/x.jsonl"])
    train = cfg.task.params["train"]
    assert train[1]["weight"] == 3 and train[0]["path"] == "/x.jsonl"
    with pytest.raises(ConfigError, match=r"'train' has 2 item\(s\), so no item \[2\]"):
        load_config(path, ["task.params.train[2].path=/x"])
    with pytest.raises(ConfigError, match="'model' is not a list"):
        load_config(path, ["model[0]=x"])
