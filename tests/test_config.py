"""The typed config: every mistake is named with its field, its line (or --set) and a fix."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from rollout_hpc.config import Config, ConfigError, load_config, parse_slurm_time

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def error_of(path, overrides=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides or [])
    return str(info.value)


def test_defaults_are_valid_and_digest_is_stable():
    a, b = load_config(None), load_config(None)
    assert a.digest() == b.digest()
    assert a.world_size == a.generator.ranks + a.trainer.ranks
    assert load_config(None, ["run.seed=1"]).digest() != a.digest()


def test_unknown_key_names_field_and_line(tmp_path):
    path = write(
        tmp_path,
        """\
        run:
          name: x
        algorithm:
          steps: 3
          stepz: 4
        """,
    )
    msg = error_of(path)
    assert "algorithm.stepz (line 5)" in msg
    assert "unknown key" in msg and "rollout-hpc schema" in msg


@pytest.mark.parametrize(
    "text,expected",
    [
        pytest.param("trainers:\n  nodes: 2\n", ["trainers (line 1)", "unknown key"], id="unknown_section"),
        pytest.param(
            "run:\n  name: x\ntrainer:\n  nodes: two\n",
            ["trainer.nodes (line 4)", "integer"],
            id="wrong_type_names_field_and_line",
        ),
        pytest.param(
            "generator:\n  nodes: 0\n", ["generator.nodes (line 2)", "at least 1"], id="zero_nodes_refused_with_reason"
        ),
        pytest.param(
            "slurm:\n  gpus_per_node: 4\ntrainer:\n  tasks_per_node: 8\n  gpus_per_task: 1\n",
            ["8 GPUs per node", "slurm.gpus_per_node is 4"],
            id="too_many_gpus_per_node",
        ),
        pytest.param(
            "slurm:\n  time: '00:01:00'\n  signal_lead_seconds: 120\n",
            ["slurm.time", "signal_lead_seconds"],
            id="time_must_exceed_signal_lead",
        ),
        pytest.param("slurm:\n  time: soon\n", ["slurm.time (line 2)", "HH:MM:SS"], id="bad_slurm_time_syntax"),
        pytest.param(
            "slurm: {gpus_per_node: 4}\ntrainer: {backend: megatron, gpus_per_task: 1, pipeline_parallel: 2}\n",
            ["trainer.pipeline_parallel > 1 is not wired", "trainer.tensor_parallel"],
            id="megatron_pipeline_parallel",
        ),
    ],
)
def test_invalid_config_is_named(tmp_path, text, expected):
    msg = error_of(write(tmp_path, text))
    for part in expected:
        assert part in msg


@pytest.mark.parametrize(
    "text,seconds",
    [("30", 1800), ("01:30", 90), ("02:00:00", 7200), ("1-00:00:00", 86400), ("1-2", 93600), ("1-02:03", 93780)],
)
def test_parse_slurm_time(text, seconds):
    assert parse_slurm_time(text) == seconds


def test_bad_yaml_reports_line(tmp_path):
    msg = error_of(write(tmp_path, "run:\n  name: x\n  seed: [1, 2\nmodel: {}\n"))
    assert "not valid YAML" in msg and "line" in msg
    assert str(tmp_path / "run.yaml") in msg


def test_top_level_must_be_mapping(tmp_path):
    assert "top level must be a mapping" in error_of(write(tmp_path, "- a\n- b\n"))


def test_missing_file():
    assert "not found" in error_of("/nonexistent/run.yaml")


def test_set_overrides_apply_with_yaml_types(tmp_path):
    path = write(tmp_path, "algorithm:\n  steps: 3\n")
    cfg = load_config(
        path,
        [
            "algorithm.steps=7",
            "slurm.modules=[gcc/12, cuda/12]",
            "trainer.mem=64G",
            "slurm.container={image: a.sif, runtime: apptainer}",
        ],
    )
    assert cfg.algorithm.steps == 7
    assert cfg.slurm.modules == ["gcc/12", "cuda/12"]
    assert cfg.trainer.mem == "64G"
    assert cfg.slurm.container.runtime == "apptainer"


def test_set_type_error_is_flagged_from_set(tmp_path):
    path = write(tmp_path, "trainer:\n  nodes: 2\n")
    msg = error_of(path, ["trainer.nodes=many"])
    assert "trainer.nodes (from --set)" in msg and "line" not in msg.split("trainer.nodes")[1].splitlines()[0]


def test_set_unknown_key_is_flagged_from_set():
    msg = error_of(None, ["algorithm.stpes=3"])
    assert "algorithm.stpes (from --set)" in msg and "unknown key" in msg


@pytest.mark.parametrize("bad", ["algorithm.steps", "=3", "run.name.x=1"])
def test_malformed_set(bad):
    assert "--set" in error_of(None, [bad])


def test_env_names_must_be_shell_names():
    assert "environment variable name" in error_of(None, ["slurm.env={'A-B': x}"])


def test_extra_sbatch_must_be_options():
    assert "--mail-type=END" in error_of(None, ["slurm.extra_sbatch=[mail-type=END]"])


def test_run_dir_expands_variables(monkeypatch):
    monkeypatch.setenv("SCRATCH", "/scratch/me")
    assert str(load_config(None, ["run.dir=$SCRATCH/runs/a"]).run.resolved_dir()) == "/scratch/me/runs/a"


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(REPO / "configs" / "examples" / "grpo-7b-vllm-deepspeed.yaml")
    path = tmp_path / "config.resolved.yaml"
    path.write_text(yaml.safe_dump(cfg.resolved()))
    assert load_config(path).digest() == cfg.digest()


def test_every_shipped_config_is_valid():
    configs = sorted((REPO / "configs").rglob("*.yaml"))
    assert len(configs) >= 6
    for path in configs:
        assert isinstance(load_config(path), Config), path
