"""Prompt dataset files: read JSON lines / JSON / Parquet / `datasets.save_to_disk` directories into an
Arrow table, check it, write it once as an Arrow IPC file that every generator rank memory-maps, and
read prompts from it lazily (docs/datasets.md).

    table = read_table("gsm8k.jsonl");  check_table(table, "gsm8k.jsonl")
    write_arrow(table, run_dir / "prompts.arrow")          # once (atomic)
    rows = PromptRows(open_arrow(run_dir / "prompts.arrow"))   # each rank: memory-mapped, zero copy
    stream = EpochShuffled(rows, seed=0)                   # stream[i]: infinite, reshuffled every epoch

Only pyarrow and numpy here: the `datasets` library is not needed to read its save_to_disk layout.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from rollout_hpc.errors import DatasetError

from .base import Prompt

CHAT_ROLES = ("system", "user", "assistant", "tool")
JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")
ARROW_SUFFIXES = (".arrow", ".feather", ".ipc")
_FORMATS_HELP = (
    ".jsonl / .json (JSON lines or a JSON array of objects), .parquet, .arrow, a directory written by "
    "datasets' save_to_disk, or a directory of *.parquet / *.jsonl shards"
)
_SPLIT_TAG = (1 << 32) + 0x5B1  # seeds split_rows' generator apart from the per-epoch shuffles [seed, epoch]
_SOURCE_TAG = (1 << 32) + 0x50C  # seeds a mixture source's epoch shuffles [seed, tag, source, epoch]


# ---------------------------------------------------------------------------------------------------------------
# Reading


def read_table(path: str | Path) -> pa.Table:
    """The rows of a dataset file or directory as one Arrow table (columns = the records' keys)."""
    p = Path(path)
    if not p.exists():
        raise DatasetError(f"dataset file {p} does not exist; point the dataset path at an existing {_FORMATS_HELP}")
    if p.is_dir():
        return _read_dir(p)
    suffix = _suffix(p)
    if suffix in JSON_SUFFIXES:
        return _read_json(p)
    if suffix in PARQUET_SUFFIXES:
        return _read_parquet(p)
    if suffix in ARROW_SUFFIXES:
        return _read_arrow_any(p)
    raise DatasetError(
        f"dataset file {p} has an unknown extension '{p.suffix}'; use {_FORMATS_HELP} "
        "(convert other formats first, e.g. with pandas: df.to_parquet('data.parquet'))"
    )


def _suffix(p: Path) -> str:
    return p.suffix.lower()


def _read_dir(p: Path) -> pa.Table:
    if (p / "dataset_dict.json").exists():
        splits = sorted(d.name for d in p.iterdir() if d.is_dir())
        example = p / ("train" if "train" in splits or not splits else splits[0])
        raise DatasetError(
            f"dataset directory {p} holds a DatasetDict (splits: {', '.join(splits) or 'none'}); "
            f"point at one split, e.g. {example}"
        )
    if (p / "state.json").exists():
        return _read_save_to_disk(p)
    files = sorted(f for f in p.iterdir() if f.is_file() and not f.name.startswith("."))
    for suffixes, reader in (
        (PARQUET_SUFFIXES, _read_parquet),
        (JSON_SUFFIXES, _read_json),
        (ARROW_SUFFIXES, _read_arrow_any),
    ):
        shards = [f for f in files if _suffix(f) in suffixes]
        if shards:
            return _concat([reader(f) for f in shards], p, [f.name for f in shards])
    raise DatasetError(
        f"dataset directory {p} has no state.json (datasets' save_to_disk layout) and no *.parquet, "
        f"*.jsonl/*.json or *.arrow shards; point the dataset path at a {_FORMATS_HELP}"
    )


def _read_save_to_disk(p: Path) -> pa.Table:
    try:
        state = json.loads((p / "state.json").read_text())
        names = [f["filename"] for f in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DatasetError(
            f"dataset directory {p}: state.json is not a datasets save_to_disk state ({exc}); "
            "write it again with Dataset.save_to_disk(dir)"
        ) from None
    if not names:
        raise DatasetError(
            f"dataset directory {p}: state.json lists no data files; write it again with Dataset.save_to_disk(dir)"
        )
    if state.get("_indices_data_files"):
        raise DatasetError(
            f"dataset directory {p} stores an indices mapping (a select/shuffle not flattened); "
            "write it again after dataset.flatten_indices()"
        )
    tables = []
    for name in names:
        f = p / name
        if not f.is_file():
            raise DatasetError(
                f"dataset directory {p}: data file {name} listed in state.json is missing; "
                "copy the whole directory or write it again with Dataset.save_to_disk(dir)"
            )
        tables.append(_read_arrow_any(f))
    return _concat(tables, p, names)


def _read_arrow_any(f: Path) -> pa.Table:
    """An Arrow IPC stream (datasets' .arrow files) or file, memory-mapped."""
    try:
        source = pa.memory_map(str(f), "r")
    except OSError as exc:
        raise DatasetError(f"dataset file {f} cannot be opened ({exc}); check its permissions") from None
    errors = []
    for opener in (ipc.open_stream, ipc.open_file):
        try:
            source.seek(0)
            return opener(source).read_all()
        except (pa.ArrowInvalid, OSError) as exc:
            errors.append(str(exc))
    raise DatasetError(
        f"dataset file {f} is not an Arrow IPC stream or file ({errors[-1]}); "
        "write it again (Dataset.save_to_disk or pyarrow.ipc)"
    )


def _read_parquet(f: Path) -> pa.Table:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(str(f))
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(
            f"dataset file {f} is not a readable Parquet file ({exc}); write it again, e.g. "
            "pyarrow.parquet.write_table(table, path) or df.to_parquet(path)"
        ) from None


def _read_json(f: Path) -> pa.Table:
    with open(f, "rb") as fh:
        head = fh.read(4096).lstrip()
    if head.startswith(b"\xef\xbb\xbf"):
        head = head[3:].lstrip()
    if not head:
        return pa.table({})
    if head.startswith(b"["):
        try:
            records = json.loads(f.read_text(encoding="utf-8-sig"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise DatasetError(
                f"dataset file {f} starts with '[' but is not valid JSON ({exc}); write a JSON array "
                "of objects, or one JSON object per line (.jsonl)"
            ) from None
        if not isinstance(records, list):
            raise DatasetError(
                f'dataset file {f} is not a JSON array of objects; write [{{"prompt": ...}}, ...] '
                "or one JSON object per line (.jsonl)"
            )
        return _table_from_records(records, f, "element")
    if not head.startswith(b"{"):
        raise DatasetError(
            f"dataset file {f} is neither JSON lines (one object per line) nor a JSON array of "
            f'objects (it starts with {head[:20]!r}); write one {{"prompt": ...}} object per line'
        )
    import pyarrow.json as pj

    try:  # fast path: Arrow's multithreaded JSON-lines reader
        table = pj.read_json(str(f))
        if not any(_has_temporal(t) for t in table.schema.types):
            return table
        # it turned strings that look like dates into timestamps ("2021-01-01"): keep the strings
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        pass  # mixed types, bad lines...: parse in Python for a message that names the line
    records = []
    with open(f, encoding="utf-8-sig") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except ValueError as exc:
                raise DatasetError(
                    f"dataset file {f}: line {lineno} is not valid JSON ({exc}); each line must be one JSON object"
                ) from None
    return _table_from_records(records, f, "line")


def _has_temporal(t: pa.DataType) -> bool:
    if pa.types.is_temporal(t):
        return True
    if pa.types.is_struct(t):
        return any(_has_temporal(t.field(j).type) for j in range(t.num_fields))
    if _is_listish(t):
        return _has_temporal(t.value_type)
    return False


def _kind(v: Any) -> str:
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "a list"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__


def _table_from_records(records: Sequence[Any], f: Path, unit: str) -> pa.Table:
    """Columns from a list of JSON objects; a column mixing kinds of value names its first odd row."""
    keys: dict[str, None] = {}
    for i, r in enumerate(records):
        if not isinstance(r, dict):
            raise DatasetError(
                f"dataset file {f}: row {i} is {_kind(r)} ({_short(r)}), not an object; every "
                f'{unit} must be a JSON object like {{"prompt": ..., "answer": ...}}'
            )
        for k in r:
            keys.setdefault(k, None)
    columns = {}
    for k in keys:
        values = [r.get(k) for r in records]
        try:
            columns[k] = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError) as exc:
            raise DatasetError(_mixed_column_message(f, k, values, exc)) from None
    return pa.table(columns)


def _mixed_column_message(f: Path, key: str, values: list, exc: Exception) -> str:
    first = next((i for i, v in enumerate(values) if v is not None), None)
    bad = None
    if first is not None:
        kind0 = _kind(values[first])
        bad = next(
            (i for i in range(first + 1, len(values)) if values[i] is not None and _kind(values[i]) != kind0), None
        )
        if bad is None:  # same kind, incompatible inside (e.g. nested lists): find the first row Arrow refuses
            for i in range(first + 1, len(values)):
                try:
                    pa.array([values[first], values[i]])
                except (pa.ArrowException, OverflowError):
                    bad = i
                    break
    if bad is None:
        return f"dataset file {f}: column '{key}' cannot be stored as one Arrow column ({exc})"
    assert first is not None  # bad is searched for only after the first non-null row
    hint = ""
    if {_kind(values[first]), _kind(values[bad])} == {"a string", "a number"}:
        hint = ' (to mix numbers and text, write the numbers as strings: "7")'
    return (
        f"dataset file {f}: column '{key}' row {bad} holds {_kind(values[bad])} ({_short(values[bad])}) but row "
        f"{first} holds {_kind(values[first])}; every row of a column must hold the same kind of value{hint}: "
        'prompts are strings or lists of {"role", "content"} messages, answers strings, numbers or lists '
        "of them"
    )


def _concat(tables: list[pa.Table], where: Path, names: list[str]) -> pa.Table:
    tables = [t for t in tables if t.num_columns or t.num_rows]
    if not tables:
        return pa.table({})
    if len(tables) == 1:
        return tables[0]
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
        raise DatasetError(
            f"dataset {where}: the shards {', '.join(names)} do not share one schema ({exc}); "
            "give every shard the same columns with the same types"
        ) from None


def _short(v: Any, n: int = 60) -> str:
    s = repr(v)
    return s if len(s) <= n else s[: n - 3] + "..."


# ---------------------------------------------------------------------------------------------------------------
# Checking


def _is_stringish(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or getattr(pa.types, "is_string_view", bool)(t)


def _is_listish(t: pa.DataType) -> bool:
    return (
        pa.types.is_list(t)
        or pa.types.is_large_list(t)
        or pa.types.is_fixed_size_list(t)
        or getattr(pa.types, "is_list_view", bool)(t)
        or getattr(pa.types, "is_large_list_view", bool)(t)
    )


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t) or pa.types.is_boolean(t)


def _first_true(mask: pa.ChunkedArray | pa.Array) -> int | None:
    """Index of the first true value of a boolean array (vectorized), or None."""
    if isinstance(mask, pa.ChunkedArray) and mask.num_chunks == 0:
        return None
    idx = pc.index(pc.fill_null(mask, False), True).as_py()
    return None if idx is None or idx < 0 else idx


def _row_value(col: pa.ChunkedArray, i: int) -> Any:
    return col.slice(i, 1).to_pylist()[0]


def check_table(
    table: pa.Table,
    path: str | Path,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    require_answer: bool = True,
) -> None:
    """Raise DatasetError unless the table has rows, a prompt column of strings or chat messages and (when
    required) an answer column of strings, numbers or lists of them without nulls. Vectorized: a few million
    rows take well under a second; per-row work happens only to describe the first bad row."""
    where = f"dataset {path}"
    if table.num_rows == 0:
        raise DatasetError(f"{where} has no rows; give it one record per prompt (e.g. one JSON object per line)")
    names = table.column_names
    if prompt_key not in names:
        raise DatasetError(
            f"{where} has no column '{prompt_key}' (its columns: {', '.join(names) or 'none'}); "
            "set prompt_key to the column that holds the prompts"
        )
    _check_prompts(table.column(prompt_key), prompt_key, where)
    if answer_key not in names:
        if require_answer:
            raise DatasetError(
                f"{where} has no column '{answer_key}' (its columns: {', '.join(names)}); set "
                "answer_key to the column that holds the answers (or use a reward "
                "that needs no answer)"
            )
        return
    _check_answers(table.column(answer_key), answer_key, where, require_answer)


def _check_prompts(col: pa.ChunkedArray, key: str, where: str) -> None:
    t = col.type
    expected = 'a string or a list of {"role", "content"} chat messages'
    if _is_stringish(t):
        bad = _first_true(pc.is_null(col))
        if bad is not None:
            raise DatasetError(f"{where}: row {bad} has no prompt ('{key}' is null); every row needs {expected}")
        return
    if not (_is_listish(t) and pa.types.is_struct(t.value_type)):
        bad = _first_true(pc.is_valid(col))
        if bad is None:
            bad = 0
        raise DatasetError(
            f"{where}: row {bad} holds {_short(_row_value(col, bad))} ({t}) in '{key}'; a prompt must be {expected}"
        )
    # chat messages: list<struct<role, content, ...>>
    bad = _first_true(pc.is_null(col))
    if bad is not None:
        raise DatasetError(f"{where}: row {bad} has no prompt ('{key}' is null); every row needs {expected}")
    lengths = pc.list_value_length(col)
    bad = _first_true(pc.equal(lengths, 0))
    if bad is not None:
        raise DatasetError(
            f"{where}: row {bad} has an empty message list in '{key}'; a chat prompt needs at least "
            'one {"role": "user", "content": ...} message'
        )
    st = t.value_type
    fields = {st.field(j).name: st.field(j).type for j in range(st.num_fields)}
    for name in ("role", "content"):
        if name not in fields:
            raise DatasetError(
                f"{where}: row 0 message 0 of '{key}' has no '{name}' (the messages have only "
                f"{', '.join(fields) or 'no keys'}); every message needs a 'role' ("
                f"{'/'.join(CHAT_ROLES)}) and a string 'content'"
            )
        if not (_is_stringish(fields[name]) or pa.types.is_null(fields[name])):
            raise DatasetError(
                f"{where}: the messages' '{name}' in '{key}' holds {fields[name]} values, not strings; "
                f"every message needs a 'role' ({'/'.join(CHAT_ROLES)}) and a string 'content'"
            )
    flat = pc.list_flatten(col)
    roles, contents = pc.struct_field(flat, "role"), pc.struct_field(flat, "content")
    ends = np.cumsum(pc.list_value_length(col).to_numpy(zero_copy_only=False), dtype=np.int64)
    starts = ends - pc.list_value_length(col).to_numpy(zero_copy_only=False)

    def at(k: int) -> tuple[int, int]:  # flattened message index -> (row, message index in the row)
        row = int(np.searchsorted(ends, k, side="right"))
        return row, k - int(starts[row])

    for name, values in (("content", contents), ("role", roles)):
        k = _first_true(pc.is_null(values))
        if k is not None:
            row, m = at(k)
            raise DatasetError(
                f"{where}: row {row} message {m} of '{key}' has no '{name}' (it holds "
                f"{_short(_row_value(col, row)[m])}); every message needs a 'role' "
                f"({'/'.join(CHAT_ROLES)}) and a string 'content'"
            )
    k = _first_true(pc.invert(pc.is_in(roles, value_set=pa.array(CHAT_ROLES))))
    if k is not None:
        row, m = at(k)
        raise DatasetError(
            f"{where}: row {row} message {m} of '{key}' has role {_row_value(col, row)[m]['role']!r}; "
            f"roles are {', '.join(CHAT_ROLES)}"
        )
    is_user = pc.equal(roles, "user").to_numpy(zero_copy_only=False)
    users_before = np.concatenate([[0], np.cumsum(is_user, dtype=np.int64)])
    missing = np.flatnonzero(users_before[ends] == users_before[starts])
    if missing.size:
        row = int(missing[0])
        raise DatasetError(
            f"{where}: row {row} of '{key}' has no user message (roles: "
            f"{[m['role'] for m in _row_value(col, row)]}); a chat prompt needs a "
            '{"role": "user", "content": ...} message'
        )


def _check_answers(col: pa.ChunkedArray, key: str, where: str, require_answer: bool) -> None:
    t = col.type
    ok = (
        _is_stringish(t)
        or _is_number(t)
        or pa.types.is_null(t)
        or (
            _is_listish(t)
            and (_is_stringish(t.value_type) or _is_number(t.value_type) or pa.types.is_null(t.value_type))
        )
    )
    if not ok:
        bad = _first_true(pc.is_valid(col))
        bad = 0 if bad is None else bad
        raise DatasetError(
            f"{where}: row {bad} holds {_short(_row_value(col, bad))} ({t}) in '{key}'; an answer "
            "must be a string, a number, or a list of them (store structured answers as a JSON "
            "string, or in another column: other columns reach the reward as prompt.meta)"
        )
    if require_answer:
        bad = _first_true(pc.is_null(col))
        if bad is not None:
            raise DatasetError(
                f"{where}: row {bad} has no answer ('{key}' is null); give every row an answer, or drop those rows"
            )


# ---------------------------------------------------------------------------------------------------------------
# The prepared file


def write_arrow(table: pa.Table, path: str | Path, max_chunk_rows: int = 65536) -> None:
    """Write `table` as an Arrow IPC *file* at `path`, atomically (a temporary file in the same directory,
    fsynced, then renamed over `path`): readers see the old file or the whole new one."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    os.close(fd)
    try:
        with pa.OSFile(tmp, "wb") as sink:
            with ipc.new_file(sink, table.schema) as writer:
                writer.write_table(table, max_chunksize=max_chunk_rows)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:
        dfd = os.open(p.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def open_arrow(path: str | Path) -> pa.Table:
    """The table of an Arrow IPC file, memory-mapped: no copy, pages are read only when rows are touched (and
    shared between processes mapping the same file)."""
    p = Path(path)
    try:
        source = pa.memory_map(str(p), "r")
    except (OSError, pa.ArrowException) as exc:
        raise DatasetError(f"prepared dataset {p} cannot be opened ({exc}); prepare it again (write_arrow)") from None
    try:
        return ipc.open_file(source).read_all()
    except (pa.ArrowInvalid, OSError) as exc:
        raise DatasetError(
            f"prepared dataset {p} is not a complete Arrow IPC file ({exc}); delete it and "
            "prepare it again (write_arrow)"
        ) from None


# ---------------------------------------------------------------------------------------------------------------
# Splits and random access


def _seed(seed: int) -> int:
    return int(seed) % (1 << 64)


def split_rows(n: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded split of rows 0..n-1 into (train, val) index arrays: disjoint, together all rows, each sorted.
    The validation set holds round(n * val_fraction) rows, at least 1 when val_fraction > 0, and leaves at
    least one training row."""
    n = int(n)
    if n < 0:
        raise ValueError(f"split_rows: n must be >= 0, got {n}")
    if not (0.0 <= float(val_fraction) < 1.0):
        raise DatasetError(f"the validation fraction must be in [0, 1), got {val_fraction!r}")
    n_val = int(round(n * float(val_fraction)))
    if val_fraction > 0 and n >= 2:
        n_val = min(max(n_val, 1), n - 1)
    n_val = min(n_val, max(n - 1, 0))
    perm = np.random.default_rng([_seed(seed), _SPLIT_TAG]).permutation(n)
    return np.sort(perm[n_val:]).astype(np.int64), np.sort(perm[:n_val]).astype(np.int64)


class PromptRows:
    """Random access to prompts of a table: rows[i] -> Prompt. Reads one row at a time (nothing is
    converted up front), so a memory-mapped table stays mostly on disk."""

    def __init__(
        self,
        table: pa.Table,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        system_prompt: str | None = None,
        indices: Sequence[int] | np.ndarray | None = None,
    ) -> None:
        if prompt_key not in table.column_names:
            raise DatasetError(
                f"dataset has no column '{prompt_key}' (its columns: "
                f"{', '.join(table.column_names) or 'none'}); set prompt_key"
            )
        self.table, self.prompt_key, self.system_prompt = table, prompt_key, system_prompt
        self.answer_key = answer_key if answer_key in table.column_names else None
        self._batches = [b for b in table.to_batches() if b.num_rows]
        self._starts = np.cumsum([0] + [b.num_rows for b in self._batches], dtype=np.int64)
        if indices is None:
            self.indices = None
            self._n = table.num_rows
        else:
            idx = np.asarray(indices, dtype=np.int64)
            if idx.ndim != 1:
                raise ValueError("PromptRows: indices must be one-dimensional")
            if idx.size and (idx.min() < 0 or idx.max() >= table.num_rows):
                raise IndexError(f"PromptRows: indices must lie in [0, {table.num_rows})")
            self.indices, self._n = idx, int(idx.size)

    def __len__(self) -> int:
        return self._n

    def row_index(self, i: int) -> int:
        """The table row of item i."""
        i = int(i)
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"prompt index {i} is out of range for {self._n} rows")
        return int(self.indices[i]) if self.indices is not None else i

    def __getitem__(self, i: int) -> Prompt:
        r = self.row_index(i)
        b = int(np.searchsorted(self._starts, r, side="right")) - 1
        rec = self._batches[b].slice(r - int(self._starts[b]), 1).to_pylist()[0]
        return self._prompt(rec, r)

    def _prompt(self, rec: dict, r: int) -> Prompt:
        raw = rec.pop(self.prompt_key)
        answer = rec.pop(self.answer_key) if self.answer_key is not None else None
        if isinstance(raw, str):
            text, messages = raw, [{"role": "user", "content": raw}]
        else:
            messages = [{k: v for k, v in m.items() if v is not None or k in ("role", "content")} for m in raw]
            user_text = next((m["content"] for m in reversed(messages) if m.get("role") == "user"), None)
            # No user message: check_table refuses these; keep a usable text anyway.
            text = user_text if user_text is not None else messages[-1].get("content") or ""
        if self.system_prompt is not None and not any(m.get("role") == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        rec["row"] = r
        return Prompt(text=text, answer=answer, meta=rec, messages=tuple(messages))


class EpochShuffled:
    """Infinite stream over a finite PromptRows: item i is from epoch i // n, position i % n of a permutation
    seeded by (seed, epoch) — a new shuffle every epoch, the same for the same seed. shuffle=False keeps file
    order. Only the current epoch's permutation is kept. No __len__: the stream is infinite."""

    def __init__(self, rows: PromptRows, seed: int, shuffle: bool = True, source: int | None = None) -> None:
        self.rows, self.seed, self.shuffle = rows, _seed(seed), bool(shuffle)
        # A source of a mixture shuffles apart from the others (same size would mean the same order otherwise).
        self._key = [self.seed] if source is None else [self.seed, _SOURCE_TAG, int(source)]
        self.n = len(rows)
        if self.n == 0:
            raise DatasetError("the prompt dataset has no rows (after the train/validation split); give it more rows")
        self._cache: tuple[int, np.ndarray] | None = None

    def cursor(self, i: int) -> tuple[int, int]:
        """(epoch, position) of global index i."""
        i = int(i)
        if i < 0:
            raise IndexError(f"prompt index {i} is negative")
        epoch, pos = divmod(i, self.n)
        return epoch, pos

    def permutation(self, epoch: int) -> np.ndarray:
        cache = self._cache
        if cache is not None and cache[0] == epoch:
            return cache[1]
        # = default_rng([seed, epoch]).permutation(n) (same draws), in int32 when it fits: half the memory
        perm = np.arange(self.n, dtype=np.int32 if self.n < 2**31 else np.int64)
        np.random.default_rng([*self._key, int(epoch)]).shuffle(perm)
        self._cache = (epoch, perm)  # one epoch at a time (replaces the previous one atomically)
        return perm

    def position(self, i: int) -> int:
        """The PromptRows index of global index i."""
        epoch, pos = self.cursor(i)
        return int(self.permutation(epoch)[pos]) if self.shuffle else pos

    def __getitem__(self, i: int) -> Prompt:
        epoch, _ = self.cursor(i)
        p = self.rows[self.position(i)]
        p.meta["epoch"] = epoch
        return p


class QuotaLayout:
    """Where each source of a mixture sits in the run's one prompt stream. Every block of P = sum(quotas) prompts
    holds quotas[k] prompts of source k, in source order: global index i = b*P + j (j < P) is source k with
    starts[k] <= j < starts[k+1], at position b*quotas[k] + j - starts[k] of that source's own stream. Pure
    arithmetic both ways, so a step's prompts name each source's cursor (nothing else to checkpoint), and every
    source advances by exactly its quota per block."""

    def __init__(self, quotas: Sequence[int]) -> None:
        self.quotas = np.asarray(quotas, np.int64)
        if not len(self.quotas) or (self.quotas < 1).any():
            raise ValueError(f"QuotaLayout: every quota must be >= 1, got {list(quotas)}")
        self.block = int(self.quotas.sum())
        self.starts = np.concatenate([[0], np.cumsum(self.quotas)])

    def split(self, i) -> tuple[np.ndarray, np.ndarray]:
        """(source, position in the source's stream) of global index/indices i."""
        b, j = np.divmod(np.asarray(i, np.int64), self.block)
        k = np.searchsorted(self.starts, j, side="right") - 1
        return k, b * self.quotas[k] + j - self.starts[k]

    def domain_of(self, i) -> np.ndarray:
        return self.split(i)[0]

    def index(self, source: int, position) -> np.ndarray:
        """Global index/indices of source `source`'s stream position(s) (the inverse of split)."""
        b, r = np.divmod(np.asarray(position, np.int64), self.quotas[source])
        return b * self.block + self.starts[source] + r


class MixedStream:
    """Infinite prompt stream over several sources: item i is item `position` of source k's EpochShuffled stream
    (QuotaLayout.split), its Prompt carrying the source's name as `domain`."""

    def __init__(self, streams: Sequence[EpochShuffled], names: Sequence[str], quotas: Sequence[int]) -> None:
        self.streams, self.names, self.layout = list(streams), list(names), QuotaLayout(quotas)

    def domain_of(self, i) -> np.ndarray:
        return self.layout.domain_of(i)

    def cursor(self, i: int) -> tuple[int, int]:
        """(source, position in that source's stream) of global index i."""
        k, pos = self.layout.split(int(i))
        return int(k), int(pos)

    def __getitem__(self, i: int) -> Prompt:
        if int(i) < 0:
            raise IndexError(f"prompt index {i} is negative")
        k, pos = self.cursor(i)
        return replace(self.streams[k][pos], domain=self.names[k])


class MixedRows:
    """The held-out rows of several sources as one finite sequence, interleaved in proportion to their sizes (row p
    of source k sorts at (p + 0.5) / n_k), so eval.max_prompts' first N rows sample every source."""

    def __init__(self, rows: Sequence[PromptRows], names: Sequence[str]) -> None:
        self.rows, self.names = list(rows), list(names)
        source = np.concatenate([np.full(len(r), k, np.int64) for k, r in enumerate(self.rows)])
        pos = np.concatenate([np.arange(len(r), dtype=np.int64) for r in self.rows])
        sizes = np.array([len(r) for r in self.rows], np.float64)
        order = np.lexsort((source, (pos + 0.5) / sizes[source]))
        self._source, self._pos = source[order], pos[order]

    def __len__(self) -> int:
        return len(self._source)

    def domain_of(self, i) -> np.ndarray:
        return self._source[np.asarray(i, np.int64)]

    def __getitem__(self, i: int) -> Prompt:
        k = int(self._source[i])
        return replace(self.rows[k][int(self._pos[i])], domain=self.names[k])
