"""Tokenizers behind one small interface: HFTokenizer, a Hugging Face tokenizer (a local model directory's, or the
built-in vocabulary as a PreTrainedTokenizerFast: what the ranks use, load_tokenizer), and CharTokenizer, the
built-in character vocabulary itself (made in code, nothing to download; decodes without importing transformers).

Interface: encode(text) -> list[int] (no special tokens), encode_prompt(text) (raw text: the
tokenizer's own special tokens, i.e. BOS where it has one), encode_chat(messages) (the chat
template's text, tokenized with exactly the special tokens the template writes: a template that
writes its own BOS gets one BOS), decode(ids, skip_special=True), chat_template (the template text or None),
render_chat(messages, template=None) -> str, vocab_size, pad_id, eos_id, bos_id, stop_ids (every id that
ends a response: EOS and generation_config.json's eos_token_id list).
"""

from __future__ import annotations

import json
import os
import re
import string
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import tokenizers
import yaml
from jinja2.sandbox import ImmutableSandboxedEnvironment

from rollout_hpc.config import ModelSection
from rollout_hpc.errors import ModelLoadError, TaskError

if TYPE_CHECKING:  # for annotations only: transformers takes seconds to import
    from transformers import PreTrainedTokenizerBase


class Tokenizer(Protocol):
    # Read-only to callers, so an implementation may hold a narrower type (the built-in one always has a BOS).
    @property
    def vocab_size(self) -> int: ...
    @property
    def pad_id(self) -> int: ...
    @property
    def eos_id(self) -> int: ...
    @property
    def bos_id(self) -> int | None: ...
    @property
    def stop_ids(self) -> tuple[int, ...]: ...
    @property
    def chat_template(self) -> str | None: ...

    def encode(self, text: str) -> list[int]: ...
    def encode_prompt(self, text: str) -> list[int]: ...
    def encode_chat(self, messages, template: str | None = None) -> list[int]: ...
    def render_chat(self, messages, template: str | None = None) -> str: ...
    def decode(self, ids, skip_special: bool = True) -> str: ...


# The built-in tokenizer's chat template: role-tagged lines, the assistant's turn opened last.
CHAR_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def render_template(template: str, messages, **variables) -> str:
    """Render a Hugging Face style chat template (jinja2, sandboxed, trim_blocks/lstrip_blocks as transformers does)."""

    def raise_exception(message):
        raise TaskError(f"the chat template refused the messages: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(
        messages=[dict(m) for m in messages], add_generation_prompt=True, **variables
    )


class CharTokenizer:
    """One token per character: pad, bos, eos, then newline and printable ASCII
    (digits, + - * =, letters, the sokoban glyphs # @ $ . * +, space, ...).
    The special tokens are written <pad>, <s>, </s> in rendered text (chat templates).

    The vocabulary is a `tokenizers.Tokenizer` (`char_tokenizer_backend`): decode runs through it, and
    `to_pretrained_tokenizer()` gives the same pipeline as a transformers `PreTrainedTokenizerFast`, which
    `rollout-hpc export-model` saves beside the weights. encode keeps a plain dict lookup over the backend's
    vocabulary (same ids; 5-20x faster than the Rust pipeline's per-call overhead for short texts)."""

    PAD, BOS, EOS = 0, 1, 2
    CHARS = "\n" + "".join(c for c in string.printable if c.isprintable())  # 95 printable ASCII + newline
    SPECIAL_TEXT = ("<pad>", "<s>", "</s>")

    def __init__(self) -> None:
        self.pad_id, self.bos_id, self.eos_id = self.PAD, self.BOS, self.EOS
        self.stop_ids = (self.EOS,)
        self.chat_template = CHAR_CHAT_TEMPLATE
        self._special = 3
        self._backend = char_tokenizer_backend()
        vocab = self._backend.get_vocab(with_added_tokens=True)
        self._to_id = {c: i for c, i in vocab.items() if i >= self._special}
        self.vocab_size = len(vocab)

    def encode(self, text: str) -> list[int]:
        try:
            return [self._to_id[c] for c in text]
        except KeyError as exc:
            raise TaskError(
                f"character {exc.args[0]!r} is not in the built-in tokenizer's vocabulary (printable ASCII and newline); "
                "keep task text ASCII or set model.path to a Hugging Face model directory with its own tokenizer"
            ) from None

    def encode_prompt(self, text: str) -> list[int]:
        return [self.bos_id] + self.encode(text)

    def render_chat(self, messages, template: str | None = None) -> str:
        return render_template(template or self.chat_template, messages, bos_token="<s>", eos_token="</s>")

    def encode_chat(self, messages, template: str | None = None) -> list[int]:
        text, ids = self.render_chat(messages, template), []
        for i, piece in enumerate(re.split(r"(<pad>|<s>|</s>)", text)):  # odd pieces are the special tokens
            ids += [self.SPECIAL_TEXT.index(piece)] if i % 2 else self.encode(piece)
        return ids

    def decode(self, ids, skip_special: bool = True) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else [int(i) for i in ids]
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):  # the backend would drop them silently
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise IndexError(
                f"token id {bad} is outside the built-in tokenizer's vocabulary (0..{self.vocab_size - 1})"
            )
        return self._backend.decode(ids, skip_special_tokens=skip_special)

    def to_pretrained_tokenizer(self, model_max_length: int | None = None):
        """The same tokenizer as a transformers `PreTrainedTokenizerFast` (same ids, chat template, BOS added to
        single sequences as encode_prompt does; "<s>" in text is the BOS token, as in rendered chat templates).
        Save it with `save_pretrained_tokenizer` so that AutoTokenizer loads this class back."""
        from transformers import PreTrainedTokenizerFast  # in here: transformers takes seconds to import

        extra = {} if model_max_length is None else {"model_max_length": int(model_max_length)}
        return PreTrainedTokenizerFast(
            tokenizer_object=char_tokenizer_backend(),
            bos_token="<s>",
            eos_token="</s>",
            pad_token="<pad>",
            chat_template=self.chat_template,
            clean_up_tokenization_spaces=False,
            padding_side="right",
            **extra,
        )


