"""The policy model: a local Hugging Face causal-LM directory, or the built-in tiny
Llama made from cfg.model with random weights (deterministic given a seed).
Nothing is ever downloaded: HF_HUB_OFFLINE=1 and local_files_only=True."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from rollout_hpc.errors import ModelLoadError  # noqa: F401  (re-exported: models.ModelLoadError)
from rollout_hpc.models.tokenizer import CharTokenizer, save_builtin_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def tiny_config(model_cfg, vocab_size: int, pad_id: int = 0, bos_id: int = 1, eos_id: int = 2):
    # transformers' model classes take seconds to import: loaded in here, so that `import rollout_hpc.models`
    # (the CLI's `samples` decoding with the built-in tokenizer) stays light.
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=model_cfg.hidden_size,
        intermediate_size=4 * model_cfg.hidden_size,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_heads,
        num_key_value_heads=model_cfg.num_heads,
        max_position_embeddings=model_cfg.max_seq_len,
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )


def builtin_hf_config(model_cfg):
    """The built-in model's transformers config as a model directory's config.json holds it (architectures set)."""
    tok = CharTokenizer()
    config = tiny_config(model_cfg, tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id)
    config.architectures = ["LlamaForCausalLM"]
    return config


def save_builtin_model(model_cfg, directory: str | Path, seed: int = 0) -> list[str]:
    """The built-in model (its initial weights for `seed`, in model.dtype) and its tokenizer as a Hugging Face model
    directory: config.json, model.safetensors, generation_config.json and the tokenizer files. Loaded back as
    model.path (build_model, load_tokenizer: the Hugging Face path) it gives the same ids and the same logits as the
    built-in model. Returns the names written."""
    if model_cfg.path is not None:
        raise ValueError(f"save_builtin_model: model.path is set ({model_cfg.path}): that model is no built-in one")
    model: Any = build_model(model_cfg, CharTokenizer().vocab_size, seed)  # a transformers PreTrainedModel
    model.save_pretrained(directory)
    tokenizer_files = save_builtin_tokenizer(directory, model_cfg.max_seq_len)
    return sorted({"config.json", "model.safetensors", *tokenizer_files})


def build_model(model_cfg, vocab_size: int, seed: int = 0) -> torch.nn.Module:
    """cfg.model -> a causal LM (eval mode is the caller's choice). For the built-in model
    `vocab_size` comes from the tokenizer; for model.path it is only checked."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    dtype = DTYPES[model_cfg.dtype]
    if model_cfg.path is None:
        from transformers import LlamaForCausalLM  # in here: see tiny_config

        config = tiny_config(model_cfg, vocab_size)
        # Own RNG stream: the same seed gives the same weights whatever ran before.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(config)
        return to_dtype(model, dtype)
    return _load_pretrained(Path(model_cfg.path), dtype, vocab_size)


def to_dtype(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`model.to(dtype)` as transformers' from_pretrained(dtype=...) leaves it: parameters and saved buffers in
    `dtype`, buffers that are not saved (the rotary inv_freq) in float32. Then the built-in model computes what its
    exported directory computes in transformers (and vLLM); a bfloat16 inv_freq shifts bf16 logits from position ~5 on."""
    saved = set(model.state_dict())
    keep = {name: buf for name, buf in model.named_buffers() if name not in saved and buf.is_floating_point()}
    model = model.to(dtype)
    for name, buf in keep.items():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        module._buffers[attr] = buf.to(torch.float32)
    return model


def _load_pretrained(path: Path, dtype: torch.dtype, vocab_size: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM  # in here: see tiny_config

    if not path.is_dir():
        raise ModelLoadError(
            f"model.path {path} is not a directory; point it at a local Hugging Face model "
            "(a folder with config.json and weights) or remove model.path for the built-in tiny model"
        )
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model.path {path} has no config.json, so it is not a Hugging Face model directory")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"model.path {path}: could not load a causal LM: {exc}") from None
    # transformers types get_input_embeddings() as nn.Module; it is an nn.Embedding
    emb: int = model.get_input_embeddings().num_embeddings  # type: ignore[assignment]
    if vocab_size > emb:
        raise ModelLoadError(
            f"model.path {path}: the tokenizer has {vocab_size} tokens but the model embeds only {emb}"
        )
    return model
