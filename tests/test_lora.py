"""LoRA (model.lora): real runs (`rollout-hpc submit --local`) of a tiny Hugging Face Qwen2 directory.

The torch trainer trains only the adapters; the generators get the merged adapted layers (the sync's bytes are
exactly those layers); a run interrupted with SIGUSR1 and resumed ends with the weights digest of an uninterrupted
one; its checkpoints hold only the adapters and their AdamW moments; `export-model` writes a merged model and
(--adapter-only) the PEFT layout, both reloaded in a fresh interpreter without rollout_hpc and giving the logits of
the trained policy. DeepSpeed ZeRO-2 over two trainer ranks trains and exports LoRA too. Bad settings: megatron,
unknown target modules."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_export_model import cli, export
from test_resume_local import stop_and_resume, weights_digest
from tiny_hf import make_tiny_qwen

from rollout_hpc.config import load_config
from rollout_hpc.errors import ConfigError
from rollout_hpc.models import build_model, load_tokenizer, lora
from rollout_hpc.models.export import read_export_info
from rollout_hpc.store.checkpoint import list_checkpoints, load_checkpoint
from rollout_hpc.store.trajlog import read_metrics

torch.set_num_threads(1)
STEPS = 6
TARGETS = ["q_proj", "v_proj"]
IDS = [[5, 70, 80, 90, 100, 110, 120], [200, 201, 202, 203, 204, 205, 206]]

# A fresh interpreter (transformers and peft only) loads an export: merged (a plain model directory) or adapter-only
# (PeftModel over the base), and prints the logits of the ids it is given (JSON floats round-trip float32 exactly).
FRESH = r"""
import json, sys
import torch
from transformers import AutoModelForCausalLM
d, base, ids = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
if base:
    from peft import PeftModel
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), d)
else:
    model = AutoModelForCausalLM.from_pretrained(d)
with torch.no_grad():
    logits = model.eval()(torch.tensor(ids)).logits.float()
print(json.dumps({"rollout_hpc_imported": any(m.startswith("rollout_hpc") for m in sys.modules),
                  "class": type(model).__name__, "logits": logits.tolist()}))
"""


def write_config(directory: Path, name: str, base: Path | None, extra: str = "", steps: int = STEPS) -> Path:
    model = f"{{path: {base}" if base else "{hidden_size: 32, num_layers: 2, num_heads: 2, max_seq_len: 32"
    # Half the tokens score 1: every group has a learning signal from the first step (an untrained model's
    # arithmetic answers would all score 0, and all-equal groups train nothing).
    (directory / "parity.py").write_text(
        "def reward(prompt, text):\n    return float(ord(text[0]) % 2) if text else 0.0\n"
    )
    path = directory / f"{name}.yaml"
    path.write_text(f"""
run: {{name: {name}, seed: 0}}
launcher: local
model: {model}, lora: {{rank: 4, alpha: 8, target_modules: {TARGETS}}}}}
task: {{name: arithmetic, params: {{max_operand: 4, ops: "+"}}, reward: "{directory / "parity.py"}:reward"}}
algorithm: {{steps: {steps}, prompts_per_step: 2, group_size: 4, max_new_tokens: 1, lr: 0.01}}
checkpoint: {{every_steps: 2, keep_last: 3}}
{extra}""")
    return path


def submit(directory: Path, config: Path, run_dir: Path, timeout: float = 300) -> Path:
    done = cli("submit", config, "--local", "--run-dir", run_dir, cwd=directory, timeout=timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return run_dir


def trained_policy(run_dir: Path, step: int | None = None) -> tuple[torch.nn.Module, dict]:
    """The policy as its trainer held it: the base of cfg.model with the checkpoint's adapters (unmerged)."""
    infos = list_checkpoints(run_dir)
    info = infos[-1] if step is None else next(i for i in infos if i.step == step)
    _, state, _ = load_checkpoint(info, shard=0 if info.sharded else None)
    cfg = load_config(run_dir / "config.resolved.yaml")
    model = build_model(cfg.model, load_tokenizer(cfg.model).vocab_size, seed=cfg.run.seed)
    lora.apply_lora(model, cfg.model.lora)
    lora.load_adapter_weights(model, state["weights"])
    return model.eval(), state


def logits_of(model: torch.nn.Module, ids=IDS) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids)).logits.float().numpy()


def fresh_logits(directory: Path, tmp: Path, base: Path | None = None, ids=IDS) -> tuple[dict, np.ndarray]:
    """Load an export in a new interpreter: transformers and peft only, no rollout_hpc import, nothing downloaded."""
    argv = [sys.executable, "-c", FRESH, str(directory), str(base or ""), json.dumps(ids)]
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    report = json.loads(subprocess.check_output(argv, cwd=tmp, timeout=240, env=env).splitlines()[-1])
    assert report["rollout_hpc_imported"] is False
    return report, np.asarray(report["logits"], np.float32)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_tiny_qwen(tmp_path_factory.mktemp("base") / "tiny-qwen")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, base) -> Path:
    """A LoRA run never interrupted."""
    tmp = tmp_path_factory.mktemp("lora-ref")
    return submit(tmp, write_config(tmp, "lora-ref", base), tmp / "run")


