"""A run's trained policy as a Hugging Face model directory (`rollout-hpc export-model`; docs/export.md).

    OUT/config.json                      the model config (built-in: the tiny Llama; model.path: its own config)
    OUT/generation_config.json           BOS/EOS/PAD (model.path: its own file, so its stop ids travel along)
    OUT/model.safetensors                the weights in the chosen dtype; above max_shard_size:
    OUT/model-0000i-of-0000n.safetensors + model.safetensors.index.json
    OUT/tokenizer.json, tokenizer_config.json, chat_template.jinja, ...   (model.path: its files, copied)
    OUT/rollout_hpc_export.json          where it came from: run dir, step, policy version, config digest,
                                         the checkpoint's weights SHA-256 (as `rollout-hpc ckpt` prints it),
                                         each written file's SHA-256

The weights come from a checkpoint (the newest valid one, or one step): a replicated one (torch) holds them
under "weights"; a sharded one (DeepSpeed ZeRO) holds the full weights in shard 0 and every parameter's fp32
master value in the optimizer share of the shard that owns it (backends/train_deepspeed.py): every shard is
verified and the masters of all of them are merged over shard 0's weights (Megatron: shard 0's weights, in
Hugging Face names). Tied parameters (lm_head = embed_tokens) are written once, as save_pretrained does.
A LoRA run's checkpoints hold only the adapters (model.lora): the base is rebuilt from the run's config (model.path,
the seeded built-in model, model.init_from) and the adapters merged into it (models/lora.py), or, with
lora="adapter", written alone in the PEFT layout (adapter_config.json + adapter_model.safetensors).
The directory is assembled beside OUT and renamed into place, so an interrupted export leaves no OUT.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from safetensors.torch import save_file

import rollout_hpc
from rollout_hpc.config import ModelSection
from rollout_hpc.errors import ExportError
from rollout_hpc.models import lora
from rollout_hpc.models.build import build_model, builtin_hf_config
from rollout_hpc.models.tokenizer import CharTokenizer, save_builtin_tokenizer
from rollout_hpc.store.checkpoint import (
    CheckpointCorrupt,
    checkpoint_dir,
    list_checkpoints,
    load_checkpoint,
    weights_digest,
)
from rollout_hpc.store.h5tree import weights_from

EXPORT_INFO = "rollout_hpc_export.json"
EXPORT_FORMAT = "rollout-hpc-export"
DTYPE_NAMES = ("bfloat16", "float16", "float32")
DEFAULT_MAX_SHARD = "5GB"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Files of a model.path directory that are NOT copied: the base weights, and what the export writes itself.
_NOT_COPIED = re.compile(
    r"(\.(safetensors|bin|pt|pth|ckpt|h5|msgpack|gguf|onnx)|\.index\.json|^config\.json|"
    r"^generation_config\.json|^" + re.escape(EXPORT_INFO) + r")$"
)


@dataclass
class PolicyCheckpoint:
    """The policy weights of one verified checkpoint."""

    step: int
    path: Path
    meta: dict
    weights: dict[str, Any]  # hf name -> array (float32 as saved)
    weights_sha256: str  # store.weights_digest of the checkpoint (what `rollout-hpc ckpt` prints)
    source: str  # "weights", or "weights + fp32 masters of N shards"
    damaged: list[str] = field(default_factory=list)  # newer checkpoints passed over, one line each
    adapter: dict[str, Any] | None = None  # a LoRA run: the checkpoint's adapter tensors (weights: merged)


@dataclass
class ExportResult:
    out: Path
    step: int
    policy_version: int | None
    checkpoint: Path
    dtype: str
    files: list[str]
    n_tensors: int
    total_bytes: int
    info: dict
    damaged: list[str]


# --- reading the checkpoint ----------------------------------------------------------------


def _masters(state: dict) -> dict[str, Any]:
    """The whole fp32 master value of every parameter this DeepSpeed shard owns ({} for other layouts)."""
    params = (state.get("optimizer") or {}).get("params") if isinstance(state.get("optimizer"), dict) else None
    if not isinstance(params, dict):
        return {}
    return {name: entry["fp32"] for name, entry in params.items() if isinstance(entry, dict) and "fp32" in entry}


def _read(info) -> PolicyCheckpoint:
    """The policy of one checkpoint; CheckpointCorrupt if it (or any of its shards) does not verify."""
    if not info.sharded:
        path, state, meta = load_checkpoint(info)
        weights = weights_from(state)
        return PolicyCheckpoint(info.step, path, meta, weights, weights_digest(state), "weights")
    _, state, meta = load_checkpoint(info, shard=0)
    n = int(meta.get("n_shards", 1))
    if not isinstance(state.get("weights"), dict):
        raise ExportError(
            f"{info.path}: shard 0 holds no 'weights' (written by an older rollout-hpc?); "
            "resume the run for one step with this version to write a checkpoint that can be exported"
        )
    digest, weights, masters = weights_digest(state), dict(state["weights"]), _masters(state)
    del state
    for shard in range(1, n):
        masters.update(_masters(load_checkpoint(info, shard=shard)[1]))
    for name, value in masters.items():
        if name in weights and tuple(np.shape(weights[name])) != tuple(np.shape(value)):
            raise ExportError(
                f"{info.path}: parameter {name} has shape {tuple(np.shape(value))} in the optimizer "
                f"shards but {tuple(np.shape(weights[name]))} in the weights"
            )
    weights.update(masters)
    source = f"weights + fp32 masters of {n} shard(s)" if masters else f"weights of shard 0 of {n}"
    return PolicyCheckpoint(info.step, info.path, meta, weights, digest, source)


def read_policy(run_dir: str | Path, step: int | None = None) -> PolicyCheckpoint:
    """The newest checkpoint that verifies (damaged newer ones are named in `.damaged`), or exactly `step`.
    A LoRA run's adapters come merged into its base model (`.weights`; the adapters alone in `.adapter`)."""
    policy = _find_policy(Path(run_dir), step)
    model_cfg = run_model_section(Path(run_dir), policy.meta)
    if model_cfg.lora is not None:
        policy.adapter = policy.weights
        policy.weights = lora.merged_weights(adapted_base(Path(run_dir), policy).get_base_model(), full=True)
        policy.source += f" (LoRA adapters merged into {model_cfg.path or 'the built-in model'})"
    return policy


