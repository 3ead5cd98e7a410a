"""The `dataset` task: prompts from the user's file (jsonl, json, parquet, save_to_disk), a verifiable reward
(task.reward), a held-out split for validation, and a data stream that is the run's data cursor.

    task:
      name: dataset
      reward: math                       # or exact, regex:PATTERN, a plugin
      params: {train: data/train.parquet, val: data/test.parquet, prompt_key: question, answer_key: answer,
               system_prompt: "...", chat_template: auto, shuffle: true}

Prompt i of the stream is row position i % n of epoch i // n, in a permutation seeded by (run.seed, epoch)
(envs.datafile.EpochShuffled): the step is still the whole data cursor, so exactly-once and bitwise-identical
resume hold across epoch boundaries. `rollout-hpc submit` freezes the data into RUN_DIR/data/{train,val}.arrow
(Arrow IPC, memory-mapped by every generator rank and reward worker): a resumed run reads exactly the rows the
first allocation read, even if the source file changed.

Mixing domains: task.params.train may be a list of sources {name, path, weight, reward, prompt_key, answer_key,
system_prompt}; the config turns the weights into per-step quotas (config.mixture_quotas), and every block of
P = prompts_per_step prompts of the stream holds each source's quota (datafile.QuotaLayout), each source read
through its own epoch-shuffled stream. Its rows are frozen as RUN_DIR/data/train-<name>.arrow (val-<name>.arrow).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from rollout_hpc.errors import DatasetError

from .datafile import (
    EpochShuffled,
    MixedRows,
    MixedStream,
    PromptRows,
    check_table,
    open_arrow,
    read_table,
    split_rows,
    write_arrow,
)

TRAIN_FILE, VAL_FILE = "train.arrow", "val.arrow"


def load_chat_template(spec: str) -> str:
    """task.params.chat_template: 'auto' and 'none' as they are, a .jinja path -> the template's text."""
    if spec in ("auto", "none"):
        return spec
    path = Path(str(spec)).expanduser()
    if path.suffix != ".jinja" or not path.is_file():
        raise DatasetError(
            f"task.params.chat_template '{spec}': expected auto, none, or an existing .jinja file "
            f"(relative paths start at {Path.cwd()})"
        )
    return path.read_text()


@dataclass
class Source:
    """One source of a mixed dataset: its rows, the keys to read them with, its reward spec and per-step quota."""

    name: str
    quota: int
    reward: str | None
    keys: tuple[str, str, str | None]  # (prompt_key, answer_key, system_prompt) of its training rows
    val_keys: tuple[str, str, str | None]  # the same for its held-out rows (default: the training rows')
    train: Any = None  # pa.Table
    val: Any = None  # pa.Table | None