def test_only_adapters_train_sync_and_checkpoint(reference, base):
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(base)
    layers = plain.config.num_hidden_layers
    adapted = {n: p for n, p in plain.named_parameters() if n.rsplit(".", 2)[-2] in TARGETS and n.endswith("weight")}
    assert len(adapted) == 2 * layers
    # The generators got the merged adapted layers only: exactly their bytes, every step.
    sync = {int(m["sync_bytes"]) for m in read_metrics(reference / "trajectories.h5")}
    full_bytes = sum(p.numel() * 4 for p in plain.parameters())
    assert sync == {sum(p.numel() * 4 for p in adapted.values())}, (sync, full_bytes)
    # The checkpoint: the adapters (A: rank x in, B: out x rank of each adapted layer) and their AdamW moments.
    policy, state = trained_policy(reference)
    weights = state["weights"]
    assert len(weights) == 2 * len(adapted)
    for name, param in adapted.items():
        stem = name[: -len(".weight")]
        a, b = weights[f"{stem}.lora_A.default.weight"], weights[f"{stem}.lora_B.default.weight"]
        assert a.shape == (4, param.shape[1]) and b.shape == (param.shape[0], 4)
        assert np.abs(b).max() > 0  # B starts at zero: it trained
    moments = state["optimizer"]["state"]
    assert len(moments) == len(weights)
    assert sum(np.asarray(m["exp_avg"]).size for m in moments.values()) == sum(w.size for w in weights.values())
    assert state["lora"]["rank"] == 4 and list(state["lora"]["target_modules"]) == TARGETS
    # The base stayed frozen: the merged model differs from the base only in the adapted layers.
    merged = lora.merged_weights(policy, full=True)
    for name, param in plain.state_dict().items():
        same = np.array_equal(merged[name], param.numpy())
        assert same == (name not in adapted), name


def test_interrupted_and_resumed_equals_uninterrupted(tmp_path, reference, base):
    run_dir = tmp_path / "run"
    stop_and_resume(write_config(tmp_path, "lora-cut", base), run_dir, 2, tmp_path, steps=STEPS)
    assert weights_digest(run_dir) == weights_digest(reference)


def test_export_merged_and_adapter_only_reload_with_the_policys_logits(tmp_path, reference, base):
    policy, _ = trained_policy(reference)
    expected = logits_of(policy)
    merged = tmp_path / "merged"
    export(reference, merged, "--merge-lora", "--quiet")
    report, logits = fresh_logits(merged, tmp_path)
    assert report["class"] == "Qwen2ForCausalLM"
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-5)
    assert "LoRA adapters merged" in read_export_info(merged, verify=True)["weights_from"]

    adapter = tmp_path / "adapter"
    export(reference, adapter, "--adapter-only", "--quiet")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
    assert not (adapter / "model.safetensors").exists()
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == TARGETS
    assert config["base_model_name_or_path"] == str(base.resolve())
    report, logits = fresh_logits(adapter, tmp_path, base=base)
    assert report["class"].startswith("PeftModel")
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-5)


def test_deepspeed_zero2_trains_lora_and_exports(tmp_path):
    config = write_config(
        tmp_path, "lora-ds", None, "trainer: {backend: deepspeed, zero_stage: 2, tasks_per_node: 2}", steps=2
    )
    run_dir = submit(tmp_path, config, tmp_path / "run", timeout=400)
    info = list_checkpoints(run_dir)[-1]
    assert info.sharded and info.step == 2
    shards = [load_checkpoint(info, shard=s)[1] for s in range(2)]
    held = {**shards[0]["optimizer"]["params"], **shards[1]["optimizer"]["params"]}
    assert held and all(".lora_" in name for name in held)  # the optimizer state of the adapters only
    assert set(shards[0]["weights"]) == set(held)
    policy, _ = trained_policy(run_dir)
    out = tmp_path / "merged"
    export(run_dir, out, "--quiet")
    _, logits = fresh_logits(out, tmp_path, ids=[[1, 19, 16, 20, 32, 5, 6]])
    np.testing.assert_allclose(logits, logits_of(policy, [[1, 19, 16, 20, 32, 5, 6]]), rtol=0, atol=1e-5)


def test_bad_settings_are_clear_errors(tmp_path, base):
    with pytest.raises(ConfigError, match="model.lora is not supported by trainer.backend 'megatron'"):
        load_config(None, ["model.lora.rank=4", "trainer.backend=megatron", "trainer.gpus_per_task=1"])
    cfg = load_config(None, [f"model.path={base}", "model.lora.target_modules=[qkv_proj, v_proj]"])
    model = build_model(cfg.model, 0)
    with pytest.raises(ConfigError) as err:
        lora.apply_lora(model, cfg.model.lora)
    message = str(err.value)
    assert "['qkv_proj']" in message and "q_proj" in message and "gate_proj" in message
    config = write_config(tmp_path, "lora-meg", base, "trainer: {backend: megatron, gpus_per_task: 1}")
    done = cli("validate", config, cwd=tmp_path)
    assert done.returncode == 2 and "model.lora" in done.stderr + done.stdout and "Traceback" not in done.stderr
