"""The trajectory log: every trajectory a run trained on, plus a per-step metrics table, in one HDF5 file.

RUN_DIR/trajectories.h5 (docs/storage.md has the full layout):

    /traj/<field>            one appendable column per FIXED_DTYPE field, plus `step` (the train step that
                             consumed the row) and `staleness` (trainer policy version minus the row's)
    /traj/prompt_ids ...     ragged arrays stored flat (prompt_ids, response_ids, logprobs, loss_mask,
                             turn_starts) with /traj/{prompt,response,turn}_offsets (rows + 1 entries, from 0)
    /metrics/columns         metric names (fixed-length strings); /metrics/values: (steps, columns) float64
    /progress                [committed trajectory rows, committed metric rows, closed cleanly (0/1)]
    /eval/columns, /eval/values, /eval/committed
                             validation during training: one row per eval of the policy on the held-out
                             split ((evals, columns) float64, column 0 `step`) and its committed-row count

One writer holds the file in SWMR mode (libver='latest'), so readers may open it
while it grows. `flush()` makes data durable first and then advances /progress;
readers trust only committed rows, so a killed writer loses at most what it had
not flushed. Reopening a killed writer's log for append clears HDF5's
open-for-write flags (no live writer: an flock on `<log>.lock` proves it) and
truncates every dataset to the last consistent committed row.
"""

from __future__ import annotations

import fcntl
import functools
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from rollout_hpc.errors import TrajectoryLogError
from rollout_hpc.store import atomic
from rollout_hpc.store.h5recover import (
    READ_ERRORS,
    clear_consistency_flags,
    consistency_flags,
    first_unreadable,
    open_swmr_reader,
    stored_eof,
    superblock_damage,
)
from rollout_hpc.trajectory import FIXED_DTYPE, FIXED_NAMES, RAGGED, TrajectoryBatch
from rollout_hpc.trajectory import LAYOUT_VERSION as RECORD_LAYOUT

log = logging.getLogger("rollout_hpc.store.trajlog")

FORMAT = "rollout-hpc-trajectories"
LOG_LAYOUT_VERSION = 1
LOG_NAME = "trajectories.h5"

ROW_COLUMNS = [n for n in FIXED_NAMES if not n.startswith("_")] + ["step", "staleness"]
_ROW_DTYPES = {**{n: FIXED_DTYPE[n] for n in ROW_COLUMNS[:-2]}, "step": np.dtype("<i8"), "staleness": np.dtype("<i8")}
# ragged array -> its offsets dataset (one offsets dataset per length field)
# (a log older than a length field lacks its offsets: every row written then had none of those entries)
OFFSETS = {
    "prompt_len": "prompt_offsets",
    "response_len": "response_offsets",
    "n_turns": "turn_offsets",
    "n_reward_parts": "reward_part_offsets",
}
STANDARD_METRICS = (
    "step",
    "time",
    "reward_mean",
    "reward_std",
    "reward_min",
    "reward_max",
    "response_len_mean",
    "response_len_max",
    "kl",
    "entropy",
    "clip_frac",
    "staleness_mean",
    "staleness_max",
    "gen_time",
    "train_time",
    "sync_time",
    "idle_time",
    "tokens_per_s",
    "samples",
    "allocation",
    "policy_version",
)
# Validation during training: one row per eval (the generator ranks evaluate the policy of version `step` on
# the held-out split). k = samples per prompt; pass_at_k / mean_at_k over those k samples; reward_errors =
# samples whose reward is a stand-in 0 (reward_status != REWARD_OK).
STANDARD_EVAL_METRICS = (
    "step",
    "time",
    "accuracy",
    "mean_reward",
    "pass_at_k",
    "mean_at_k",
    "k",
    "prompts",
    "samples",
    "response_len_mean",
    "reward_errors",
)
METRIC_NAME_BYTES = 64

# Chunk sizes: rows for per-trajectory columns, elements for flat token arrays. A flush rewrites
# the last, partly filled chunk of every dataset, and a compressed chunk that changes size moves
# (HDF5 does not reuse the old space), so chunks stay small: 16384 elements (64 KiB of int32).
ROW_CHUNK = 8192
TOKEN_CHUNK = 16384
# Byte shuffle + gzip level 1: token ids and masks have mostly-zero high bytes, so the log is about
# half the uncompressed size, and every HDF5 reader can decode gzip (lzf needs h5py).
# tools/bench_checkpoint.py measures gzip vs lzf vs none against JSON lines.
DEFAULT_COMPRESSION = {"compression": "gzip", "compression_opts": 1, "shuffle": True}


def log_path(run_dir_or_log: str | Path) -> Path:
    """RUN_DIR/trajectories.h5 for a run directory (existing or not); an existing file or a *.h5 path as is."""
    p = Path(run_dir_or_log)
    return p if p.is_file() or (p.suffix in (".h5", ".hdf5") and not p.is_dir()) else p / LOG_NAME


class _WriterLock:
    """An flock held for the writer's life; the OS drops it when the writer dies, even by SIGKILL."""

    def __init__(self, log: Path) -> None:
        self.path = log.with_name(log.name + ".lock")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(self.fd)
            raise TrajectoryLogError(
                f"{log} is being written by another process (pid {holder}); one writer per log"
            ) from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, str(os.getpid()).encode(), 0)

    def release(self) -> None:
        os.close(self.fd)


def _check_format(f: h5py.File, path: Path) -> None:
    if f.attrs.get("format") != FORMAT:
        raise TrajectoryLogError(
            f"{path} is an HDF5 file but not a rollout-hpc trajectory log (no format attribute '{FORMAT}')"
        )
    version = int(f.attrs.get("layout_version", -1))
    if version != LOG_LAYOUT_VERSION:
        raise TrajectoryLogError(
            f"{path}: trajectory log layout version {version}; this rollout-hpc reads version {LOG_LAYOUT_VERSION} "
            "(upgrade rollout-hpc to read it)"
        )