def adapted_base(run_dir: Path, policy: PolicyCheckpoint):
    """The run's base model (model.path, the seeded built-in model, model.init_from's weights) with the
    checkpoint's LoRA adapters in it (what its trainer trained), as a peft.PeftModel."""
    config = policy.meta.get("config") or {}
    model_cfg = run_model_section(run_dir, policy.meta)
    base = build_model(
        model_cfg,
        CharTokenizer().vocab_size if model_cfg.path is None else 0,
        seed=int((config.get("run") or {}).get("seed", 0)),
    )
    if model_cfg.init_from:
        start = init_weights(model_cfg.init_from).weights
        base.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in start.items()}, strict=False)
    peft_model = lora.apply_lora(base, model_cfg.lora)
    assert policy.adapter is not None  # read_policy sets it for a LoRA checkpoint
    lora.load_adapter_weights(base, policy.adapter)
    return peft_model


def _find_policy(run_dir: Path, step: int | None) -> PolicyCheckpoint:
    infos = list_checkpoints(run_dir)
    if not infos:
        hint = (
            ""
            if (run_dir / "config.resolved.yaml").is_file()
            else " (is it a run directory made by `rollout-hpc submit`?)"
        )
        raise ExportError(
            f"no checkpoints in {checkpoint_dir(run_dir)}{hint}; a run writes them every "
            "checkpoint.every_steps steps and at its last step"
        )
    steps = ", ".join(str(i.step) for i in infos)
    if step is not None:
        chosen = [i for i in infos if i.step == step]
        if not chosen:
            raise ExportError(f"{run_dir} has no checkpoint of step {step}; it has steps {steps}")
        try:
            return _read(chosen[0])
        except CheckpointCorrupt as exc:
            older = _newest_valid([i for i in infos if i.step < step])
            offer = (
                f"; the newest valid one before it is step {older}: --step {older}"
                if older is not None
                else "; no older checkpoint verifies either"
            )
            raise ExportError(f"checkpoint of step {step} is damaged ({exc}){offer}") from None
    damaged = []
    for info in reversed(infos):
        try:
            policy = _read(info)
        except CheckpointCorrupt as exc:
            damaged.append(f"skipping damaged checkpoint {exc}")
            continue
        policy.damaged = [f"{line}; exporting {info.path.name} (step {info.step}) instead" for line in damaged]
        return policy
    raise ExportError(
        f"every checkpoint in {checkpoint_dir(run_dir)} is damaged ({'; '.join(damaged)}); restore a copy of one"
    )


