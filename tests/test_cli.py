"""The rollout-hpc command line, run as a user runs it: a subprocess, exit codes, files it leaves."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollout_hpc.config import load_config

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "configs" / "smoke.yaml"
HELLO = REPO / "configs" / "hello.yaml"


def cli(*args: str, cwd: Path, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rollout_hpc", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def assert_user_error(done: subprocess.CompletedProcess, *needles: str) -> None:
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    for needle in needles:
        assert needle in done.stderr, done.stderr


def test_help_teaches(tmp_path):
    done = cli("--help", cwd=tmp_path)
    assert done.returncode == 0
    for command in ("validate", "schema", "render", "submit", "status", "cancel", "examples:"):
        assert command in done.stdout
    sub = cli("submit", "--help", cwd=tmp_path)
    assert sub.returncode == 0 and "--chain" in sub.stdout and "examples:" in sub.stdout


def test_console_script_is_installed(tmp_path):
    exe = Path(sys.executable).with_name("rollout-hpc")
    done = subprocess.run([str(exe), "--version"], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0 and "rollout-hpc" in done.stdout


def test_validate_ok_and_summarizes(tmp_path):
    done = cli("validate", str(QUICKSTART), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "is valid" in done.stdout and "world of 2 ranks" in done.stdout


def test_validate_error_is_one_paragraph_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run:\n  name: x\ntrainer:\n  nodes: 0\n  gpus: 2\n")
    done = cli("validate", str(bad), cwd=tmp_path)
    assert_user_error(done, "trainer.nodes (line 4)", "trainer.gpus (line 5)", "unknown key")
    debug = cli("validate", str(bad), "--debug", cwd=tmp_path)
    assert debug.returncode == 2 and "Traceback" in debug.stderr


def test_set_errors_are_flagged(tmp_path):
    assert_user_error(
        cli("validate", str(QUICKSTART), "--set", "algorithm.steps=lots", cwd=tmp_path), "algorithm.steps (from --set)"
    )
    assert_user_error(cli("render", str(QUICKSTART), "--set", "nonsense", cwd=tmp_path), "KEY.PATH=VALUE")


def test_schema(tmp_path):
    table = cli("schema", "slurm", cwd=tmp_path)
    assert table.returncode == 0 and "slurm.signal_lead_seconds" in table.stdout
    schema = json.loads(cli("schema", "--format", "json", cwd=tmp_path).stdout)
    assert "slurm" in schema["properties"]
    defaults = tmp_path / "defaults.yaml"
    defaults.write_text(cli("schema", "--format", "defaults", cwd=tmp_path).stdout)
    assert load_config(defaults).digest() == load_config(None).digest()
    assert_user_error(cli("schema", "slurmm", cwd=tmp_path), "no config section 'slurmm'")


def test_render_passes_bash_n(tmp_path):
    done = cli("render", str(HELLO), "--set", "slurm.partition=debug", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "#SBATCH --partition=debug" in done.stdout
    script = tmp_path / "job.sbatch"
    script.write_text(done.stdout)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    assert not (tmp_path / "runs").exists()  # render creates nothing


def test_dry_run_creates_complete_run_dir(tmp_path):
    done = cli("submit", str(HELLO), "--dry-run", "--set", "launcher=slurm", "--set", "algorithm.steps=3", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    run_dir = tmp_path / "runs" / "hello"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["dry_run"] is True and manifest["launcher"] == "slurm" and manifest["job_ids"] == []
    assert manifest["name"] == "hello" and manifest["overrides"] == ["launcher=slurm", "algorithm.steps=3"]
    assert (run_dir / "config.yaml").read_bytes() == HELLO.read_bytes()
    resolved = load_config(run_dir / "config.resolved.yaml")
    assert resolved.algorithm.steps == 3 and resolved.digest() == manifest["config_digest"]
    assert f"ROLLOUT_RUN_DIR={run_dir}" in (run_dir / "job.sbatch").read_text()
    assert str(run_dir / "job.sbatch") in done.stdout
    assert not [p for p in (tmp_path / "runs").iterdir() if p.name.startswith(".")]  # no temporary left


def test_run_directory_is_private_unless_shared_with_a_group(tmp_path):
    """run.dir_mode: 0700 by default (checkpoints, logs and data are the user's own); 0750 shares with the group;
    a mode that locks the owner out is refused before anything is made."""
    for mode, expected in ((None, 0o700), ("0750", 0o750), ("2770", 0o2770)):
        name = f"m{expected:o}"
        extra = ["--set", f"run.dir_mode={mode}"] if mode else []
        done = cli(
            "submit",
            str(HELLO),
            "--dry-run",
            "--set",
            "launcher=slurm",
            "--set",
            f"run.name={name}",
            *extra,
            cwd=tmp_path,
        )
        assert done.returncode == 0, done.stderr
        assert stat.S_IMODE((tmp_path / "runs" / name).stat().st_mode) == expected
    done = cli("submit", str(HELLO), "--dry-run", "--set", "run.dir_mode=0600", "--set", "run.name=bad", cwd=tmp_path)
    assert_user_error(done, "run.dir_mode", "'600' is not an octal mode that leaves the run's owner rwx")
    assert not (tmp_path / "runs" / "bad").exists()


def test_existing_run_dir_is_refused(tmp_path):
    args = ("submit", str(HELLO), "--dry-run", "--set", "launcher=slurm")
    assert cli(*args, cwd=tmp_path).returncode == 0
    before = (tmp_path / "runs" / "hello" / "manifest.json").read_text()
    assert_user_error(cli(*args, cwd=tmp_path), "already holds a run", "rollout-hpc resume", "run.name")
    assert (tmp_path / "runs" / "hello" / "manifest.json").read_text() == before


def test_missing_sbatch_is_clear_and_creates_nothing(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path / "empty-bin"))  # no sbatch, no mpirun
    done = cli("submit", str(HELLO), "--set", "launcher=slurm", cwd=tmp_path, env=env)
    assert_user_error(done, "sbatch", "--local")
    assert not (tmp_path / "runs").exists()


def test_auto_launcher_without_sbatch_is_local(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path / "empty-bin"))
    done = cli("submit", str(HELLO), "--dry-run", cwd=tmp_path, env=env)  # launcher: auto in hello.yaml
    assert_user_error(done, "mpirun")  # local needs mpirun, and says so
    assert not (tmp_path / "runs").exists()
    done = cli("submit", str(HELLO), "--dry-run", cwd=tmp_path)
    manifest = json.loads((tmp_path / "runs" / "hello" / "manifest.json").read_text())
    assert manifest["launcher"] == "slurm"  # sbatch is on this machine's PATH


def test_status_and_cancel_of_a_dry_run(tmp_path):
    assert cli("submit", str(HELLO), "--dry-run", "--set", "launcher=slurm", cwd=tmp_path).returncode == 0
    status = cli("status", "runs/hello", "--json", cwd=tmp_path)
    assert status.returncode == 0 and json.loads(status.stdout)["dry_run"] is True
    assert_user_error(cli("cancel", "runs/hello", cwd=tmp_path), "no job to cancel")
    assert_user_error(cli("status", "nowhere", cwd=tmp_path), "not a run directory")


def test_local_hello_runs_layout_under_mpirun(tmp_path):
    done = cli("submit", str(HELLO), "--local", cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    hello = [dict(kv.split("=") for kv in l.split()[1:]) for l in done.stdout.splitlines() if l.startswith("HELLO ")]
    layout = sorted((h["rank"], h["role"], h["node"]) for h in hello)
    assert layout == [("0", "generator", "gen0"), ("1", "trainer", "train0"), ("2", "trainer", "train1")]
    run_dir = tmp_path / "runs" / "hello"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["launcher"] == "local" and manifest["local_runs"][0]["exit_code"] == 0
    log = Path(manifest["local_runs"][0]["log"]).read_text()
    assert log.count("HELLO rank=") == 3  # the log holds the same rank output
    status = json.loads(cli("status", str(run_dir), "--json", cwd=tmp_path).stdout)
    assert status["local_runs"][0]["state"] == "ENDED (exit 0)"


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                pids.append(int(proc.name))
        except OSError:
            pass
    return pids


@pytest.mark.parametrize("stop", ["sigterm", "cancel"])
def test_local_run_stops_and_leaves_no_ranks(tmp_path, stop):
    """SIGTERM to the foreground launcher, or `rollout-hpc cancel RUN_DIR` from elsewhere, reaches mpirun,
    which ends every rank; the exit is recorded."""
    run_dir = tmp_path / "runs" / "stopme"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollout_hpc",
            "submit",
            str(QUICKSTART),
            "--set",
            "run.name=stopme",
            "--set",
            "algorithm.steps=100000",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    while len(_processes_mentioning(f"--run-dir {run_dir}")) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)  # mpirun and both ranks are up
    assert proc.poll() is None, proc.stdout.read()
    if stop == "sigterm":
        proc.send_signal(signal.SIGTERM)
    else:
        cancel = cli("cancel", str(run_dir), cwd=tmp_path)
        assert cancel.returncode == 0 and "SIGTERM to mpirun" in cancel.stdout, cancel.stdout + cancel.stderr
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, out
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["local_runs"][0]["exit_code"] not in (None, 0)
    deadline = time.monotonic() + 30
    while _processes_mentioning(f"--run-dir {run_dir}") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_mentioning(f"--run-dir {run_dir}") == []


def test_local_run_failure_returns_mpiruns_code(tmp_path):
    # A directory that passes the login-node check (config.json, tokenizer files) but is no model: the ranks fail.
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"model_type": "nonsense-model"}')
    (tmp_path / "broken" / "tokenizer_config.json").write_text("{}")
    done = cli(
        "submit", str(QUICKSTART), "--local", "--set", f"model.path={tmp_path / 'broken'}", cwd=tmp_path, timeout=300
    )
    manifest = json.loads((tmp_path / "runs" / "smoke" / "manifest.json").read_text())
    recorded = manifest["local_runs"][0]["exit_code"]
    assert recorded not in (None, 0) and done.returncode == recorded
    assert f"mpirun exited with code {recorded}" in done.stdout


def test_chain_needs_slurm(tmp_path):
    assert_user_error(cli("submit", str(QUICKSTART), "--chain", "2", cwd=tmp_path), "--chain")
    assert not (tmp_path / "runs").exists()


def test_allocation_layout_from_slurm_environment():
    from rollout_hpc.commands.prepare import allocation_layout
    from rollout_hpc.config import UserError

    env = {
        "SLURM_HET_SIZE": "2",
        "SLURM_JOB_NUM_NODES_HET_GROUP_0": "1",
        "SLURM_TASKS_PER_NODE_HET_GROUP_0": "4",
        "SLURM_JOB_NUM_NODES_HET_GROUP_1": "3",
        "SLURM_TASKS_PER_NODE_HET_GROUP_1": "2(x3)",
    }
    assert allocation_layout(env) == [
        "generator.nodes=1",
        "generator.tasks_per_node=4",
        "trainer.nodes=3",
        "trainer.tasks_per_node=2",
    ]
    with pytest.raises(UserError, match="uneven"):
        allocation_layout(dict(env, SLURM_TASKS_PER_NODE_HET_GROUP_1="2(x2),1"))
    with pytest.raises(UserError, match="hetjob"):
        allocation_layout({"SLURM_HET_SIZE": "1"})


def test_local_run_passes_the_warning_signal_to_every_rank(tmp_path):
    """SIGUSR1 to the foreground launcher -> mpirun -> ranks, which checkpoint and exit EXIT_CONTINUE (75)."""
    from rollout_hpc.launch import EXIT_CONTINUE

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollout_hpc",
            "submit",
            str(QUICKSTART),
            "--set",
            "run.name=warned",
            "--set",
            "algorithm.steps=100000",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    for line in proc.stdout:  # wait until training is under way, so every rank has its handlers
        lines.append(line)
        if line.startswith("step 2/"):
            proc.send_signal(signal.SIGUSR1)
            break
    out = "".join(lines) + proc.communicate(timeout=180)[0]
    assert proc.returncode == EXIT_CONTINUE, out
    manifest = json.loads((tmp_path / "runs" / "warned" / "manifest.json").read_text())
    assert manifest["local_runs"][0]["exit_code"] == EXIT_CONTINUE
    assert "rollout-hpc resume" in out