class TrajectoryLog:
    """The single writer of a run's trajectory log."""

    def __init__(self, path: Path, f: h5py.File, lock: _WriterLock, reconciled: dict) -> None:
        self.path, self._f, self._lock = path, f, lock
        self.reconciled = reconciled  # what reopening after a crash dropped, for the caller to report
        self._traj, self._metrics, self._progress = f["traj"], f["metrics"], f["progress"]
        self._rows = int(self._traj["step"].shape[0])
        self._metric_rows = int(self._metrics["values"].shape[0])
        self._columns = [c.decode() for c in self._metrics["columns"][:]]
        self._eval, self._eval_committed = f["eval"], f["eval/committed"]
        self._eval_rows = int(self._eval["values"].shape[0])
        self._eval_columns = [c.decode() for c in self._eval["columns"][:]]
        self._pending: list[tuple[TrajectoryBatch, int, int]] = []
        self._pending_rows = 0
        self._step_stats: dict[int, list[np.ndarray]] = {}
        self.buffer_rows = 4096
        # Called with ("metrics" | "eval", step, row) after each row, ("flush" | "close", -1, {}) after those:
        # experiment trackers follow the log this way (runtime/trackers.py).
        self.observers: list[Callable[[str, int, dict], None]] = []

    def _tell(self, event: str, step: int = -1, row: dict | None = None) -> None:
        for observer in self.observers:
            observer(event, step, row or {})

    # --- opening -------------------------------------------------------------------
    @classmethod
    def open_for_append(
        cls, path: str | Path, meta: dict | None = None, resume_step: int | None = None, compression: dict | None = None
    ) -> TrajectoryLog:
        """Create the log, or reopen it to continue (after a clean exit or a crash).

        meta: run_name, group_size, max_new_tokens, max_staleness, ... (stored as attributes on
        creation). resume_step: drop rows and metrics of steps after it (the checkpoint being
        resumed from), so replayed steps are not logged twice.
        """
        path = log_path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = _WriterLock(path)
        try:
            # A damaged log (truncated, overwritten) is set aside and its readable steps continued.
            repaired = repair_log(path, resume_step, verify=False)
            if repaired:
                log.warning("warning: %s", repair_message(path, repaired))
            if path.exists() and path.stat().st_size > 0:
                f, reconciled = cls._reopen(path, resume_step)
                if repaired:
                    reconciled["repaired"] = repaired
            else:
                f, reconciled = (
                    cls._create(path, meta or {}, DEFAULT_COMPRESSION if compression is None else compression),
                    {},
                )
            f.swmr_mode = True
        except BaseException:
            lock.release()
            raise
        return cls(path, f, lock, reconciled)

    @staticmethod
    def _create(path: Path, meta: dict, compression: dict) -> h5py.File:
        # HDF5's own file lock is off for writer and readers alike: our flock on <log>.lock keeps
        # writers exclusive, and equal flags let one process read its own log while writing it.
        f = h5py.File(path, "w", libver="latest", locking=False)
        f.attrs["format"] = FORMAT
        f.attrs["layout_version"] = LOG_LAYOUT_VERSION
        f.attrs["record_layout"] = RECORD_LAYOUT
        f.attrs["created"] = time.time()
        for key in ("run_name", "group_size", "max_new_tokens", "max_staleness"):
            if meta.get(key) is not None:
                f.attrs[key] = meta[key]
        f.attrs["meta_json"] = json.dumps(meta, default=str)
        traj = f.create_group("traj")
        for name in ROW_COLUMNS:
            traj.create_dataset(name, (0,), _ROW_DTYPES[name], maxshape=(None,), chunks=(ROW_CHUNK,), **compression)
        for name, dtype, _ in RAGGED:
            traj.create_dataset(name, (0,), dtype, maxshape=(None,), chunks=(TOKEN_CHUNK,), **compression)
        for offsets in OFFSETS.values():
            traj.create_dataset(
                offsets, data=np.zeros(1, np.int64), maxshape=(None,), chunks=(ROW_CHUNK,), **compression
            )
        metrics = f.create_group("metrics")
        names = np.array([n.encode() for n in STANDARD_METRICS], f"S{METRIC_NAME_BYTES}")
        metrics.create_dataset("columns", data=names, maxshape=(None,), chunks=(64,))
        metrics.create_dataset(
            "values", (0, len(names)), np.float64, maxshape=(None, None), chunks=(256, 32), fillvalue=np.nan
        )
        f.create_dataset("progress", data=np.zeros(3, np.int64))
        _create_eval_group(f)
        return f

    @staticmethod
    def _reopen(path: Path, resume_step: int | None) -> tuple[h5py.File, dict]:
        crashed = bool(consistency_flags(path))
        if crashed:  # the previous writer died holding the file; our lock proves it is gone
            clear_consistency_flags(path)
        try:
            f = h5py.File(path, "r+", libver="latest", locking=False)
        except OSError as exc:
            raise TrajectoryLogError(f"{path}: cannot be reopened for append ({str(exc).splitlines()[0]})") from None
        try:
            _check_format(f, path)
            # Objects a log written by an older rollout-hpc lacks are created now: SWMR mode (next) forbids it.
            upgraded = [] if "eval" in f else ["/eval"]
            if upgraded:
                _create_eval_group(f)
            reconciled = _reconcile(f, resume_step)
            upgraded += reconciled.pop("columns_added", [])
            if upgraded:
                reconciled["upgraded"] = upgraded
        except BaseException:
            f.close()
            raise
        reconciled["writer_killed"] = crashed or reconciled.get("writer_killed", False)
        f.flush()
        return f, reconciled

    # --- writing -------------------------------------------------------------------
    def append(self, batch: TrajectoryBatch, step: int, policy_version: int | None = None) -> None:
        """Log the trajectories train step `step` consumed; the trainer's policy version defaults to `step`."""
        if len(batch) == 0:
            return
        version = step if policy_version is None else policy_version
        self._pending.append((batch, step, version))
        self._pending_rows += len(batch)
        self._step_stats.setdefault(step, []).append(
            np.stack(
                [
                    batch.fixed["reward"].astype(np.float64),
                    batch.fixed["response_len"].astype(np.float64),
                    version - batch.fixed["policy_version"].astype(np.float64),
                ]
            )
        )
        if self._pending_rows >= self.buffer_rows:
            self._write_pending()

    def _write_pending(self) -> None:
        if not self._pending:
            return
        batch = TrajectoryBatch.concat([b for b, _, _ in self._pending])
        self._check_space(batch.fixed.nbytes + sum(getattr(batch, name).nbytes for name, _, _ in RAGGED))
        steps = np.concatenate([np.full(len(b), s, np.int64) for b, s, _ in self._pending])
        versions = np.concatenate([np.full(len(b), v, np.int64) for b, _, v in self._pending])
        self._pending, self._pending_rows = [], 0
        traj = self._traj
        # Flat arrays and offsets first, per-row columns after: a row exists once its columns do.
        for length_field, offsets_name in OFFSETS.items():
            offsets = traj[offsets_name]
            base = int(offsets[-1])
            ends = base + np.cumsum(batch.fixed[length_field], dtype=np.int64)
            _extend(offsets, ends)
        for name, _, _ in RAGGED:
            _extend(traj[name], getattr(batch, name))
        for name in ROW_COLUMNS[:-2]:
            _extend(traj[name], batch.fixed[name])
        _extend(traj["staleness"], versions - batch.fixed["policy_version"].astype(np.int64))
        _extend(traj["step"], steps)
        self._rows += len(batch)

    def append_metrics(self, step: int, metrics: dict[str, float], flush: bool = True) -> None:
        """One row of the per-step table. Reward, response length, staleness and sample stats of the
        rows appended for `step` are filled in unless given; unknown names become new columns."""
        row = {"step": step, "time": time.time(), **self._derived(step), **metrics}
        _append_row(self._metrics, self._columns, self._metric_rows, row)
        self._metric_rows += 1
        self._tell("metrics", step, row)
        if flush:
            self.flush()

    def append_eval(self, step: int, metrics: dict[str, float]) -> None:
        """One row of the eval table: the policy of version `step` evaluated on the held-out split.

        Standard names: STANDARD_EVAL_METRICS (accuracy, mean_reward, pass_at_k, mean_at_k, k, prompts,
        samples, response_len_mean, reward_errors; `time` defaults to now); unknown names become new
        columns. Durable when it returns: the row is flushed before /eval/committed counts it. Trajectory
        rows and metric rows still buffered are not committed by this (flush() does that)."""
        row = {"time": time.time(), **metrics, "step": step}
        _append_row(self._eval, self._eval_columns, self._eval_rows, row)
        self._eval_rows += 1
        self._f.flush()
        self._eval_committed[0] = self._eval_rows
        self._f.flush()
        self._tell("eval", step, row)

    def _derived(self, step: int) -> dict[str, float]:
        parts = self._step_stats.pop(step, None)
        if not parts:
            return {}
        reward, length, stale = np.concatenate(parts, axis=1)
        return {
            "reward_mean": reward.mean(),
            "reward_std": reward.std(),
            "reward_min": reward.min(),
            "reward_max": reward.max(),
            "response_len_mean": length.mean(),
            "response_len_max": length.max(),
            "staleness_mean": stale.mean(),
            "staleness_max": stale.max(),
            "samples": len(reward),
        }

    def flush(self) -> None:
        """Make everything appended durable, then commit it for readers."""
        self._write_pending()
        self._f.flush()
        self._progress[0:2] = (self._rows, self._metric_rows)
        self._f.flush()
        self._tell("flush")

    # HDF5 does not survive a full disk gracefully (errors in object destructors, even a crash): rows are only
    # written while the file system has room for them uncompressed plus this much for HDF5's own metadata.
    SPACE_MARGIN = 256 << 10

    def _check_space(self, nbytes: int) -> None:
        if atomic.free_bytes(self.path.parent) < nbytes + self.SPACE_MARGIN:
            raise TrajectoryLogError(
                f"no space left to log trajectories to {self.path}: {atomic.space_note(self.path.parent)}. Free "
                f"space there, then `rollout-hpc resume {self.path.parent}` continues from the newest checkpoint"
            )

    @property
    def rows(self) -> int:
        return self._rows + self._pending_rows

    @property
    def eval_rows(self) -> int:
        return self._eval_rows

    def close(self) -> None:
        if self._f.id.valid:
            self.flush()
            self._progress[2] = 1
            self._f.close()
            self._lock.release()
            self._tell("close")

    def __enter__(self) -> TrajectoryLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _create_eval_group(f: h5py.File) -> None:
    group = f.create_group("eval")
    names = np.array([n.encode() for n in STANDARD_EVAL_METRICS], f"S{METRIC_NAME_BYTES}")
    group.create_dataset("columns", data=names, maxshape=(None,), chunks=(64,))
    group.create_dataset(
        "values", (0, len(names)), np.float64, maxshape=(None, None), chunks=(64, 16), fillvalue=np.nan
    )
    group.create_dataset("committed", data=np.zeros(1, np.int64))


