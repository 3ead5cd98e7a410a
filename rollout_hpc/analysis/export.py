"""Export a trajectory log as Parquet or CSV tables (pyarrow), streamed in chunks.

Two tables: one row per trajectory (fixed fields, step, staleness; the prompt and
response decoded as text where the run's tokenizer loads; ragged token arrays as
list columns on request) and one row per train step (the metrics); a third, one
row per eval, when the run validated during training.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from rollout_hpc.config import UserError
from rollout_hpc.store.trajlog import ROW_COLUMNS, TrajectoryReader
from rollout_hpc.trajectory import RAGGED

RAGGED_NAMES = [name for name, _, _ in RAGGED]
TEXT_COLUMNS = {"prompt_text": "prompt_ids", "response_text": "response_ids"}  # decoded from these token arrays
CHUNK_ROWS = 1 << 16
FORMATS = ("parquet", "csv")


def _check_columns(columns: list[str] | None, fmt: str) -> tuple[list[str], list[str]]:
    columns = columns or ROW_COLUMNS
    unknown = [c for c in columns if c not in ROW_COLUMNS and c not in RAGGED_NAMES]
    if unknown:
        raise UserError(f"unknown column(s) {', '.join(unknown)}; choose from {', '.join(ROW_COLUMNS + RAGGED_NAMES)}")
    ragged = [c for c in columns if c in RAGGED_NAMES]
    if ragged and fmt == "csv":
        raise UserError(f"CSV cannot hold the token-list column(s) {', '.join(ragged)}; use --format parquet")
    return [c for c in columns if c in ROW_COLUMNS], ragged


class _TableWriter:
    def __init__(self, path: Path, fmt: str, schema: pa.Schema) -> None:
        self.writer = pq.ParquetWriter(path, schema) if fmt == "parquet" else pacsv.CSVWriter(path, schema)

    def write(self, table: pa.Table) -> None:
        self.writer.write_table(table)

    def close(self) -> None:
        self.writer.close()


def _decoded(reader: TrajectoryReader, name: str, lo: int, hi: int, decode: Callable[[np.ndarray], str]) -> pa.Array:
    offsets, values = reader.ragged_chunk(name, lo, hi)
    return pa.array([decode(values[a:b]) for a, b in zip(offsets[:-1], offsets[1:])], pa.large_string())


def export_trajectories(
    reader: TrajectoryReader,
    path: Path,
    fmt: str,
    columns: list[str] | None = None,
    chunk_rows: int = CHUNK_ROWS,
    decode: Callable[[np.ndarray], str] | None = None,
) -> int:
    """Write the per-trajectory table; returns rows written. decode (token ids -> text): adds the columns
    prompt_text and response_text."""
    fixed, ragged = _check_columns(columns, fmt)
    writer = None
    written = 0
    for chunk in reader.iter_chunks(chunk_rows, fixed):
        lo, hi = int(chunk["row"][0]), int(chunk["row"][-1]) + 1
        arrays = {"row": pa.array(chunk["row"])}
        arrays.update({name: pa.array(chunk[name]) for name in fixed})
        for name in ragged:
            offsets, values = reader.ragged_chunk(name, lo, hi)
            arrays[name] = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))
        if decode is not None:
            for text, ids in TEXT_COLUMNS.items():
                arrays[text] = _decoded(reader, ids, lo, hi, decode)
        table = pa.table(arrays)
        if writer is None:
            writer = _TableWriter(path, fmt, table.schema)
        writer.write(table)
        written += table.num_rows
    if writer is None:  # an empty log still gets a file with the columns
        empty = {"row": pa.array([], pa.int64())}
        empty.update({name: pa.array(np.zeros(0, reader.column(name, 0, 0).dtype)) for name in fixed})
        if decode is not None:
            empty.update({text: pa.array([], pa.large_string()) for text in TEXT_COLUMNS})
        writer = _TableWriter(path, fmt, pa.table(empty).schema)
    writer.close()
    return written


def export_columns(columns: dict, path: Path, fmt: str) -> int:
    """Write {name: array} (the per-step metrics, the eval rows) as one table."""
    table = pa.table({name: pa.array(values) for name, values in columns.items()})
    writer = _TableWriter(path, fmt, table.schema)
    writer.write(table)
    writer.close()
    return table.num_rows


def export_steps(reader: TrajectoryReader, path: Path, fmt: str) -> int:
    return export_columns(reader.metrics(), path, fmt)


def export_eval(reader: TrajectoryReader, path: Path, fmt: str) -> int:
    return export_columns(reader.eval_metrics(), path, fmt)


def export_run(
    run_dir_or_log: str | Path,
    fmt: str = "parquet",
    out_dir: str | Path | None = None,
    columns: list[str] | None = None,
    chunk_rows: int = CHUNK_ROWS,
    decode: Callable[[np.ndarray], str] | None = None,
) -> dict[str, tuple[Path, int]]:
    """Write trajectories.<fmt> and steps.<fmt> (and eval.<fmt> when the log has eval rows) into out_dir
    (default RUN_DIR/export); with decode, the trajectories get prompt_text and response_text columns."""
    if fmt not in FORMATS:
        raise UserError(f"unknown export format '{fmt}'; use one of {', '.join(FORMATS)}")
    _check_columns(columns, fmt)
    with TrajectoryReader(run_dir_or_log) as reader:
        out = Path(out_dir) if out_dir else reader.path.parent / "export"
        out.mkdir(parents=True, exist_ok=True)
        traj_path, steps_path = out / f"trajectories.{fmt}", out / f"steps.{fmt}"
        rows = export_trajectories(reader, traj_path, fmt, columns, chunk_rows, decode)
        steps = export_steps(reader, steps_path, fmt)
        written = {"trajectories": (traj_path, rows), "steps": (steps_path, steps)}
        if reader.eval_rows:
            eval_path = out / f"eval.{fmt}"
            written["eval"] = (eval_path, export_eval(reader, eval_path, fmt))
    return written