def char_tokenizer_backend():
    """The built-in vocabulary as a `tokenizers.Tokenizer`: <pad>=0 <s>=1 </s>=2 (special tokens), then one token
    per character of CharTokenizer.CHARS; no normalizer, every character its own word (any whitespace kept),
    a decoder that concatenates, and a post-processor that puts <s> before a single sequence."""
    vocab = {text: i for i, text in enumerate(CharTokenizer.SPECIAL_TEXT)}
    vocab.update({c: i + len(vocab) for i, c in enumerate(CharTokenizer.CHARS)})
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel(vocab)
    )  # no unk token: a character outside the vocabulary is an error
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = tokenizers.decoders.Fuse()
    bos = CharTokenizer.SPECIAL_TEXT[CharTokenizer.BOS]
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, CharTokenizer.BOS)]
    )
    tok.add_special_tokens(
        [tokenizers.AddedToken(t, special=True, normalized=False) for t in CharTokenizer.SPECIAL_TEXT]
    )
    return tok


def save_pretrained_tokenizer(tokenizer, directory: str | Path) -> list[str]:
    """`tokenizer.save_pretrained(directory)`, with tokenizer_config.json naming PreTrainedTokenizerFast: without
    it, transformers 5's AutoTokenizer builds the tokenizer class of the model type in config.json (a Llama
    directory gets LlamaTokenizer, whose own pre-tokenizer drops spaces) and silently replaces our pipeline.
    Returns the names of the files written."""
    directory = Path(directory)
    files = [Path(f).name for f in tokenizer.save_pretrained(directory)]
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return files


def save_builtin_tokenizer(directory: str | Path, model_max_length: int | None = None) -> list[str]:
    """The built-in tokenizer's files, as in a Hugging Face model directory: tokenizer.json, tokenizer_config.json,
    chat_template.jinja and generation_config.json (bos, eos, pad). Returns the names written."""
    from transformers import GenerationConfig  # in here: transformers takes seconds to import

    tok = CharTokenizer()
    files = save_pretrained_tokenizer(tok.to_pretrained_tokenizer(model_max_length), directory)
    GenerationConfig(bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id).save_pretrained(
        directory
    )
    return [*files, "generation_config.json"]