def _newest_valid(infos) -> int | None:
    for info in reversed(infos):
        try:
            _read(info)
        except CheckpointCorrupt:
            continue
        return info.step
    return None


# --- the Hugging Face side -------------------------------------------------------------------


def run_model_section(run_dir: Path, meta: dict):
    """cfg.model of the checkpoint (its stored config), else of RUN_DIR/config.resolved.yaml."""
    config = meta.get("config")
    if not isinstance(config, dict):
        resolved = run_dir / "config.resolved.yaml"
        if not resolved.is_file():
            raise ExportError(
                f"the checkpoint stores no config and {resolved} is missing: cannot tell which model it is"
            )
        config = yaml.safe_load(resolved.read_text()) or {}
    return ModelSection.model_validate(config.get("model", {}))


def hf_config(model_cfg, dtype: str):
    """The transformers config of the run's model, with `dtype` and `architectures` set."""
    if model_cfg.path is None:
        config = builtin_hf_config(model_cfg)
    else:
        base = Path(model_cfg.path)
        if not (base / "config.json").is_file():
            raise ExportError(
                f"the run's model.path {base} has no config.json (moved or deleted?): the export takes the "
                "config and tokenizer files from there; restore that directory"
            )
        from transformers import AutoConfig  # in here: the auto classes take a second to import (every rank's start)

        config = AutoConfig.from_pretrained(base, local_files_only=True)
    config.dtype = dtype
    return config


def expected_tensors(config) -> tuple[str, dict[str, tuple[tuple[int, ...], bool]]]:
    """(model class name, {name: (shape, is_float)}) of the tensors a checkpoint of this config holds, tied copies
    left out (lm_head.weight when tie_word_embeddings), in the model's own order. Built on the meta device."""
    from transformers import AutoModelForCausalLM  # in here: see hf_config

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, ImportError) as exc:
        raise ExportError(f"transformers cannot build a causal LM from this config ({exc})") from None
    out, seen = {}, set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:  # the same parameter under a second name: tied
            continue
        seen.add(id(tensor))
        out[name] = (tuple(tensor.shape), tensor.is_floating_point())
    return type(model).__name__, out


