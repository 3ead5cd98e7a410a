"""The run directory: what a run is, on disk, before any rank starts (the names: rollout_hpc.rundir_layout).

    RUN_DIR/
      config.yaml            the user's file, byte for byte (a snapshot: the original may change)
      config.resolved.yaml   the full validated config after --set; what every rank reads
      job.sbatch             the rendered job script (Slurm runs), or the script sbatch ran
      manifest.json          run name, creation time, config digest, launcher, job ids, version, host
      logs/                  slurm-<jobid>.out/.err, local-<n>.out
      data/                  a dataset task's rows, frozen: train.arrow, val.arrow (memory-mapped by the ranks)

A run directory appears complete or not at all: it is built in a hidden temporary directory
beside its final path and renamed into place.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from rollout_hpc import __version__
from rollout_hpc.config import Config
from rollout_hpc.envs.registry import check_task
from rollout_hpc.errors import ConfigError, UserError
from rollout_hpc.rundir_layout import (
    CHECKPOINTS,
    CONFIG_SNAPSHOT,
    DATA,
    JOB_SCRIPT,
    LOGS,
    MANIFEST,
    RESOLVED_CONFIG,
)
from rollout_hpc.store.atomic import is_disk_full, space_note


def now_utc() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def refuse_existing(run_dir: Path) -> None:
    """A new run never reuses a directory: that is what resume is for."""
    if (run_dir / MANIFEST).exists():
        raise UserError(
            f"run directory {run_dir} already holds a run (it has a {MANIFEST}). "
            f"To continue that run use `rollout-hpc resume {run_dir}`; to start a new one give it another name, "
            "e.g. --set run.name=NEW_NAME (or set run.dir)."
        )
    if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        raise UserError(
            f"{run_dir} exists and is not an empty directory or a run directory; "
            "choose another run.name or run.dir, or move it away"
        )


def create_run_dir(
    run_dir: Path,
    cfg: Config,
    config_file: Path | None,
    *,
    launcher: str,
    script: str | None,
    overrides: list[str],
    dry_run: bool = False,
) -> Path:
    """Write a complete run directory at run_dir atomically; returns its absolute path."""
    run_dir = Path(os.path.abspath(run_dir))
    refuse_existing(run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{run_dir.name}.", suffix=".tmp", dir=run_dir.parent))
    try:
        snapshot = config_file.read_bytes() if config_file else b"{}\n"
        (tmp / CONFIG_SNAPSHOT).write_bytes(snapshot)
        (tmp / RESOLVED_CONFIG).write_text(yaml.safe_dump(cfg.resolved(), sort_keys=False))
        if script is not None:
            (tmp / JOB_SCRIPT).write_text(script)
        (tmp / LOGS).mkdir()
        # A dataset task's rows are read, checked and frozen here (memory-mapped Arrow): errors before anything
        # is submitted, and every allocation of the run reads the same rows even if the source file changes.
        check_model_path(cfg.model.path)
        task = check_task(cfg)
        check_init_from(cfg.model.init_from)
        if callable(getattr(task, "freeze", None)):
            task.freeze(tmp / DATA)
        manifest = {
            "name": cfg.run.name,
            "created": now_utc(),
            "config_digest": cfg.digest(),
            "config_source": str(Path(config_file).resolve()) if config_file else None,
            "overrides": list(overrides),
            "launcher": launcher,
            "dry_run": dry_run,
            "job_ids": [],
            "local_runs": [],
            "rollout_hpc_version": __version__,
            "host": socket.gethostname(),
            "user": os.environ.get("USER") or str(os.getuid()),
        }
        _write_json(tmp / MANIFEST, manifest)
        os.chmod(tmp, int(cfg.run.dir_mode, 8))  # private (0700) unless run.dir_mode shares it with a group
        try:
            os.rename(tmp, run_dir)  # replaces an empty directory; fails on a non-empty one
        except OSError:
            refuse_existing(run_dir)  # someone else got there first: say so clearly
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return run_dir


def check_model_path(path: str | None) -> None:
    """model.path, checked on the login node without loading it: a directory with config.json and tokenizer files."""
    if path is None:
        return
    where = Path(path).expanduser()
    if not where.is_dir():
        raise ConfigError(
            f"model.path {path} is not a directory; download the model first (README: compute nodes "
            "without internet) or remove model.path for the built-in tiny model"
        )
    missing = [name for name in ("config.json",) if not (where / name).is_file()]
    if not any(where.glob("tokenizer*")):
        missing.append("tokenizer files (tokenizer.json or tokenizer_config.json)")
    if missing:
        raise ConfigError(f"model.path {path} is not a Hugging Face model directory: it has no {', '.join(missing)}")


def check_init_from(spec: str | None) -> None:
    """What submit and validate check of model.init_from, without reading weights (nor importing torch): a run
    directory with checkpoints, or one checkpoint file. The ranks read and verify it (models.export.init_weights)."""
    if not spec:
        return
    path = Path(spec).expanduser()
    if re.fullmatch(r"step-\d+(\.h5)?", path.name) and path.parent.name == CHECKPOINTS:
        if not path.exists():
            raise ConfigError(f"model.init_from {spec}: no such checkpoint")
    elif not path.is_dir():
        raise ConfigError(
            f"model.init_from {spec}: no such run directory or checkpoint (RUN_DIR/{CHECKPOINTS}/step-N.h5)"
        )
    elif not any((path / CHECKPOINTS).glob("step-*")):
        raise ConfigError(f"model.init_from {spec}: that run has no checkpoints ({path / CHECKPOINTS} is empty)")


def remove_run_dir(run_dir: Path) -> None:
    shutil.rmtree(run_dir, ignore_errors=True)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)  # a full disk must not leave a 0-byte temporary manifest behind
        if is_disk_full(exc):
            raise UserError(f"cannot write {path}: {space_note(path.parent)}; free space there") from None
        raise


def read_manifest(run_dir: Path) -> dict[str, Any]:
    path = Path(run_dir) / MANIFEST
    if not path.is_file():
        raise UserError(f"{run_dir} is not a run directory: it has no {MANIFEST} (made by `rollout-hpc submit`)")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} is damaged ({exc}); restore it, or start a new run") from None


@contextlib.contextmanager
def _manifest_lock(run_dir: Path) -> Iterator[None]:
    # The CLI and a job script (plain sbatch) may both record job ids at once.
    with open(Path(run_dir) / ".manifest.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def update_manifest(run_dir: Path, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Read, change in place, and atomically rewrite the manifest; returns the new one."""
    with _manifest_lock(run_dir):
        manifest = read_manifest(run_dir)
        change(manifest)
        _write_json(Path(run_dir) / MANIFEST, manifest)
        return manifest


def add_job_ids(run_dir: Path, job_ids: list[str]) -> dict[str, Any]:
    def add(manifest: dict[str, Any]) -> None:
        manifest["dry_run"] = False
        for job_id in job_ids:
            if job_id not in manifest["job_ids"]:
                manifest["job_ids"].append(job_id)

    return update_manifest(run_dir, add)
