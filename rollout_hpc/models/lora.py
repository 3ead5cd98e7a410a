"""LoRA (model.lora): PEFT adapters on a causal LM, and what the rest of rollout-hpc needs from them.

    apply_lora(model, lora_cfg, seed)   injects the adapters into `model` in place (peft's get_peft_model), the
                                        base weights frozen: the model keeps its own class, forward and names
    adapter_weights(model)              the trained tensors (checkpoints hold only these), by the model's names
    load_adapter_weights(model, w)      puts them back (resume)
    merged_weights(model, full)         what the generators load: W + B @ A * alpha / r of every adapted layer
                                        under the base model's parameter name (full=True: every other tensor too)

Names: after injection an adapted linear layer `...q_proj` holds `q_proj.base_layer.weight` (frozen) and
`q_proj.lora_A.default.weight` / `lora_B` (trained); the merged weight goes out as `...q_proj.weight`, the name
the generator's (and an exported) plain model has.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rollout_hpc.errors import ConfigError

ADAPTER = "default"  # peft's adapter name: one adapter per model here


def lora_config(lora_cfg):
    """peft.LoraConfig of cfg.model.lora."""
    from peft import LoraConfig  # in here: peft imports transformers (seconds); only trainer ranks and export need it

    targets = lora_cfg.target_modules
    return LoraConfig(
        r=lora_cfg.rank,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=targets[0] if targets == ["all-linear"] else list(targets),
        task_type="CAUSAL_LM",  # adapter_config.json says so: PeftModel.from_pretrained gives PeftModelForCausalLM
    )


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of the model's linear layers (what model.lora.target_modules may name)."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})


def check_targets(model: torch.nn.Module, lora_cfg) -> None:
    """ConfigError naming the model's linear layers when a target_modules entry matches none of its modules."""
    if lora_cfg.target_modules == ["all-linear"]:
        return
    names = [name for name, _ in model.named_modules()]
    unmatched = [t for t in lora_cfg.target_modules if not any(n == t or n.endswith("." + t) for n in names)]
    if unmatched:
        raise ConfigError(
            f"model.lora.target_modules {unmatched} match no module of {type(model).__name__}; its linear layers "
            f"are {linear_module_names(model)} (or use ['all-linear'])"
        )


def apply_lora(model: torch.nn.Module, lora_cfg, seed: int = 0):
    """Inject LoRA adapters into `model` in place and freeze everything else; returns the PeftModel around it
    (save_pretrained writes the PEFT layout). A adapters start random from `seed` (the same on every rank and
    restart), B at zero, so the adapted model starts equal to the base."""
    from peft import get_peft_model  # in here: see lora_config

    check_targets(model, lora_cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, lora_config(lora_cfg), autocast_adapter_dtype=False)
    return peft_model


def is_lora(model: torch.nn.Module) -> bool:
    return any(True for _ in lora_layers(model))


def lora_layers(model: torch.nn.Module):
    """(base parameter name, layer) of every adapted layer, in module order."""
    from peft.tuners.lora import LoraLayer  # in here: see lora_config

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            yield f"{name}.weight", module


def adapter_weights(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """The trained tensors (adapters) as float32 copies, by the model's parameter names."""
    return {
        n: p.detach().to("cpu", torch.float32, copy=True).numpy()
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def load_adapter_weights(model: torch.nn.Module, weights: dict[str, Any]) -> None:
    """Set the trained tensors from `weights` (every one must be there, nothing else)."""
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    missing, unknown = sorted(set(trained) - set(weights)), sorted(set(weights) - set(trained))
    if missing or unknown:
        raise ConfigError(
            f"the checkpoint's LoRA adapters do not fit model.lora (missing {missing[:3]}, unknown {unknown[:3]}): "
            "resume with the model.lora the checkpoint was written with"
        )
    with torch.no_grad():
        for name, p in trained.items():
            p.copy_(torch.as_tensor(np.asarray(weights[name])).to(p.dtype))


@torch.no_grad()
def merged_weights(model: torch.nn.Module, full: bool = False) -> dict[str, np.ndarray]:
    """{base name: float32 array}: W + B @ A * scale of every adapted layer; with `full`, every other tensor of the
    base model too (its plain state dict, as a model without adapters names it)."""
    out: dict[str, np.ndarray] = {}
    for name, layer in lora_layers(model):
        base = layer.get_base_layer().weight
        merged = base.float() + layer.get_delta_weight(ADAPTER).float()
        out[name] = merged.to("cpu", copy=True).numpy()
    if full:
        for name, tensor in model.state_dict().items():
            if ".lora_" in name:
                continue
            plain = name.replace(".base_layer.", ".")
            if plain not in out:
                out[plain] = tensor.detach().to("cpu", torch.float32, copy=True).numpy()
    return out


def lora_meta(lora_cfg) -> dict[str, Any]:
    """What a checkpoint notes about its adapters (they hold only these tensors)."""
    return {
        "rank": lora_cfg.rank,
        "alpha": lora_cfg.alpha,
        "dropout": lora_cfg.dropout,
        "target_modules": list(lora_cfg.target_modules),
    }
