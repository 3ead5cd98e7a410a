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
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from rollout_hpc.errors import DatasetError

from .datafile import EpochShuffled, PromptRows, check_table, open_arrow, read_table, split_rows, write_arrow

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


class DatasetTask:
    def __init__(
        self,
        train: str | None = None,
        val: str | None = None,
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
        if frozen is not None and (frozen / TRAIN_FILE).is_file():
            self.train_table = open_arrow(frozen / TRAIN_FILE)
            self.val_table = open_arrow(frozen / VAL_FILE) if (frozen / VAL_FILE).is_file() else None
        else:
            self.train_table, self.val_table = self._read(train, val, val_fraction, split_seed)

    def _read(self, train: str, val: str | None, val_fraction: float | None, split_seed: int):
        table = read_table(train)
        check_table(table, train, self.prompt_key, self.answer_key)
        val_table = None
        if val:
            val_table = read_table(val)
            check_table(val_table, val, self.prompt_key, self.answer_key)
        elif val_fraction:
            train_idx, val_idx = split_rows(len(table), float(val_fraction), split_seed)
            if not len(train_idx) or not len(val_idx):
                raise DatasetError(
                    f"task.params.val_fraction {val_fraction} of {len(table)} rows in {train} leaves an "
                    "empty split; change val_fraction or give task.params.val"
                )
            table, val_table = table.take(pa.array(train_idx)), table.take(pa.array(val_idx))
        return table, val_table

    def _rows(self, table) -> PromptRows:
        return PromptRows(table, self.prompt_key, self.answer_key, self.system_prompt)

    def prompts(self, seed: int) -> EpochShuffled:
        return EpochShuffled(self._rows(self.train_table), seed, shuffle=self.shuffle)

    def eval_prompts(self, seed: int) -> PromptRows | None:
        """The held-out prompts in file order (None without task.params.val / val_fraction)."""
        return None if self.val_table is None else self._rows(self.val_table)

    def freeze(self, data_dir: str | Path) -> list[Path]:
        """Write the train (and val) rows as memory-mappable Arrow files in data_dir; the files written."""
        data_dir = Path(data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        written = [data_dir / TRAIN_FILE]
        write_arrow(self.train_table, written[0])
        if self.val_table is not None:
            written.append(data_dir / VAL_FILE)
            write_arrow(self.val_table, written[1])
        return written

    def describe(self) -> str:
        val = f", {len(self.val_table)} held out" if self.val_table is not None else ""
        return f"{len(self.train_table)} training prompts{val}"
