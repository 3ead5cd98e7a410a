"""No config value leaves its line in the rendered job script: property test over random strings in every field that
reaches the script (hypothesis), checked with `bash -n` and a parse of the #SBATCH block; and the found injection
(`--set 'slurm.account="x\\ntouch /tmp/pwned"'`) is refused by validate with the field named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_hpc.config import ConfigError, load_config
from rollout_hpc.errors import UserError
from rollout_hpc.launch.render import render_script

# Every field that reaches the job script, with a value it accepts (the script's shape with a harmless value).
BENIGN = {
    "slurm.partition": "p",
    "slurm.account": "a",
    "slurm.qos": "q",
    "slurm.constraint": "c",
    "slurm.python": "py",
    "slurm.container.image": "img",
    "generator.mem": "1G",
    "generator.partition": "p",
    "generator.constraint": "c",
    "trainer.mem": "1G",
    "trainer.partition": "p",
    "trainer.constraint": "c",
    "slurm.extra_sbatch.0": "--x=1",
    "slurm.modules.0": "m",
    "slurm.env.FOO": "v",
    "slurm.container.mounts.0": "/a:/b",
}
FIELDS = list(BENIGN)


def config_with(field: str, value: str):
    data: dict = {"slurm": {"container": {"image": "img.sqsh"}}}
    parts = field.split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    if parts[-1] == "0":  # a list field
        parent = data
        for part in parts[:-2]:
            parent = parent[part]
        parent[parts[-2]] = [value]
    else:
        node[parts[-1]] = value
    from rollout_hpc.config import Config

    return Config.model_validate(data)


@settings(max_examples=400, deadline=None)
@given(field=st.sampled_from(FIELDS), value=st.text(min_size=1, max_size=40))
def test_no_value_ever_leaves_its_line(field, value):
    from pydantic import ValidationError

    try:
        script = render_script(config_with(field, value), Path("/tmp/run"))
    except (ValidationError, UserError):
        return  # refused, with the field named
    baseline = render_script(config_with(field, BENIGN[field]), Path("/tmp/run")).split("\n")
    lines = script.split("\n")
    # The value stayed on its line: the same number of lines, of #SBATCH lines, and of shell lines as with a
    # harmless value, and bash parses the script.
    assert len(lines) == len(baseline), (field, value)
    for kind in ("#SBATCH", "#"):
        assert sum(line.startswith(kind) for line in lines) == sum(line.startswith(kind) for line in baseline)
    syntax = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert syntax.returncode == 0, (field, value, syntax.stderr)


def test_the_found_injection_is_refused_with_the_field_named(tmp_path):
    for override in (
        'slurm.account="x\\ntouch /tmp/pwned"',
        'generator.mem="64G\\nid"',
        'slurm.extra_sbatch=["--x=1\\nid"]',
    ):
        with pytest.raises(ConfigError, match=override.split("=")[0]):
            load_config(None, [override])
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollout_hpc",
            "validate",
            "--set",
            'slurm.account="x\\ntouch /tmp/pwned"',
            str(Path(__file__).parents[1] / "configs" / "smoke.yaml"),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "slurm.account" in done.stderr and "Traceback" not in done.stderr


def test_run_dir_with_an_unset_variable_is_named(monkeypatch):
    monkeypatch.delenv("ROLLOUT_TEST_UNSET", raising=False)
    cfg = load_config(None, ["run.dir=$ROLLOUT_TEST_UNSET/runs/x"])
    with pytest.raises(ConfigError, match=r"\$ROLLOUT_TEST_UNSET is not set"):
        cfg.run.resolved_dir()