def _append_row(table: h5py.Group, columns: list[str], rows: int, row: dict) -> None:
    """Write `row` ({name: number}) as row `rows` of a (rows x columns) table (/metrics or /eval); unknown
    names become new columns (the name first: readers take min(names, value columns))."""
    for name, value in row.items():
        try:
            row[name] = float(value)
        except (TypeError, ValueError):
            raise TrajectoryLogError(f"metric '{name}' = {value!r} is not a number") from None
        if name not in columns:
            if len(name.encode()) > METRIC_NAME_BYTES:
                raise TrajectoryLogError(f"metric name '{name}' is longer than {METRIC_NAME_BYTES} bytes; shorten it")
            table["columns"].resize((len(columns) + 1,))
            table["columns"][len(columns)] = name.encode()
            columns.append(name)
            table["values"].resize((rows, len(columns)))
    values = np.full(len(columns), np.nan)
    for name, value in row.items():
        values[columns.index(name)] = value
    ds = table["values"]
    ds.resize((rows + 1, len(columns)))
    ds[rows] = values


def _dedupe_by_step(values: np.ndarray) -> np.ndarray:
    """Rows of a table with column 0 = step: the last row of each step, sorted by step."""
    if not len(values):
        return values
    steps = values[:, 0]
    last = len(steps) - 1 - np.unique(steps[::-1], return_index=True)[1]
    values = values[np.sort(last)]
    return values[np.argsort(values[:, 0], kind="stable")]


