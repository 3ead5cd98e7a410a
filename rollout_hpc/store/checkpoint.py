"""HDF5 checkpoints: everything a new allocation needs to continue a run exactly.

Layout (docs/storage.md has the full description):

    RUN_DIR/checkpoints/step-00000120.h5          one file per checkpoint (single writer), or
    RUN_DIR/checkpoints/step-00000120/            a sharded checkpoint:
        shard-00000-of-00004.h5 ...               one file per trainer rank shard
        manifest.json                             written last: the checkpoint exists once it does

Each .h5 file holds the nested state under /state (see h5tree), and root
attributes: format, format_version, step, meta_json (policy version, data
cursor, resolved config + digest, library versions, ...) and content_checksum
(verified on every load; see h5tree for the algorithm). Files are published atomically
(temp file, fsync, rename, fsync dir), so a crash mid-save leaves the previous
checkpoint as the newest visible one; the last K are kept.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import yaml

from rollout_hpc.errors import CheckpointCorrupt, CheckpointError, ConfigMismatch
from rollout_hpc.store import atomic
from rollout_hpc.store.h5tree import CHECKSUM_ALGO, LeafHasher, digest_weights, read_tree, weights_from, write_tree

log = logging.getLogger("rollout_hpc.store.checkpoint")

FORMAT = "rollout-hpc-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# Config keys that may change between allocations of one run without invalidating its checkpoints.
RESUMABLE_CHANGES = {"algorithm.steps"}
# Config sections whose change makes a checkpoint belong to a different experiment.
IDENTITY_SECTIONS = ("model", "algorithm")

_FILE_RE = re.compile(r"^step-(\d{8})\.h5$")
_DIR_RE = re.compile(r"^step-(\d{8})$")
_TMP_RE = re.compile(r"^step-(\d{8})\.h5\.tmp-\d+$")


class CheckpointDiskFull(CheckpointError):
    """The file system of the run directory has no room for the next checkpoint."""


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path  # the .h5 file, or the step directory of a sharded checkpoint
    sharded: bool


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_name(step: int) -> str:
    if not 0 <= step < 10**8:
        raise ValueError(f"checkpoint step {step} is out of range 0..99999999")
    return f"step-{step:08d}"


def library_versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0], "hdf5": h5py.version.hdf5_version}
    for dist in ("rollout-hpc", "torch", "numpy", "h5py", "transformers", "deepspeed", "megatron-core", "vllm"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def config_meta(cfg) -> dict[str, Any]:
    """Checkpoint meta entries that identify the config: the resolved config and its digest."""
    return {"config": cfg.resolved(), "config_digest": cfg.digest()}


# --- one file --------------------------------------------------------------------


def _meta_json(step: int, meta: dict | None) -> str:
    full = {**(meta or {}), "step": step, "libraries": library_versions()}
    full.setdefault("created", time.time())
    try:  # numpy scalars (a step or version read from an array) are welcome as plain numbers
        return json.dumps(full, sort_keys=True, default=lambda o: o.item() if isinstance(o, np.generic) else _refuse(o))
    except TypeError as exc:
        raise CheckpointError(
            f"checkpoint meta must be JSON-serializable (numbers, strings, lists, dicts): {exc}"
        ) from None


def _refuse(value: Any):
    raise TypeError(f"{type(value).__name__} {value!r} is not JSON-serializable")


def state_nbytes(value: Any) -> int:
    """The bytes of a state's leaves: about the size of its checkpoint file (metadata adds a little)."""
    if isinstance(value, dict):
        return sum(state_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(state_nbytes(v) for v in value)
    if isinstance(value, (bytes, str)):
        return len(value)
    nbytes = getattr(value, "nbytes", None)  # numpy arrays, torch tensors
    return nbytes if isinstance(nbytes, int) else 8


def _previous_size(final: Path) -> tuple[str, int] | None:
    """(name, bytes) of the newest checkpoint file beside `final` (a sharded one: the same shard), if any."""
    siblings = (
        sorted(p for p in final.parent.parent.glob(f"step-*/{final.name}"))
        if _DIR_RE.match(final.parent.name)
        else sorted(p for p in final.parent.iterdir() if _FILE_RE.match(p.name) and p != final)
    )
    return (siblings[-1].name, siblings[-1].stat().st_size) if siblings else None


def _no_space(final: Path, needed: int, previous: tuple[str, int] | None, during: bool) -> CheckpointDiskFull:
    run_dir = next((p.parent for p in final.parents if p.name == "checkpoints"), final.parent)
    size = f"about {atomic.human(needed)}" + (
        f" (the previous checkpoint, {previous[0]}, is {atomic.human(previous[1])})" if previous else ""
    )
    what = "ran out of space writing" if during else "not enough space for"
    return CheckpointDiskFull(
        f"{what} checkpoint {final}: it needs {size}; {atomic.space_note(final.parent)}. Nothing partial is left. "
        f"Free space there (or lower checkpoint.keep_last, or move the run directory), then "
        f"`rollout-hpc resume {run_dir}` continues from the newest checkpoint"
    )


def write_checkpoint_file(final: Path, step: int, state: dict, meta: dict | None = None) -> str:
    """Write one checkpoint file atomically; returns its content checksum.

    Refuses (CheckpointDiskFull, before writing anything) when the file system has less free space than the
    checkpoint needs: the larger of the state's bytes and the previous checkpoint's size; a write that still
    runs out of space removes its temporary file and raises the same error."""
    meta_json = _meta_json(step, meta)
    previous = _previous_size(final)
    needed = max(state_nbytes(state), previous[1] if previous else 0)
    if atomic.free_bytes(final.parent) < needed:
        raise _no_space(final, needed, previous, during=False)
    tmp = atomic.temp_path(final)
    hasher = LeafHasher()
    try:
        with h5py.File(tmp, "w", track_order=True) as f:
            f.attrs["format"] = FORMAT
            f.attrs["format_version"] = FORMAT_VERSION
            f.attrs["step"] = step
            f.attrs["meta_json"] = meta_json
            write_tree(f.create_group("state", track_order=True), state, hasher)
            content = hasher.finish(meta_json)
            f.attrs["content_checksum"] = content
            f.attrs["checksum_algo"] = CHECKSUM_ALGO
        atomic.publish(tmp, final)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if atomic.is_disk_full(exc):
            raise _no_space(final, needed, previous, during=True) from None
        raise
    return content


def warn_if_space_low(final: Path) -> None:
    """One warning when the file system could not hold two more checkpoints the size of `final`."""
    size = sum(p.stat().st_size for p in final.rglob("*")) if final.is_dir() else final.stat().st_size
    if atomic.free_bytes(final.parent) < 2 * size:
        log.warning(
            "warning: little space left for checkpoints: %s; %s is %s, so the run stops with an error at a "
            "checkpoint that does not fit. Free space there (or lower checkpoint.keep_last)",
            atomic.space_note(final.parent),
            final.name,
            atomic.human(size),
        )


def _open(path: Path) -> h5py.File:
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise CheckpointCorrupt(
            f"{path.name}: cannot be opened as HDF5 (truncated or damaged: {str(exc).splitlines()[0]})"
        ) from None
    if f.attrs.get("format") != FORMAT:
        f.close()
        raise CheckpointCorrupt(f"{path.name}: not a rollout-hpc checkpoint (no format attribute '{FORMAT}')")
    version = int(f.attrs.get("format_version", -1))
    if version != FORMAT_VERSION:
        f.close()
        raise CheckpointError(
            f"{path.name}: checkpoint format version {version}; this rollout-hpc reads {FORMAT_VERSION}"
        )
    return f


def read_checkpoint_meta(path: str | Path) -> dict:
    """The meta of a checkpoint file without reading (or verifying) its state."""
    with _open(Path(path)) as f:
        meta = json.loads(f.attrs["meta_json"])
        meta["content_checksum"] = f.attrs.get("content_checksum", "")
        return meta


def read_checkpoint_file(path: str | Path) -> tuple[dict, dict]:
    """(state, meta) of one checkpoint file, verified against its content checksum."""
    path = Path(path)
    hasher = LeafHasher()
    try:
        with _open(path) as f, open(path, "rb") as raw:
            meta_json = f.attrs["meta_json"]
            expected = f.attrs["content_checksum"]
            state = read_tree(f["state"], hasher, raw.fileno())
            actual = hasher.finish(meta_json)
    except CheckpointError:
        raise
    except (OSError, KeyError, ValueError, RuntimeError) as exc:
        raise CheckpointCorrupt(
            f"{path.name}: unreadable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None
    if actual != expected:
        raise CheckpointCorrupt(
            f"{path.name}: content checksum mismatch (the file was modified or damaged after it was written)"
        )
    meta = json.loads(meta_json)
    meta["content_checksum"] = actual
    return state, meta


# --- run directory: save, list, prune, load ------------------------------------------


def save_checkpoint(run_dir: str | Path, step: int, state: dict, meta: dict | None = None, keep_last: int = 3) -> Path:
    """Save RUN_DIR/checkpoints/step-XXXXXXXX.h5 atomically and keep the newest `keep_last`."""
    directory = checkpoint_dir(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"{step_name(step)}.h5"
    write_checkpoint_file(final, step, state, meta)
    prune(run_dir, keep_last)
    warn_if_space_low(final)
    return final


def shard_file_name(shard: int, n_shards: int) -> str:
    return f"shard-{shard:05d}-of-{n_shards:05d}.h5"


def save_shard(
    run_dir: str | Path, step: int, shard: int, n_shards: int, state: dict, meta: dict | None = None
) -> dict:
    """Write one rank's shard of a sharded checkpoint; returns the manifest entry for `commit_shards`."""
    if not 0 <= shard < n_shards:
        raise ValueError(f"shard {shard} is not in 0..{n_shards - 1}")
    directory = checkpoint_dir(run_dir) / step_name(step)
    directory.mkdir(parents=True, exist_ok=True)
    name = shard_file_name(shard, n_shards)
    checksum = write_checkpoint_file(
        directory / name, step, state, {**(meta or {}), "shard": shard, "n_shards": n_shards}
    )
    return {"shard": shard, "file": name, "content_checksum": checksum}


def commit_shards(
    run_dir: str | Path, step: int, entries: list[dict], meta: dict | None = None, keep_last: int = 3
) -> Path:
    """Publish a sharded checkpoint once every rank's `save_shard` returned (gather the entries first)."""
    entries = sorted(entries, key=lambda e: e["shard"])
    n = len(entries)
    if [e["shard"] for e in entries] != list(range(n)):
        raise CheckpointError(
            f"step {step}: shard entries {[e['shard'] for e in entries]} are not 0..{n - 1}; gather one per rank"
        )
    directory = checkpoint_dir(run_dir) / step_name(step)
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": step,
        "n_shards": n,
        "shards": entries,
        "meta": json.loads(_meta_json(step, meta)),
    }
    atomic.write_text_atomic(directory / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
    atomic.fsync_dir(directory.parent)
    prune(run_dir, keep_last)
    warn_if_space_low(directory)
    return directory


def list_checkpoints(run_dir: str | Path) -> list[CheckpointInfo]:
    """Published checkpoints, oldest first (a sharded one counts once its manifest exists)."""
    directory = checkpoint_dir(run_dir)
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        if m := _FILE_RE.match(entry.name):
            found.append(CheckpointInfo(int(m.group(1)), entry, False))
        elif (m := _DIR_RE.match(entry.name)) and (entry / MANIFEST).is_file():
            found.append(CheckpointInfo(int(m.group(1)), entry, True))
    return sorted(found, key=lambda c: c.step)


def prune(run_dir: str | Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` checkpoints, and leftovers of crashed saves older than the newest."""
    published = list_checkpoints(run_dir)
    if not published:
        return
    newest = published[-1].step
    for info in published[: max(0, len(published) - keep_last)]:
        shutil.rmtree(info.path) if info.sharded else info.path.unlink(missing_ok=True)
    for entry in checkpoint_dir(run_dir).iterdir():
        if (m := _TMP_RE.match(entry.name)) and int(m.group(1)) <= newest:
            entry.unlink(missing_ok=True)  # the temp file of a crashed save
        elif (m := _DIR_RE.match(entry.name)) and int(m.group(1)) < newest and not (entry / MANIFEST).is_file():
            shutil.rmtree(entry, ignore_errors=True)  # shards of a sharded save that never got its manifest


def _load_sharded(directory: Path, shard: int | None) -> tuple[Path, dict, dict]:
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointCorrupt(f"{directory.name}/{MANIFEST}: unreadable ({exc})") from None
    n = manifest["n_shards"]
    if shard is None or not 0 <= shard < n:
        raise CheckpointError(
            f"{directory.name} is sharded into {n} files; load it with shard=<this rank's shard, 0..{n - 1}>"
        )
    for entry in manifest["shards"]:  # every shard must be present and be the file the manifest names
        path = directory / entry["file"]
        if not path.is_file():
            raise CheckpointCorrupt(f"{directory.name}: shard file {entry['file']} is missing")
        if read_checkpoint_meta(path)["content_checksum"] != entry["content_checksum"]:
            raise CheckpointCorrupt(f"{directory.name}: shard file {entry['file']} is not the one the manifest lists")
    path = directory / manifest["shards"][shard]["file"]
    state, meta = read_checkpoint_file(path)
    return path, state, meta


def load_checkpoint(info: CheckpointInfo, shard: int | None = None) -> tuple[Path, dict, dict]:
    if info.sharded:
        return _load_sharded(info.path, shard)
    state, meta = read_checkpoint_file(info.path)
    return info.path, state, meta


def load_latest_valid(run_dir: str | Path, shard: int | None = None) -> tuple[Path, dict, dict] | None:
    """The newest checkpoint that verifies, as (path, state, meta); None if the run has none.

    A damaged newer checkpoint (truncated, bit-flipped, missing shard) is skipped
    with one warning line naming it and the one used instead.
    """
    infos = list_checkpoints(run_dir)
    damaged: list[str] = []
    for info in reversed(infos):
        try:
            result = load_checkpoint(info, shard)
        except CheckpointCorrupt as exc:
            damaged.append(str(exc))
            continue
        warn_skipped(damaged, info.path)
        return result
    if damaged:
        raise every_checkpoint_damaged(run_dir, damaged)
    return None


def warn_skipped(damaged: list[str], used: Path) -> None:
    """One warning line per damaged newer checkpoint that a resume passes over for `used`."""
    for reason in damaged:
        log.warning("skipping damaged checkpoint %s; using %s instead", reason, used.name)


def every_checkpoint_damaged(run_dir: str | Path, damaged: list[str]) -> CheckpointCorrupt:
    return CheckpointCorrupt(
        f"every checkpoint in {checkpoint_dir(run_dir)} is damaged ({'; '.join(damaged)}); "
        "start the run afresh or restore a copy"
    )


# --- digests and compatibility -----------------------------------------------------


def weights_digest(state: dict) -> str:
    """SHA-256 over the model weights (state['model'] or state['weights'], else the mapping itself)
    in sorted-name order: equal digests mean bitwise-equal weights, across runs and machines."""
    return digest_weights(weights_from(state))


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def _resolved(config: Any) -> dict | None:
    if config is None or isinstance(config, dict):
        return config
    if hasattr(config, "resolved"):
        return config.resolved()
    if isinstance(config, str) and not re.fullmatch(r"[0-9a-f]{64}", config):
        return yaml.safe_load(config)  # YAML or JSON text
    return None


def _digest(config: Any) -> str | None:
    if hasattr(config, "digest"):
        return config.digest()
    if isinstance(config, str) and re.fullmatch(r"[0-9a-f]{64}", config):
        return config
    return None


def check_compatible(meta: dict, config: Any, force: bool = False) -> list[str]:
    """Refuse to resume from a checkpoint written under a different model or algorithm config.

    `config`: a Config, its resolved dict, YAML/JSON text, or a digest. Returns the
    differences found ("section.key: saved -> now"); raises ConfigMismatch when a
    model/algorithm key differs (other than RESUMABLE_CHANGES) unless `force`.
    """
    saved, now = _resolved(meta.get("config")), _resolved(config)
    if saved is None or now is None:
        saved_digest, now_digest = meta.get("config_digest"), _digest(config)
        if saved_digest and now_digest and saved_digest != now_digest and not force:
            raise ConfigMismatch(
                f"checkpoint config digest {saved_digest[:12]} differs from this run's {now_digest[:12]} "
                "(no resolved config stored to say what differs); pass --force to resume anyway"
            )
        return [] if saved_digest == now_digest else ["config digest"]
    a, b = _flatten(saved), _flatten(now)
    changed = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    diffs = [f"{k}: {a.get(k, '<unset>')!r} -> {b.get(k, '<unset>')!r}" for k in changed]
    blocking = [
        d for k, d in zip(changed, diffs) if k.split(".")[0] in IDENTITY_SECTIONS and k not in RESUMABLE_CHANGES
    ]
    if blocking and not force:
        raise ConfigMismatch(
            "the checkpoint was written under a different config: "
            + "; ".join(blocking)
            + ". Resume with the original config, or pass --force to load it anyway"
        )
    return diffs


# --- when to save ------------------------------------------------------------------


@dataclass
class CheckpointPolicy:
    """Periodic checkpoints every N steps and/or every M minutes (0 = that trigger is off)."""

    every_steps: int = 0
    every_minutes: float = 0.0
    last_saved: float = field(default_factory=time.monotonic)

    @classmethod
    def from_config(cls, section) -> CheckpointPolicy:
        return cls(section.every_steps, section.every_minutes)

    def due(self, step: int, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        by_steps = self.every_steps > 0 and step > 0 and step % self.every_steps == 0
        by_time = self.every_minutes > 0 and now - self.last_saved >= self.every_minutes * 60
        return by_steps or by_time

    def mark_saved(self, now: float | None = None) -> None:
        self.last_saved = time.monotonic() if now is None else now