def parse_size(text: str | int) -> int:
    """'5GB' -> 5e9 bytes, '500MiB' -> 500 * 2**20 (as transformers' max_shard_size); an int is bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ExportError(f"--max-shard-size {text!r}: expected a size like 5GB, 500MB or 2GiB")
    scale = (1024 if m.group(3) else 1000) ** "_KMGT".index(m.group(2).upper() or "_")
    size = int(float(m.group(1)) * scale)
    if size <= 0:
        raise ExportError(f"--max-shard-size {text!r} must be positive")
    return size


def _progress(enabled: bool):
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[tensor]}"),
        console=Console(stderr=True),
        disable=not enabled,
        transient=False,
    )


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def write_weights(
    directory: Path,
    weights: dict,
    names: dict[str, tuple[tuple[int, ...], bool]],
    dtype: str,
    max_shard_bytes: int,
    progress: bool,
) -> tuple[list[str], int]:
    """Safetensors files of `names` from `weights` (floating tensors cast to `dtype`); returns (files, total bytes)."""
    torch_dtype = getattr(torch, dtype)
    itemsize = torch.empty(0, dtype=torch_dtype).element_size()
    sizes = {
        n: int(np.prod(shape, dtype=np.int64)) * (itemsize if is_float else np.asarray(weights[n]).itemsize)
        for n, (shape, is_float) in names.items()
    }
    shards: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name in names:
        if current and used + sizes[name] > max_shard_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += sizes[name]
    shards.append(current)
    total = sum(sizes.values())
    files = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    with _progress(progress) as bar:
        task = bar.add_task("writing weights", total=total, tensor="")
        for file, shard in zip(files, shards):
            tensors = {}
            for name in shard:
                bar.update(task, tensor=name)
                value = torch.as_tensor(np.asarray(weights[name]))
                tensors[name] = value.to(torch_dtype if names[name][1] else value.dtype, copy=True).contiguous()
                bar.advance(task, sizes[name])
            bar.update(task, tensor=f"saving {file}")
            save_file(tensors, str(directory / file), metadata={"format": "pt"})
            del tensors
        bar.update(task, tensor="")
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {n: f for f, s in zip(files, shards) for n in s}}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        files.append(INDEX_FILE)
    return files, total


def write_tokenizer_and_generation_config(directory: Path, model_cfg, config) -> list[str]:
    """Tokenizer files and generation_config.json; returns the names written."""
    if model_cfg.path is None:  # the same files as the built-in model saved as a model directory (save_builtin_model)
        return save_builtin_tokenizer(directory, model_cfg.max_seq_len)
    base, files = Path(model_cfg.path), []
    for entry in sorted(base.iterdir()):
        if entry.is_file() and not _NOT_COPIED.search(entry.name):
            shutil.copy2(entry, directory / entry.name)
            files.append(entry.name)
    if (base / "generation_config.json").is_file():
        shutil.copy2(base / "generation_config.json", directory / "generation_config.json")
    else:
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(config).save_pretrained(directory)
    return [*files, "generation_config.json"]


# --- the whole export --------------------------------------------------------------------------


def export_model(
    run_dir: str | Path,
    out: str | Path,
    step: int | None = None,
    dtype: str | None = None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD,
    force: bool = False,
    progress: bool = False,
    warn=None,
    adapter_only: bool = False,
) -> ExportResult:
    """Write OUT as a Hugging Face model directory of RUN_DIR's policy (see the module doc).

    dtype: bfloat16 | float16 | float32 (default: the run's model.dtype). force: replace an existing OUT.
    warn(line): called once per damaged newer checkpoint passed over (default: print to stderr).
    adapter_only: a LoRA run's adapters alone, in the PEFT layout (default: merged into a full model)."""
    run_dir, out = Path(os.path.abspath(run_dir)), Path(os.path.abspath(out))
    if not run_dir.is_dir():
        raise ExportError(f"run directory {run_dir} does not exist")
    if dtype is not None and dtype not in DTYPE_NAMES:
        raise ExportError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPE_NAMES)}")
    max_bytes = parse_size(max_shard_size)
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"{out} exists and is not empty; choose another --out, or pass --force to replace it")
    if out == run_dir or run_dir in out.parents:
        raise ExportError(f"--out {out} is inside the run directory; export next to it instead")

    policy = read_policy(run_dir, step)
    for line in policy.damaged:
        (warn or (lambda s: print(f"rollout-hpc: {s}", file=sys.stderr, flush=True)))(line)
    model_cfg = run_model_section(run_dir, policy.meta)
    if model_cfg.path is not None and Path(os.path.abspath(model_cfg.path)) in (out, *out.parents):
        raise ExportError(f"--out {out} would overwrite the run's base model {model_cfg.path}")
    dtype = dtype or model_cfg.dtype
    if adapter_only and policy.adapter is None:
        raise ExportError(f"--adapter-only: {run_dir} is not a LoRA run (no model.lora); export the full model")
    config = hf_config(model_cfg, dtype)
    arch, names = expected_tensors(config)
    missing = [n for n in names if n not in policy.weights]
    unknown = sorted(set(policy.weights) - set(names) - _tied_names(config, names))
    wrong = [
        f"{n} {tuple(np.shape(policy.weights[n]))} (the model has {names[n][0]})"
        for n in names
        if n in policy.weights and tuple(np.shape(policy.weights[n])) != names[n][0]
    ]
    if missing or unknown or wrong:
        raise ExportError(
            f"{policy.path}: the checkpoint's weights do not fit {arch} of the run's model config "
            f"(missing {missing[:3]}, unknown {unknown[:3]}, wrong shape {wrong[:3]})"
        )

    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        if adapter_only:
            files, total = write_adapter(partial, run_dir, policy, dtype)
            names = policy.adapter or {}
            arch = f"LoRA adapters for {arch}"
        else:
            weight_files, total = write_weights(partial, policy.weights, names, dtype, max_bytes, progress)
            config.save_pretrained(partial)
            other = write_tokenizer_and_generation_config(partial, model_cfg, config)
            files = ["config.json", *other, *weight_files]
        meta = policy.meta
        info = {
            "format": EXPORT_FORMAT,
            "format_version": 1,
            "run_dir": str(run_dir),
            "run_name": (meta.get("config") or {}).get("run", {}).get("name"),
            "step": policy.step,
            "policy_version": meta.get("policy_version"),
            "checkpoint": str(policy.path),
            "checkpoint_content_checksum": meta.get("content_checksum"),
            "backend": meta.get("backend"),
            "weights_from": policy.source,
            "config_digest": meta.get("config_digest"),
            "weights_sha256": policy.weights_sha256,
            "model": {
                "architecture": arch,
                "base": model_cfg.path or "built-in",
                "dtype": dtype,
                "tensors": len(names),
                "bytes": total,
            },
            "files": {name: _sha256(partial / name) for name in sorted(files)},
            "exported": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "rollout_hpc": rollout_hpc.__version__,
            "config": meta.get("config"),
        }
        (partial / EXPORT_INFO).write_text(json.dumps(info, indent=2) + "\n")
        mode = (
            partial / EXPORT_INFO
        ).stat().st_mode & 0o777  # safetensors writes 0600: give every file the umask's mode
        for name in files:
            os.chmod(partial / name, mode)
        if out.exists():
            shutil.rmtree(out)
        os.replace(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return ExportResult(
        out,
        policy.step,
        meta.get("policy_version"),
        policy.path,
        dtype,
        [*sorted(files), EXPORT_INFO],
        len(names),
        total,
        info,
        policy.damaged,
    )


def write_adapter(directory: Path, run_dir: Path, policy: PolicyCheckpoint, dtype: str) -> tuple[list[str], int]:
    """adapter_config.json + adapter_model.safetensors (peft's save_pretrained; `PeftModel.from_pretrained(base,
    DIR)` loads it, base = model.path, or the built-in model for a run without one); returns (files, bytes)."""
    peft_model = adapted_base(run_dir, policy)
    base = run_model_section(run_dir, policy.meta).path
    peft_model.peft_config[lora.ADAPTER].base_model_name_or_path = str(Path(base).resolve()) if base else None
    peft_model.to(getattr(torch, dtype)).save_pretrained(directory)
    files = sorted(p.name for p in directory.iterdir())  # the adapter files and peft's model card README.md
    return files, sum((directory / f).stat().st_size for f in files if f.endswith(".safetensors"))


def _tied_names(config, names) -> set[str]:
    """Names a checkpoint may hold besides `names`: tied copies (lm_head.weight of a tied model)."""
    return (
        {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" not in names else set()
    )


def read_export_info(directory: str | Path, verify: bool = False) -> dict:
    """DIR/rollout_hpc_export.json; with verify, each listed file's SHA-256 is checked (ExportError on a mismatch)."""
    directory = Path(directory)
    path = directory / EXPORT_INFO
    if not path.is_file():
        raise ExportError(f"{path} not found: {directory} was not written by `rollout-hpc export-model`")
    info = json.loads(path.read_text())
    if verify:
        changed = [
            name
            for name, digest in info.get("files", {}).items()
            if not (directory / name).is_file() or _sha256(directory / name) != digest
        ]
        if changed:
            raise ExportError(f"{directory}: {', '.join(changed)} changed or missing since the export")
    return info


def resolve_init_from(spec: str) -> tuple[Path, int | None]:
    """model.init_from -> (run directory, checkpoint step or None for the newest valid one)."""
    path = Path(spec).expanduser()
    match = re.fullmatch(r"step-(\d+)(\.h5)?", path.name)
    if match and path.parent.name == "checkpoints":  # one checkpoint: a file, or a sharded checkpoint's directory
        return path.parent.parent, int(match.group(1))
    if not path.is_dir():
        raise ExportError(
            f"model.init_from {spec}: no such run directory or checkpoint (RUN_DIR/checkpoints/step-N.h5)"
        )
    return path, None


def init_weights(spec: str) -> PolicyCheckpoint:
    """The policy weights model.init_from names (damaged newer checkpoints are passed over, as resume does)."""
    run_dir, step = resolve_init_from(spec)
    try:
        return read_policy(run_dir, step)
    except ExportError as exc:
        raise ExportError(f"model.init_from {spec}: {exc}") from None