class HFTokenizer:
    """A Hugging Face tokenizer behind the same interface (pad falls back to eos): a local model directory's
    (AutoTokenizer, `path`), or one made in code (`tokenizer`: the built-in one, see load_tokenizer)."""

    def __init__(self, path: str | None, tokenizer=None) -> None:
        self.path = path
        self.source = f"model.path {path}" if path else "the built-in tokenizer"  # for messages
        self._tok: PreTrainedTokenizerBase = _auto_tokenizer(path) if tokenizer is None else tokenizer
        if self._tok.eos_token_id is None:
            raise ModelLoadError(f"{self.source}: the tokenizer has no EOS token, so responses could never end")
        self.eos_id = int(self._tok.eos_token_id)
        self.pad_id = int(self._tok.pad_token_id) if self._tok.pad_token_id is not None else self.eos_id
        self.bos_id = int(self._tok.bos_token_id) if self._tok.bos_token_id is not None else None
        self.vocab_size = len(self._tok)
        self.chat_template = self._tok.chat_template if isinstance(self._tok.chat_template, str) else None
        # Instruct models stop at several ids (Qwen2.5: <|im_end|> and <|endoftext|>; Llama 3: <|eot_id|> too).
        self.stop_ids = tuple(dict.fromkeys([self.eos_id, *(generation_stop_ids(path) if path else [])]))
        probe = self._tok.encode("a", add_special_tokens=True)
        self._adds_bos = self.bos_id is not None and bool(probe) and probe[0] == self.bos_id

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        try:
            return list(self._tok.encode(text, add_special_tokens=add_special_tokens))
        except Exception as exc:  # tokenizers raises a bare Exception for a character with no token and no unk token
            if "Missing [UNK]" not in str(exc):
                raise
            raise TaskError(
                f"{self.source}: the tokenizer has no token for a character of {text[:60]!r} (and no unknown "
                "token); keep the task's text within its vocabulary (the built-in one: printable ASCII and newline)"
            ) from None

    def encode(self, text: str) -> list[int]:
        return self._encode(text, add_special_tokens=False)

    def encode_prompt(self, text: str) -> list[int]:
        """Raw text with the tokenizer's own special tokens (its post-processor: BOS for Llama, none for Qwen)."""
        ids, bos = self._encode(text, add_special_tokens=True), self.bos_id
        if bos is not None and (not ids or (ids[0] != bos and self._adds_bos)):
            ids = [bos, *ids]
        return ids or [self.eos_id]

    def render_chat(self, messages, template: str | None = None) -> str:
        if template is None and self.chat_template is None:
            raise ModelLoadError(
                f"{self.source}: the tokenizer has no chat template; set "
                "task.params.chat_template to none (raw text) or to a .jinja file"
            )
        return self._tok.apply_chat_template(  # type: ignore[return-value]  # transformers: str with tokenize=False
            [dict(m) for m in messages], chat_template=template, add_generation_prompt=True, tokenize=False
        )

    def encode_chat(self, messages, template: str | None = None) -> list[int]:
        # The template writes every special token it wants (Llama 3's BOS, ChatML's <|im_start|>):
        # tokenize with none added, as transformers' apply_chat_template(tokenize=True) does.
        return self._encode(self.render_chat(messages, template), add_special_tokens=False)

    def decode(self, ids, skip_special: bool = True) -> str:
        return self._tok.decode(  # type: ignore[return-value]  # transformers: a str for one sequence
            [int(i) for i in ids], skip_special_tokens=skip_special
        )


def _auto_tokenizer(path) -> PreTrainedTokenizerBase:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer  # in here: seconds to import (rollout-hpc samples decodes without it)

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"model.path {path}: no usable tokenizer in that directory ({exc})") from None


def generation_stop_ids(path: str | Path) -> list[int]:
    """eos_token_id of a model directory's generation_config.json (an int or a list; [] when absent)."""
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return []
    try:
        value = json.loads(file.read_text()).get("eos_token_id")
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{file} is not valid JSON ({exc}); fix or remove it") from None
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def load_tokenizer(model_cfg) -> Tokenizer:
    """The tokenizer the ranks use for `cfg.model`: a Hugging Face tokenizer, the model directory's, or when
    model.path is None the built-in one as a PreTrainedTokenizerFast (the object export-model saves; same ids)."""
    if model_cfg.path is None:
        return HFTokenizer(None, CharTokenizer().to_pretrained_tokenizer())
    return HFTokenizer(model_cfg.path)


def load_tokenizer_for_run(run_dir: str | Path) -> Tokenizer:
    """The tokenizer a finished or running run used, from RUN_DIR/config.resolved.yaml."""
    path = Path(run_dir) / "config.resolved.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a run directory (made by `rollout-hpc submit`)?")
    data = yaml.safe_load(path.read_text()) or {}
    section = ModelSection.model_validate(data.get("model", {}))
    # For decoding (rollout-hpc samples): CharTokenizer decodes the built-in ids as the ranks' tokenizer does
    # (tested id for id) without importing transformers.
    return CharTokenizer() if section.path is None else HFTokenizer(section.path)