def _offsets_present(f: h5py.File) -> list[str]:
    """The offsets datasets this log has (see OFFSETS)."""
    return [o for o in OFFSETS.values() if o in f["traj"]]


def _row_columns(f: h5py.File) -> list[str]:
    """The per-row columns this log has (a log written before a FIXED_DTYPE field existed lacks it)."""
    traj = f["traj"]
    return [n for n in ROW_COLUMNS if n in traj]


def _eval_rows(f: h5py.File) -> int:
    if "eval" not in f:
        return 0
    return min(int(f["eval/committed"][0]), f["eval/values"].shape[0])


def _extend(ds: h5py.Dataset, data: np.ndarray) -> None:
    n = ds.shape[0]
    ds.resize((n + len(data),))
    if len(data):
        ds[n:] = data


def _consistent_rows(f: h5py.File) -> tuple[int, int, int]:
    """(rows every dataset agrees on, most rows any dataset holds, committed metric rows)."""
    traj = f["traj"]
    committed, metric_committed = (int(x) for x in f["progress"][:2])
    extents = [traj[n].shape[0] for n in _row_columns(f)] + [traj[o].shape[0] - 1 for o in _offsets_present(f)]
    rows = min([committed] + extents)
    for length_field, offsets_name in OFFSETS.items():  # flat arrays must cover the rows' slices
        if offsets_name not in traj:
            continue
        flat_len = min(traj[name].shape[0] for name, _, lf in RAGGED if lf == length_field and name in traj)
        if int(traj[offsets_name][rows]) > flat_len:  # rare (a crash mid-append): search the offsets
            rows = int(np.searchsorted(traj[offsets_name][: rows + 1], flat_len, side="right")) - 1
    metric_rows = min(metric_committed, f["metrics/values"].shape[0])
    return rows, max(extents + [committed]), metric_rows


def _reconcile(f: h5py.File, resume_step: int | None) -> dict:
    rows, most, metric_rows = _consistent_rows(f)
    traj = f["traj"]
    eval_rows = _eval_rows(f)
    report = {
        "rows_kept": rows,
        "rows_dropped": most - rows,
        "metric_rows_dropped": f["metrics/values"].shape[0] - metric_rows,
        "eval_rows_dropped": f["eval/values"].shape[0] - eval_rows,
        "writer_killed": not bool(f["progress"][2]),
    }
    if resume_step is not None:
        steps = traj["step"][:rows]
        later = np.flatnonzero(steps > resume_step)
        keep = int(later[0]) if len(later) else rows
        report["rows_after_resume_step"] = rows - keep
        rows = keep
        mstep = f["metrics/values"][:metric_rows, 0]
        mlater = np.flatnonzero(mstep > resume_step)
        metric_rows = int(mlater[0]) if len(mlater) else metric_rows
        # The eval of a version after resume_step is redone by the resumed run (dedupe would hide a
        # duplicate, but a replayed eval should not count twice in the file either).
        estep = f["eval/values"][:eval_rows, 0]
        keep_eval = estep <= resume_step
        report["eval_rows_after_resume_step"] = int((~keep_eval).sum())
        if not keep_eval.all():
            kept = f["eval/values"][:eval_rows][keep_eval]
            eval_rows = len(kept)
            if eval_rows:
                f["eval/values"][:eval_rows] = kept
    present = _row_columns(f)
    for name in present:
        traj[name].resize((rows,))
    added = [name for name in ROW_COLUMNS if name not in present]
    for name in added:  # a FIXED_DTYPE field newer than the log: zeros for the rows written before it
        traj.create_dataset(
            name,
            data=np.zeros(rows, _ROW_DTYPES[name]),
            maxshape=(None,),
            chunks=(ROW_CHUNK,),
            **_filters_like(traj["step"]),
        )
    if added:
        report["columns_added"] = [f"/traj/{name}" for name in added]
    for length_field, offsets_name in OFFSETS.items():
        if offsets_name not in traj:  # a length field newer than the log: the rows written before it have none
            traj.create_dataset(
                offsets_name,
                data=np.zeros(rows + 1, np.int64),
                maxshape=(None,),
                chunks=(ROW_CHUNK,),
                **_filters_like(traj["step"]),
            )
            report.setdefault("columns_added", []).append(f"/traj/{offsets_name}")
        end = int(traj[offsets_name][rows])
        traj[offsets_name].resize((rows + 1,))
        for name, dtype, lf in RAGGED:
            if lf != length_field:
                continue
            if name in traj:
                traj[name].resize((end,))
            else:  # a ragged array newer than the log: zeros for the rows written before it
                traj.create_dataset(
                    name,
                    data=np.zeros(end, dtype),
                    maxshape=(None,),
                    chunks=(TOKEN_CHUNK,),
                    **_filters_like(traj["step"]),
                )
                report.setdefault("columns_added", []).append(f"/traj/{name}")
    values = f["metrics/values"]
    n_names = f["metrics/columns"].shape[0]
    values.resize((metric_rows, n_names))
    f["eval/values"].resize((eval_rows, f["eval/columns"].shape[0]))
    f["eval/committed"][0] = eval_rows
    f["progress"][:] = (rows, metric_rows, 0)
    return report