class DatasetTask:
    def __init__(
        self,
        train: str | list[dict] | None = None,
        val: str | list[dict] | None = None,
        val_fraction: float | None = None,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        system_prompt: str | None = None,
        chat_template: str = "auto",
        shuffle: bool = True,
        split_seed: int = 0,
        data_dir: str | Path | None = None,
    ) -> None:
        if not train:
            raise DatasetError(
                "task.params.train is required for task.name 'dataset': the path of a .jsonl, .json, "
                ".parquet file or a datasets.save_to_disk directory"
            )
        if isinstance(val, list) and not isinstance(train, list):
            raise DatasetError(
                "task.params.val is a list of sources, which needs task.params.train as a list of sources with the "
                "same names; give val as one file"
            )
        if val and val_fraction:
            raise DatasetError("task.params: give val (a file) or val_fraction (a split of train), not both")
        if val_fraction is not None and not 0 < float(val_fraction) < 1:
            raise DatasetError(f"task.params.val_fraction must be between 0 and 1 (exclusive), got {val_fraction!r}")
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise DatasetError(f"task.params.system_prompt must be a string, got {type(system_prompt).__name__}")
        self.prompt_key, self.answer_key, self.system_prompt = prompt_key, answer_key, system_prompt
        self.shuffle = bool(shuffle)
        self.chat_template = load_chat_template(chat_template)
        frozen = Path(data_dir) if data_dir else None
        self.sources: list[Source] | None = None  # a mixture's sources (train as a list), else None
        if isinstance(train, list):
            self._read_sources(train, val, val_fraction, split_seed, frozen)
        elif frozen is not None and (frozen / TRAIN_FILE).is_file():
            self.train_table = open_arrow(frozen / TRAIN_FILE)
            self.val_table = open_arrow(frozen / VAL_FILE) if (frozen / VAL_FILE).is_file() else None
        else:
            self.train_table, self.val_table = self._read(train, val, val_fraction, split_seed)

    def _read(self, train: str, val: str | list[dict] | None, val_fraction: float | None, split_seed: int):
        keys = (self.prompt_key, self.answer_key)
        return self._read_split(train, val, val_fraction, split_seed, keys, keys)

    def _read_sources(
        self, train: list[dict], val: str | list[dict] | None, val_fraction: float | None, split_seed: int, frozen
    ) -> None:
        """A mixture: each source's rows (read and checked, or the frozen ones), its held-out rows, its quota."""
        val_specs = {v["name"]: v for v in val} if isinstance(val, list) else {}
        self.sources, self.train_table, self.val_table = [], None, None
        for i, spec in enumerate(train):
            name = spec["name"]
            if spec.get("quota") is None:
                raise DatasetError(
                    f"task.params.train[{i}] ({name}) has no quota: load the config with rollout_hpc.config.load_config, "
                    "which derives each source's quota from its weight and algorithm.prompts_per_step"
                )
            keys = (
                spec.get("prompt_key") or self.prompt_key,
                spec.get("answer_key") or self.answer_key,
                spec.get("system_prompt", self.system_prompt),
            )
            v = val_specs.get(name, {})
            val_keys = (v.get("prompt_key") or keys[0], v.get("answer_key") or keys[1], v.get("system_prompt", keys[2]))
            src = Source(name, int(spec["quota"]), spec.get("reward"), keys, val_keys)
            if frozen is not None and (frozen / _source_file(TRAIN_FILE, name)).is_file():
                src.train = open_arrow(frozen / _source_file(TRAIN_FILE, name))
                held = frozen / _source_file(VAL_FILE, name)
                src.val = open_arrow(held) if held.is_file() else None
            else:
                src.train, src.val = self._read_split(
                    spec["path"], v.get("path"), val_fraction, split_seed, keys[:2], val_keys[:2]
                )
            if src.quota > len(src.train):
                raise DatasetError(
                    f"task.params.train source '{name}' has {len(src.train)} training rows but a quota of {src.quota} "
                    "prompts per step, so a step would repeat its rows; lower its weight or algorithm.prompts_per_step, "
                    "or give it more rows"
                )
            self.sources.append(src)
        if isinstance(val, str) and val:  # one held-out file for the whole mixture (no per-source breakdown)
            frozen_val = frozen / VAL_FILE if frozen is not None else None
            if frozen_val is not None and frozen_val.is_file():
                self.val_table = open_arrow(frozen_val)
            else:
                self.val_table = read_table(val)
                check_table(self.val_table, val, self.prompt_key, self.answer_key)

    @staticmethod
    def _read_split(train, val, val_fraction, split_seed, keys: tuple, val_keys: tuple):
        """(train rows, held-out rows or None) of one file pair, or of one file split by val_fraction;
        keys / val_keys: (prompt_key, answer_key) of each file."""
        table = read_table(train)
        check_table(table, train, *keys)
        if val:
            val_table = read_table(val)
            check_table(val_table, val, *val_keys)
            return table, val_table
        if not val_fraction:
            return table, None
        train_idx, val_idx = split_rows(len(table), float(val_fraction), split_seed)
        if not len(train_idx) or not len(val_idx):
            raise DatasetError(
                f"task.params.val_fraction {val_fraction} of {len(table)} rows in {train} leaves an "
                "empty split; change val_fraction or give task.params.val"
            )
        return table.take(pa.array(train_idx)), table.take(pa.array(val_idx))

    def _rows(self, table) -> PromptRows:
        return PromptRows(table, self.prompt_key, self.answer_key, self.system_prompt)

    @property
    def domain_names(self) -> list[str]:
        return [s.name for s in self.sources] if self.sources else []

    @property
    def domain_rewards(self) -> dict[str | None, str | None] | None:
        """A mixture: each source's reward spec (None: task.reward), and None -> None for a single held-out file
        scored with task.reward. None for one source."""
        if not self.sources:
            return None
        specs: dict[str | None, str | None] = {s.name: s.reward for s in self.sources}
        if self.val_table is not None:
            specs[None] = None
        return specs

    def prompts(self, seed: int) -> EpochShuffled | MixedStream:
        if self.sources:
            streams = [
                EpochShuffled(PromptRows(s.train, *s.keys), seed, shuffle=self.shuffle, source=k)
                for k, s in enumerate(self.sources)
            ]
            return MixedStream(streams, self.domain_names, [s.quota for s in self.sources])
        return EpochShuffled(self._rows(self.train_table), seed, shuffle=self.shuffle)

    def eval_prompts(self, seed: int) -> PromptRows | MixedRows | None:
        """The held-out prompts in file order (None without task.params.val / val_fraction); a mixture's held-out
        sources interleaved (datafile.MixedRows)."""
        if self.sources and self.val_table is None:
            held = [s for s in self.sources if s.val is not None]
            return MixedRows([PromptRows(s.val, *s.val_keys) for s in held], [s.name for s in held]) if held else None
        return None if self.val_table is None else self._rows(self.val_table)

    def freeze(self, data_dir: str | Path) -> list[Path]:
        """Write the train (and val) rows as memory-mappable Arrow files in data_dir; the files written."""
        data_dir = Path(data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        tables = [(TRAIN_FILE, self.train_table), (VAL_FILE, self.val_table)]
        for s in self.sources or []:
            tables += [(_source_file(TRAIN_FILE, s.name), s.train), (_source_file(VAL_FILE, s.name), s.val)]
        written = []
        for name, table in tables:
            if table is not None:
                written.append(data_dir / name)
                write_arrow(table, written[-1])
        return written

    def describe(self) -> str:
        val = f", {len(self.val_table)} held out" if self.val_table is not None else ""
        if self.sources:
            parts = [
                f"{s.name} {len(s.train)} rows, {s.quota} a step" + (f", {len(s.val)} held out" if s.val else "")
                for s in self.sources
            ]
            return f"{len(self.sources)} sources ({'; '.join(parts)}){val}"
        return f"{len(self.train_table)} training prompts{val}"


def _source_file(base: str, name: str) -> str:
    """train.arrow -> train-<name>.arrow (a mixture's per-source frozen file)."""
    stem, _, ext = base.rpartition(".")
    return f"{stem}-{name}.{ext}"
