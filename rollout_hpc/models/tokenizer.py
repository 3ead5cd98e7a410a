"""Tokenizers behind one small interface: the built-in character tokenizer (made in
code, nothing to download) and a wrapper around a local Hugging Face tokenizer.

Interface: encode(text) -> list[int] (no special tokens), encode_prompt(text) (BOS first
when the tokenizer has one), decode(ids) -> str (special tokens dropped), vocab_size,
pad_id, eos_id, bos_id.
"""

from __future__ import annotations

import os
import string
from pathlib import Path
from typing import Protocol

import yaml


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    eos_id: int
    bos_id: int | None

    def encode(self, text: str) -> list[int]: ...
    def encode_prompt(self, text: str) -> list[int]: ...
    def decode(self, ids) -> str: ...


class CharTokenizer:
    """One token per character: pad, bos, eos, then newline and printable ASCII
    (digits, + - * =, letters, the sokoban glyphs # @ $ . * +, space, ...)."""

    PAD, BOS, EOS = 0, 1, 2
    CHARS = "\n" + "".join(c for c in string.printable if c.isprintable())  # 95 printable ASCII + newline

    def __init__(self) -> None:
        self.pad_id, self.bos_id, self.eos_id = self.PAD, self.BOS, self.EOS
        self._special = 3
        self._to_id = {c: i + self._special for i, c in enumerate(self.CHARS)}
        self.vocab_size = self._special + len(self.CHARS)

    def encode(self, text: str) -> list[int]:
        try:
            return [self._to_id[c] for c in text]
        except KeyError as exc:
            raise ValueError(
                f"character {exc.args[0]!r} is not in the built-in tokenizer's vocabulary (printable ASCII and newline); "
                "keep task text ASCII or set model.path to a Hugging Face model directory with its own tokenizer"
            ) from None

    def encode_prompt(self, text: str) -> list[int]:
        return [self.bos_id] + self.encode(text)

    def decode(self, ids) -> str:
        return "".join(self.CHARS[i - self._special] for i in (int(x) for x in ids) if i >= self._special)


class HFTokenizer:
    """A local AutoTokenizer behind the same interface (pad falls back to eos)."""

    def __init__(self, path: str) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as exc:
            from .build import ModelLoadError

            raise ModelLoadError(f"model.path {path}: no usable tokenizer in that directory ({exc})") from None
        if self._tok.eos_token_id is None:
            from .build import ModelLoadError

            raise ModelLoadError(f"model.path {path}: the tokenizer has no EOS token, so responses could never end")
        self.eos_id = int(self._tok.eos_token_id)
        self.pad_id = int(self._tok.pad_token_id) if self._tok.pad_token_id is not None else self.eos_id
        self.bos_id = int(self._tok.bos_token_id) if self._tok.bos_token_id is not None else None
        self.vocab_size = len(self._tok)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def encode_prompt(self, text: str) -> list[int]:
        return ([self.bos_id] if self.bos_id is not None else []) + self.encode(text)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def load_tokenizer(model_cfg) -> Tokenizer:
    """The tokenizer for `cfg.model`: built-in characters when model.path is None."""
    if model_cfg.path is None:
        return CharTokenizer()
    return HFTokenizer(model_cfg.path)


def load_tokenizer_for_run(run_dir: str | Path) -> Tokenizer:
    """The tokenizer a finished or running run used, from RUN_DIR/config.resolved.yaml."""
    from rollout_hpc.config import ModelSection

    path = Path(run_dir) / "config.resolved.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a run directory (made by `rollout-hpc submit`)?")
    data = yaml.safe_load(path.read_text()) or {}
    return load_tokenizer(ModelSection.model_validate(data.get("model", {})))