def _filters_like(ds: h5py.Dataset) -> dict:
    return {"compression": ds.compression, "compression_opts": ds.compression_opts, "shuffle": ds.shuffle}


class TrajectoryLogDamaged(TrajectoryLogError):
    """Part of a trajectory log cannot be read: truncated, overwritten, or bytes flipped."""

    def __init__(self, path: Path, reason: str, found_while_reading: bool = False) -> None:
        self.path, self.reason, self.found_while_reading = path, reason, found_while_reading
        if found_while_reading:
            text = f"{reason} (found while reading it: the rows before the damage can still be read)"
        else:
            text = (
                f"{path} is damaged beyond reading ({reason}); nothing in it can be salvaged. "
                f"`rollout-hpc resume` keeps it aside and starts a new log"
            )
        super().__init__(text)


# Files (path, size, mtime) a reader found damaged in the middle of their data: later readers in this
# process scan them in full when they open them (commands.analysis runs a command again on such a file).
_READ_IN_FULL: set[tuple[str, int, int]] = set()
_WARNED: set[str] = set()


def _file_identity(path: Path) -> tuple[str, int, int]:
    st = path.stat()
    return (str(path.resolve()), st.st_size, st.st_mtime_ns)


def _damage_checked(method):
    """A data read that fails (a chunk that does not decompress) raises TrajectoryLogDamaged naming the file."""

    @functools.wraps(method)
    def read(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except OSError:
            raise self._damage_found_while_reading() from None

    return read


def _extent_rows(f: h5py.File) -> tuple[int, int, int]:
    """_consistent_rows without reading the offsets (one of them is damaged)."""
    traj = f["traj"]
    committed, metric_committed = (int(x) for x in f["progress"][:2])
    extents = [traj[n].shape[0] for n in _row_columns(f)] + [traj[o].shape[0] - 1 for o in _offsets_present(f)]
    return min([committed] + extents), max(extents + [committed]), min(metric_committed, f["metrics/values"].shape[0])


def _readable_extent(group: h5py.Group, name: str, extent: int, read: bool) -> int:
    try:
        return first_unreadable(group[name], extent, read)
    except READ_ERRORS:  # its object header is unreadable
        return 0


def _salvageable(
    f: h5py.File, rows: int, metric_rows: int, eval_rows: int, read: bool
) -> tuple[int, int, int, int | None, str] | None:
    """None if every committed row, metric row and eval row can be read; else (rows, metric rows, eval rows that
    can: the complete steps before the damage; the first step lost (None: only eval rows are); the first dataset
    found damaged). read=False checks the chunk index only (finds a truncation), read=True decompresses it all."""
    traj = f["traj"]
    damaged: list[str] = []

    def limit(current: int, group: h5py.Group, name: str, extent: int) -> int:
        good = _readable_extent(group, name, extent, read)
        if good < extent:
            damaged.append(f"{group.name}/{name}")
        return min(current, good)

    ok = rows
    for name in _row_columns(f):
        ok = limit(ok, traj, name, rows)
    for offsets_name in _offsets_present(f):  # row r needs offsets r and r + 1
        ok = max(0, limit(ok + 1, traj, offsets_name, rows + 1) - 1)
    for length_field, offsets_name in OFFSETS.items():  # and its slice of the flat arrays
        if offsets_name not in traj:
            continue
        offsets = traj[offsets_name][: ok + 1] if ok else np.zeros(1, np.int64)
        for name, _, lf in RAGGED:
            if lf == length_field and name in traj:  # (a log older than a ragged array lacks it)
                end = int(offsets[ok])
                good = limit(end, traj, name, end)
                if good < end:
                    ok = int(np.searchsorted(offsets, good, side="right")) - 1
    metric_ok = limit(metric_rows, f["metrics"], "values", metric_rows)
    eval_ok = limit(eval_rows, f["eval"], "values", eval_rows) if "eval" in f else eval_rows
    if not damaged:
        return None
    values = f["metrics/values"]
    lost: list[int] = []
    steps = traj["step"][:ok]
    if ok < rows:  # the first lost row's step; unknown: the last readable step may be incomplete
        try:
            lost.append(int(traj["step"][ok]))
        except READ_ERRORS:
            lost.append(int(steps[-1]) if ok else 0)
    if metric_ok < metric_rows:  # one metric row per step: the lost one is the next step
        lost.append(int(values[metric_ok - 1, 0]) + 1 if metric_ok else 0)
    lost_from = min(lost) if lost else None
    if lost_from is not None:
        ok = int(np.searchsorted(steps, lost_from, side="left"))
        metric_ok = int(np.count_nonzero(values[:metric_ok, 0] < lost_from))
    return ok, metric_ok, eval_ok, lost_from, f"unreadable data in {damaged[0]}"


class TrajectoryReader:
    """Reads a trajectory log, also while its writer appends (SWMR) or after the writer was killed.

    A damaged log (truncated, overwritten, flipped bytes) is read up to the damage: every complete step before
    it, with one warning naming the file and the step from which data is lost (`damage`, `lost_from_step`).
    verify=True decompresses every chunk on opening, to find damage anywhere (repair_log does)."""

    def __init__(self, path: str | Path, verify: bool = False, warn: bool = True) -> None:
        self.path = log_path(path)
        if not self.path.is_file():
            raise TrajectoryLogError(
                f"{self.path}: no trajectory log here (expected RUN_DIR/{LOG_NAME} or the path of one)"
            )
        if reason := superblock_damage(self.path):
            raise TrajectoryLogDamaged(self.path, reason)
        self.verify, self.warn = verify, warn
        self.damage: str | None = None  # the warning when part of the log is unreadable (see _salvage)
        self.lost_from_step: int | None = None
        try:
            # No file lock: a reader (say a long-lived monitor) must never stop a restarted job's writer
            # from reopening the log; SWMR reading needs no lock.
            self._f = open_swmr_reader(self.path)
        except OSError as exc:
            raise TrajectoryLogDamaged(self.path, f"cannot be opened: {str(exc).splitlines()[0]}") from None
        try:
            _check_format(self._f, self.path)
            self.meta = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in self._f.attrs.items()}
            self.refresh()
        except READ_ERRORS as exc:
            self._f.close()
            raise TrajectoryLogDamaged(self.path, f"its layout is unreadable: {str(exc).splitlines()[0]}") from None
        except TrajectoryLogError:
            self._f.close()
            raise

    def refresh(self) -> None:
        """Pick up rows the writer committed since the last look."""
        for ds in self._datasets():
            ds.refresh()
        try:
            self.rows, most, self.metric_rows = _consistent_rows(self._f)
        except READ_ERRORS:  # an offsets chunk is damaged: _salvage finds how far the rows can be read
            self.rows, most, self.metric_rows = _extent_rows(self._f)
        self.eval_rows = _eval_rows(self._f)
        self.cut_rows = most - self.rows  # rows written but not committed: in flight, or lost with a killed writer
        self.closed_cleanly = bool(self._f["progress"][2])
        self._salvage()

    def _salvage(self) -> None:
        """Clamp rows, metric rows and eval rows to what can be read (every complete step before any damage);
        warn once, naming the file and the step from which data is lost."""
        read = self.verify or _file_identity(self.path) in _READ_IN_FULL
        found = _salvageable(self._f, self.rows, self.metric_rows, self.eval_rows, read)
        if found is None:
            return
        self.rows, self.metric_rows, self.eval_rows, self.lost_from_step, where = found
        if stored := stored_eof(self.path):
            size = self.path.stat().st_size
            if size < stored:
                where = f"truncated: {size} of {stored} bytes"
        if self.lost_from_step is None:
            lost = f"the eval rows from eval {self.eval_rows + 1} on are lost"
        elif self.rows == 0 and self.metric_rows == 0:
            lost = "none of its steps can be read"
        else:
            lost = f"reading steps before {self.lost_from_step}; data from step {self.lost_from_step} on is lost"
        damage = f"{self.path} is damaged ({where}): {lost}"
        self.damage = damage
        if self.warn and damage not in _WARNED:  # once per process, however many readers a command opens
            _WARNED.add(damage)
            log.warning("warning: %s", damage)

    def _damage_found_while_reading(self) -> TrajectoryLogDamaged:
        """A chunk failed to decompress (flipped or zeroed bytes): scan the whole file, and make every later
        reader of this file do so too (the caller runs again: commands.analysis)."""
        _READ_IN_FULL.add(_file_identity(self.path))
        self.verify = True
        try:
            self._salvage()
        except READ_ERRORS:
            pass
        return TrajectoryLogDamaged(self.path, self.damage or "unreadable data", found_while_reading=True)

    def _datasets(self) -> Iterator[h5py.Dataset]:
        yield self._f["progress"]
        for ds in self._f["traj"].values():
            yield ds
        for ds in self._f["metrics"].values():
            yield ds
        if "eval" in self._f:
            for ds in self._f["eval"].values():
                yield ds

    @property
    @_damage_checked
    def n_tokens(self) -> int:
        traj = self._f["traj"]
        return int(traj["prompt_offsets"][self.rows]) + int(traj["response_offsets"][self.rows])

    def status_line(self) -> str:
        """Says whether the log is complete, being written, or was cut by a killed writer."""
        if self.closed_cleanly:
            return f"{self.rows} trajectories, closed cleanly"
        cut = f"; {self.cut_rows} uncommitted rows ignored" if self.cut_rows else ""
        return f"{self.rows} committed trajectories; not closed (still being written, or its writer was killed){cut}"

    def has_column(self, name: str) -> bool:
        """Whether the file stores column `name` (a log older than a FIXED_DTYPE field reads it as zeros)."""
        return name in self._f["traj"]

    @_damage_checked
    def _read(self, name: str, lo: int, hi: int) -> np.ndarray:
        traj = self._f["traj"]
        if name in traj:
            return traj[name][lo:hi]
        return np.zeros(max(0, min(hi, self.rows) - lo), _ROW_DTYPES[name])

    def column(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        if name not in _ROW_DTYPES:
            raise KeyError(f"no trajectory column '{name}'; columns: {', '.join(ROW_COLUMNS)}")
        stop = self.rows if stop is None else min(stop, self.rows)
        return self._read(name, start, stop)

    def iter_chunks(
        self, rows: int = 65536, columns: list[str] | None = None, start: int = 0, stop: int | None = None
    ) -> Iterator[dict[str, np.ndarray]]:
        """Per-trajectory columns in chunks of `rows` (bounded memory); each chunk also has 'row' indices."""
        names = columns or ROW_COLUMNS
        stop = self.rows if stop is None else min(stop, self.rows)
        for lo in range(start, stop, rows):
            hi = min(lo + rows, stop)
            chunk = {name: self._read(name, lo, hi) for name in names}
            chunk["row"] = np.arange(lo, hi, dtype=np.int64)
            yield chunk

    @_damage_checked
    def batch(self, rows) -> TrajectoryBatch:
        """Rows (a slice or indices) as a TrajectoryBatch; columns `step`/`staleness` are in .column()."""
        if isinstance(rows, slice):
            lo, hi, _ = rows.indices(self.rows)
            idx = np.arange(lo, max(lo, hi))
        else:
            idx = np.asarray(rows, np.int64).reshape(-1)
        if len(idx) and (idx.min() < 0 or idx.max() >= self.rows):
            raise IndexError(f"rows must be in 0..{self.rows - 1}")
        traj = self._f["traj"]
        fixed = np.zeros(len(idx), FIXED_DTYPE)
        contiguous = len(idx) > 0 and bool(np.all(np.diff(idx) == 1))
        lo, hi = (int(idx[0]), int(idx[-1]) + 1) if len(idx) else (0, 0)
        for name in ROW_COLUMNS[:-2]:
            if name not in traj:  # a log older than this field: left 0
                continue
            fixed[name] = traj[name][lo:hi] if contiguous else np.array([traj[name][i] for i in idx], FIXED_DTYPE[name])
        parts = {}
        for name, dtype, length_field in RAGGED:
            if OFFSETS[length_field] not in traj:  # a log older than its length field: no entries
                parts[name] = np.zeros(0, dtype)
                continue
            offsets = traj[OFFSETS[length_field]]
            if name not in traj:  # a log older than this array: zeros
                ends = [(int(offsets[i]), int(offsets[i + 1])) for i in idx]
                parts[name] = np.zeros(sum(b - a for a, b in ends), dtype)
            elif contiguous:
                parts[name] = traj[name][int(offsets[lo]) : int(offsets[hi])]
            else:
                pieces = [traj[name][int(offsets[i]) : int(offsets[i + 1])] for i in idx]
                parts[name] = np.concatenate(pieces) if pieces else np.zeros(0, dtype)
        return TrajectoryBatch(fixed, **parts)

    @_damage_checked
    def ragged_chunk(self, name: str, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """(offsets from 0, n+1 entries; flat values) of ragged array `name` for rows [lo, hi)."""
        length_field = {n: lf for n, _, lf in RAGGED}[name]
        if OFFSETS[length_field] not in self._f["traj"]:  # a log older than its length field: no entries
            return np.zeros(hi - lo + 1, np.int64), np.zeros(0, dict((n, d) for n, d, _ in RAGGED)[name])
        offsets = self._f["traj"][OFFSETS[length_field]][lo : hi + 1]
        if name not in self._f["traj"]:  # a log older than this array: zeros
            return offsets - offsets[0], np.zeros(
                int(offsets[-1] - offsets[0]), dict((n, d) for n, d, _ in RAGGED)[name]
            )
        values = self._f["traj"][name][int(offsets[0]) : int(offsets[-1])]
        return offsets - offsets[0], values

    def metric_names(self) -> list[str]:
        names = [c.decode() for c in self._f["metrics/columns"][:]]
        return names[: self._f["metrics/values"].shape[1]]

    @_damage_checked
    def metrics(self, dedupe: bool = True) -> dict[str, np.ndarray]:
        """The per-step table as {column: float64 array} (NaN where a step did not report a metric).
        dedupe: a step logged twice (a resume that replayed it) keeps its last row; rows sorted by step."""
        names = self.metric_names()
        values = self._f["metrics/values"][: self.metric_rows, : len(names)]
        if dedupe:
            values = _dedupe_by_step(values)
        return {name: values[:, i] for i, name in enumerate(names)}

    def eval_names(self) -> list[str]:
        """Columns of the eval table ([] for a log without one)."""
        if "eval" not in self._f:
            return []
        names = [c.decode() for c in self._f["eval/columns"][:]]
        return names[: self._f["eval/values"].shape[1]]

    @_damage_checked
    def eval_metrics(self, dedupe: bool = True) -> dict[str, np.ndarray]:
        """The eval table as {column: float64 array}, one entry per eval (NaN where an eval did not report
        a metric); {} when the log has no eval rows (or predates the eval table). dedupe: a step evaluated
        twice keeps its last row; rows sorted by step."""
        if not self.eval_rows:
            return {}
        names = self.eval_names()
        values = self._f["eval/values"][: self.eval_rows, : len(names)]
        if dedupe:
            values = _dedupe_by_step(values)
        return {name: values[:, i] for i, name in enumerate(names)}

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> TrajectoryReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """The per-step metrics of a log as one dict per step, in step order (unreported metrics left out)."""
    with TrajectoryReader(path) as reader:
        table = reader.metrics()
    names = list(table)
    rows = np.column_stack([table[n] for n in names]) if names else np.zeros((0, 0))
    return [{n: float(v) for n, v in zip(names, row) if not np.isnan(v)} for row in rows]


def read_eval(path: str | Path) -> list[dict[str, float]]:
    """The eval rows of a log as one dict per eval, in step order (unreported metrics left out; [] if none)."""
    with TrajectoryReader(path) as reader:
        table = reader.eval_metrics()
    if not table:
        return []
    names = list(table)
    rows = np.column_stack([table[n] for n in names])
    return [{n: float(v) for n, v in zip(names, row) if not np.isnan(v)} for row in rows]


def read_meta(reader: TrajectoryReader) -> dict[str, Any]:
    meta = json.loads(reader.meta.get("meta_json", "{}"))
    meta.update({k: v for k, v in reader.meta.items() if k != "meta_json"})
    return meta


# --- repairing a damaged log (resume) ----------------------------------------------------------------------

COPY_ELEMENTS = 1 << 20  # elements per read when copying a log's readable prefix (bounded memory)


def repair_log(path: str | Path, resume_step: int | None = None, verify: bool = True) -> dict | None:
    """If the log is damaged: keep it aside as trajectories.damaged-<time>.h5 and put in its place a log of
    what can be read of it (every complete step before the damage); None if it is not damaged (or absent).

    Returns {damage, kept_as, steps_kept (first, last) | None, rows_kept, lost (first, last) | None}: `lost`
    are the steps up to `resume_step` (the checkpoint's last step) whose log rows are gone. They were trained
    on, so they are not redone and cannot be logged again; steps after resume_step are redone and logged by
    the resumed run (reopening cuts the log back to resume_step). The caller holds the writer lock or knows
    no writer is alive. verify=False checks only the structure (finds a truncation; cheap on the ranks)."""
    path = log_path(path)
    if not path.is_file() or path.stat().st_size == 0:
        return None
    try:
        reader: TrajectoryReader | None = TrajectoryReader(path, verify=verify, warn=False)
    except TrajectoryLogDamaged as exc:
        reader, damage = None, exc.reason
    if reader is not None:
        if reader.damage is None:
            reader.close()
            return None
        damage = reader.damage.split(" is damaged (", 1)[1].split("): ", 1)[0]
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = path.with_name(f"trajectories.damaged-{stamp}.h5")
    report: dict[str, Any] = {"damage": damage, "kept_as": aside.name, "rows_kept": 0, "steps_kept": None}
    tmp = atomic.temp_path(path)
    first_lost = 0
    if reader is not None:
        with reader:
            first_lost = reader.lost_from_step if reader.lost_from_step is not None else 1 << 62
            try:
                _copy_readable(reader, tmp)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            steps = reader.metrics().get("step", np.zeros(0))
            report["rows_kept"] = reader.rows
            if len(steps):
                report["steps_kept"] = (int(steps.min()), int(steps.max()))
    last = resume_step if resume_step is not None else None
    report["lost"] = (first_lost, last) if last is not None and first_lost <= last else None
    os.replace(path, aside)
    if tmp.exists():
        atomic.publish(tmp, path)
    atomic.fsync_dir(path.parent)
    return report


def repair_message(path: Path, report: dict) -> str:
    """One line on what repair_log did, for the resume output and the ranks' log."""
    kept = report["steps_kept"]
    now = f"a repaired log of steps {kept[0]}..{kept[1]}" if kept else "a new log (nothing in it could be read)"
    lost = report["lost"]
    what = (
        f"lost: the log rows of steps {lost[0]}..{lost[1]} (trained on already, so not redone and not logged "
        f"again; the training state in the checkpoint is intact)"
        if lost
        else "no logged step the checkpoint covers is lost"
    )
    return f"{path} was damaged ({report['damage']}): kept it as {report['kept_as']}; continuing with {now}; {what}"


def _copy_readable(reader: TrajectoryReader, dst: Path) -> None:
    """A new log at `dst` holding the reader's readable rows, metric rows and eval rows (closed cleanly)."""
    old = reader._f
    traj = old["traj"]
    rows = reader.rows
    with h5py.File(dst, "w", libver="latest", locking=False) as f:
        for key, value in old.attrs.items():
            f.attrs[key] = value
        filters = _filters_like(traj["step"])
        new = f.create_group("traj")
        for name in ROW_COLUMNS:
            ds = new.create_dataset(name, (0,), _ROW_DTYPES[name], maxshape=(None,), chunks=(ROW_CHUNK,), **filters)
            _copy_prefix(traj[name] if name in traj else None, ds, rows)
        for offsets_name in OFFSETS.values():  # offsets start at 0 (row r: [offsets[r], offsets[r + 1]))
            ds = new.create_dataset(
                offsets_name, data=np.zeros(1, np.int64), maxshape=(None,), chunks=(ROW_CHUNK,), **filters
            )
            _copy_prefix(traj[offsets_name] if offsets_name in traj else None, ds, rows + 1, start=1)
        for name, dtype, length_field in RAGGED:
            offsets_name = OFFSETS[length_field]
            end = int(traj[offsets_name][rows]) if rows and offsets_name in traj else 0
            ds = new.create_dataset(name, (0,), dtype, maxshape=(None,), chunks=(TOKEN_CHUNK,), **filters)
            _copy_prefix(traj[name] if name in traj else None, ds, end)
        for group, n in (("metrics", reader.metric_rows), ("eval", reader.eval_rows)):
            if group not in old:
                continue
            names = old[f"{group}/columns"][:]
            g = f.create_group(group)
            g.create_dataset("columns", data=names, maxshape=(None,), chunks=old[f"{group}/columns"].chunks)
            values = old[f"{group}/values"]
            g.create_dataset(
                "values",
                data=values[:n],
                maxshape=(None, None),
                chunks=values.chunks,
                fillvalue=np.nan,
            )
            if group == "eval":
                g.create_dataset("committed", data=np.array([n], np.int64))
        if "eval" not in f:
            _create_eval_group(f)
        f.create_dataset("progress", data=np.array([rows, reader.metric_rows, 1], np.int64))


def _copy_prefix(src: h5py.Dataset | None, dst: h5py.Dataset, n: int, start: int = 0) -> None:
    """Elements [start, n) of src (zeros where the log predates the column) appended to dst, in pieces."""
    for lo in range(start, n, COPY_ELEMENTS):
        hi = min(lo + COPY_ELEMENTS, n)
        _extend(dst, src[lo:hi] if src is not None else np.zeros(hi - lo, dst.dtype))
