"""What a run directory says beside its trajectory log: the resolved config (and how runs' configs differ),
the launches its manifest records, and a short label that tells runs apart.

Read as plain YAML / JSON (no pydantic, no launch/ import): an older run's config still shows, and a
missing or damaged file gives None instead of an error (the log is what these commands are about).
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from rollout_hpc.rundir_layout import MANIFEST, RESOLVED_CONFIG
from rollout_hpc.store.trajlog import log_path


def run_dir_of(run_dir_or_log: str | Path) -> Path:
    """RUN_DIR of a run directory or of its trajectories.h5."""
    return log_path(run_dir_or_log).parent


def resolved_config(run_dir: str | Path) -> dict | None:
    """RUN_DIR/config.resolved.yaml as a dict, None when there is none (a bare log) or it cannot be read."""
    try:
        config = yaml.safe_load((Path(run_dir) / RESOLVED_CONFIG).read_text())
    except (OSError, yaml.YAMLError):
        return None
    return config if isinstance(config, dict) else None


def config_text(run_dir: str | Path) -> str | None:
    try:
        return (Path(run_dir) / RESOLVED_CONFIG).read_text()
    except OSError:
        return None


def flatten(config: dict, prefix: str = "") -> dict[str, object]:
    """{"algorithm": {"lr": 1e-3}} -> {"algorithm.lr": 1e-3}; lists stay whole values."""
    flat: dict[str, object] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


MISSING = "(not set)"


def config_differences(configs: dict[str, dict | None]) -> list[tuple[str, list[str]]]:
    """(dotted key, value per run as text) for every config key whose value is not the same in all runs
    (runs without a config are left out; run.name and run.dir differ by design and are left out too)."""
    flat = {label: flatten(c) for label, c in configs.items() if c is not None}
    if len(flat) < 2:
        return []
    keys = sorted({k for f in flat.values() for k in f} - {"run.name", "run.dir"})
    rows = []
    for key in keys:
        values = [json.dumps(f[key], default=str) if key in f else MISSING for f in flat.values()]
        if len(set(values)) > 1:
            rows.append((key, [v.strip('"') for v in values]))
    return rows


def run_labels(paths: list[str | Path]) -> list[str]:
    """A short distinct label per run: its run.name where the names differ, else the shortest path suffix
    that tells the runs apart ("a/run" and "b/run" for two runs both called run)."""
    dirs = [run_dir_of(p).resolve() for p in paths]
    names = [(resolved_config(d) or {}).get("run", {}).get("name") for d in dirs]
    if all(names) and len(set(names)) == len(names):
        return [str(n) for n in names]
    for depth in range(1, max(len(d.parts) for d in dirs) + 1):
        labels = ["/".join(d.parts[-depth:]).lstrip("/") or "/" for d in dirs]
        if len(set(labels)) == len(labels):
            return labels
    return [f"{d} ({i + 1})" for i, d in enumerate(dirs)]  # the same directory given twice


def launches(run_dir: str | Path) -> int | None:
    """How many times the run was started, as its manifest records it: each local (mpirun) launch and each
    Slurm job (submit, resume). None without a readable manifest. Slurm's own requeues of one job are not in it."""
    try:
        manifest = json.loads((Path(run_dir) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict):
        return None
    return len(manifest.get("local_runs") or []) + len(manifest.get("job_ids") or [])
