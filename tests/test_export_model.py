"""`rollout-hpc export-model`: real runs (`rollout-hpc submit --local`: torch trainer, DeepSpeed ZeRO-2 over two
trainer ranks, a model.path run) exported and reloaded in a fresh Python process with transformers only; the
logits equal the checkpoint's policy (loaded into rollout_hpc.models.build_model) in the same dtype; the built-in
tokenizer round-trips arbitrary text through AutoTokenizer; --step, --dtype, sharded safetensors, a damaged newest
checkpoint, and the traceability record (rollout_hpc_export.json)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_hf import make_tiny_qwen

from rollout_hpc.config import load_config
from rollout_hpc.models import build_model, load_tokenizer
from rollout_hpc.models.export import EXPORT_INFO, read_export_info
from rollout_hpc.store.checkpoint import list_checkpoints, load_checkpoint, weights_digest

torch.set_num_threads(1)
IDS = [[1, 19, 16, 20, 32, 5, 6, 7, 3, 8, 98, 9], [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]
# Arbitrary ASCII: spaces (leading, doubled, trailing), newlines, digits, every punctuation mark, chat markers.
TEXTS = [
    "  leading and  double  spaces ",
    "a\nb\n\n c\n",
    "0123456789 3+4=7",
    "<s>user: hi</s>\nassistant: <pad>",
    "".join(chr(c) for c in range(32, 127)),
    "",
]

# Runs in a fresh interpreter, cwd = tmp dir: transformers only; prints one JSON object.
FRESH = r"""
import json, sys
import numpy as np, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
d, dtype, ids, texts, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4]), sys.argv[5]
model = AutoModelForCausalLM.from_pretrained(d, dtype=getattr(torch, dtype)).eval()
tok = AutoTokenizer.from_pretrained(d)
with torch.no_grad():
    logits = model(torch.tensor(ids)).logits
np.save(out, logits.float().numpy())
enc = [tok.encode(t, add_special_tokens=False) for t in texts]
print(json.dumps({
    "rollout_hpc_imported": any(m.startswith("rollout_hpc") for m in sys.modules),
    "model_class": type(model).__name__, "param_dtype": str(next(model.parameters()).dtype),
    "tokenizer_class": type(tok).__name__, "encoded": enc,
    "with_specials": [tok.encode(t) for t in texts],
    "decoded": [tok.decode(e, skip_special_tokens=False) for e in enc],
    "chat": tok.apply_chat_template([{"role": "user", "content": "2+2?"}], add_generation_prompt=True, tokenize=False),
    "chat_ids": list(tok.apply_chat_template([{"role": "user", "content": "2+2?"}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]),
    "eos": tok.eos_token_id, "bos": tok.bos_token_id, "pad": tok.pad_token_id,
}))
"""


def cli(*args, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rollout_hpc", *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def submit(
    directory: Path,
    name: str,
    extra: str = "",
    model: str = "{hidden_size: 32, num_layers: 2, num_heads: 2, max_seq_len: 32}",
    steps: int = 3,
    timeout: float = 300,
    batch: str = "prompts_per_step: 16, group_size: 8",
) -> Path:
    """A real run of `steps` steps, a checkpoint after every step; returns its run directory. 128 samples a step:
    the random model answers right about once in 90 samples, and the policy moves only once a step's rewards do
    not all tie (the tests compare trained weights with the seed's and one step's with the next)."""
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / f"{name}.yaml"
    config.write_text(f"""
run: {{name: {name}, seed: 0}}
launcher: local
model: {model}
task: {{name: arithmetic, params: {{max_operand: 4, ops: "+"}}}}
algorithm: {{steps: {steps}, {batch}, max_new_tokens: 1, lr: 0.01}}
checkpoint: {{every_steps: 1, keep_last: 3}}
{extra}""")
    run_dir = directory / "run"
    done = cli("submit", config, "--local", "--run-dir", run_dir, cwd=directory, timeout=timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return run_dir


def export(run_dir: Path, out: Path, *args, ok: bool = True) -> subprocess.CompletedProcess:
    done = cli("export-model", run_dir, "--out", out, *args, cwd=run_dir.parent)
    if ok:
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done


def fresh_load(directory: Path, tmp: Path, dtype: str = "float32", ids=IDS, texts=TEXTS) -> tuple[dict, np.ndarray]:
    """Load the export in a new interpreter (no rollout_hpc import); its report and the logits of `ids`."""
    out = tmp / "fresh-logits.npy"
    done = subprocess.run(
        [sys.executable, "-c", FRESH, str(directory), dtype, json.dumps(ids), json.dumps(texts), str(out)],
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=240,
        env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["rollout_hpc_imported"] is False
    return report, np.load(out)


def checkpoint_policy(run_dir: Path, step: int, dtype: str = "float32") -> tuple[torch.nn.Module, dict]:
    """The trained policy of `step` as the run built it: build_model(cfg.model) with the checkpoint's weights."""
    info = next(i for i in list_checkpoints(run_dir) if i.step == step)
    _, state, meta = load_checkpoint(info, shard=0 if info.sharded else None)
    cfg = load_config(run_dir / "config.resolved.yaml", [f"model.dtype={dtype}"])
    model = build_model(cfg.model, load_tokenizer(cfg.model).vocab_size, seed=cfg.run.seed).eval()
    model.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in state["weights"].items()})
    return model, {"meta": meta, "digest": weights_digest(state)}


def policy_logits(model: torch.nn.Module, ids=IDS) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


@pytest.fixture(scope="module")
def torch_run(tmp_path_factory) -> Path:
    return submit(tmp_path_factory.mktemp("torch-run"), "export-torch")


def test_torch_run_exports_a_directory_transformers_loads_with_equal_logits(torch_run, tmp_path):
    out = tmp_path / "model"
    done = export(torch_run, out)
    assert "exported step 3 (policy version 3)" in done.stdout
    names = sorted(p.name for p in out.iterdir())
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        EXPORT_INFO,
    } <= set(names)
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]

    report, logits = fresh_load(out, tmp_path)
    policy, ckpt = checkpoint_policy(torch_run, 3)
    assert report["model_class"] == "LlamaForCausalLM" and report["param_dtype"] == "torch.float32"
    np.testing.assert_allclose(logits, policy_logits(policy), rtol=0, atol=1e-5)
    # the policy moved during training: the logits are the trained ones, not the seed's
    cfg = load_config(torch_run / "config.resolved.yaml")
    untrained = build_model(cfg.model, 99, seed=cfg.run.seed).eval()
    assert np.abs(policy_logits(untrained) - logits).max() > 1e-4

    # The built-in tokenizer, as AutoTokenizer builds it from the directory: same ids, any text back unchanged.
    tok = load_tokenizer(load_config(torch_run / "config.resolved.yaml").model)
    assert report["tokenizer_class"] not in ("LlamaTokenizer", "LlamaTokenizerFast")
    plain = [t.replace("<s>", "").replace("</s>", "").replace("<pad>", "") for t in TEXTS]
    assert report["decoded"] == TEXTS
    for text, ids, with_specials in zip(TEXTS, report["encoded"], report["with_specials"]):
        assert with_specials == [tok.bos_id] + ids  # BOS for a single sequence, as encode_prompt
        if text in plain:
            assert ids == tok.encode(text)
    assert report["chat"] == tok.render_chat([{"role": "user", "content": "2+2?"}])
    assert report["chat_ids"] == tok.encode_chat([{"role": "user", "content": "2+2?"}])
    assert (report["bos"], report["eos"], report["pad"]) == (tok.bos_id, tok.eos_id, tok.pad_id)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == tok.eos_id

    # Traceability: run, step, policy version, config digest, the checkpoint's weights digest, file digests.
    info = read_export_info(out, verify=True)
    assert info["run_dir"] == str(torch_run) and info["step"] == 3 and info["policy_version"] == 3
    assert (
        info["config_digest"]
        == ckpt["meta"]["config_digest"]
        == load_config(torch_run / "config.resolved.yaml").digest()
    )
    assert info["weights_sha256"] == ckpt["digest"]
    assert info["backend"] == "torch" and info["model"]["dtype"] == "float32"
    ckpt_json = json.loads(cli("ckpt", torch_run, "--json", cwd=tmp_path).stdout)
    assert ckpt_json["weights_sha256"] == info["weights_sha256"]


def test_step_dtype_bfloat16_and_sharded_safetensors(torch_run, tmp_path):
    from safetensors import safe_open

    out = tmp_path / "bf16"
    done = export(torch_run, out, "--step", 2, "--dtype", "bfloat16", "--max-shard-size", "40KB", "--json")
    info = json.loads(done.stdout)
    assert info["step"] == 2 and info["policy_version"] == 2 and info["model"]["dtype"] == "bfloat16"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and not (out / "model.safetensors").exists()
    assert all((out / f).stat().st_size <= 40_000 + 4096 for f in files)
    for f in files:
        with safe_open(out / f, "pt") as st:
            assert {st.get_tensor(k).dtype for k in st.keys()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert "lm_head.weight" not in index["weight_map"]  # tied to the embedding: written once

    report, logits = fresh_load(out, tmp_path, dtype="bfloat16")
    assert report["param_dtype"] == "torch.bfloat16"
    policy, _ = checkpoint_policy(torch_run, 2, dtype="bfloat16")
    np.testing.assert_array_equal(logits, policy_logits(policy))  # same dtype, same weights: the same numbers
    policy3, _ = checkpoint_policy(torch_run, 3, dtype="bfloat16")
    assert not np.array_equal(logits, policy_logits(policy3))

    again = export(torch_run, out, "--step", 2, ok=False)
    assert again.returncode == 2 and "not empty" in again.stderr and "--force" in again.stderr
    export(torch_run, out, "--step", 1, "--force", "--quiet")
    assert read_export_info(out)["step"] == 1 and (out / "model.safetensors").exists()
    assert not (out / "model.safetensors.index.json").exists()
    missing = export(torch_run, tmp_path / "x", "--step", 7, ok=False)
    assert missing.returncode == 2 and "no checkpoint of step 7" in missing.stderr and "1, 2, 3" in missing.stderr


def test_a_truncated_newest_checkpoint_is_named_and_the_previous_one_exported(torch_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(torch_run, run_dir)
    newest = list_checkpoints(run_dir)[-1].path
    with open(newest, "r+b") as f:
        f.truncate(newest.stat().st_size // 2)
    done = export(run_dir, tmp_path / "model")
    assert "skipping damaged checkpoint step-00000003.h5" in done.stderr
    assert "exporting step-00000002.h5 (step 2) instead" in done.stderr
    assert read_export_info(tmp_path / "model")["step"] == 2 and newest.exists()  # the run directory is left as it was
    refused = export(run_dir, tmp_path / "m3", "--step", 3, ok=False)
    assert refused.returncode == 2
    assert "step 3 is damaged" in refused.stderr and "--step 2" in refused.stderr
    assert not (tmp_path / "m3").exists()


def test_no_checkpoints_is_a_clear_error(tmp_path):
    (tmp_path / "run").mkdir()
    done = export(tmp_path / "run", tmp_path / "out", ok=False)
    assert done.returncode == 2 and "no checkpoints in" in done.stderr and "Traceback" not in done.stderr


def test_deepspeed_zero2_shards_merge_into_one_model(tmp_path, zero2_run):
    run_dir = zero2_run  # 3 steps, two trainer ranks (tests/conftest.py)
    info = list_checkpoints(run_dir)[-1]
    assert info.sharded and len(list(info.path.glob("shard-*.h5"))) == 2
    out = tmp_path / "model"
    export(run_dir, out)
    record = read_export_info(out, verify=True)
    assert record["backend"] == "deepspeed" and "fp32 masters of 2 shard(s)" in record["weights_from"]
    report, logits = fresh_load(out, tmp_path)
    policy, ckpt = checkpoint_policy(run_dir, info.step)
    assert record["weights_sha256"] == ckpt["digest"]
    np.testing.assert_allclose(logits, policy_logits(policy), rtol=0, atol=1e-5)
    # every parameter's fp32 master (spread over both shards) is what was written
    masters = {}
    for shard in range(2):
        masters.update(load_checkpoint(info, shard=shard)[1]["optimizer"]["params"])
    from safetensors.torch import load_file

    written = load_file(out / "model.safetensors")
    assert set(written) == set(masters)
    for name, entry in masters.items():
        np.testing.assert_array_equal(written[name].numpy(), np.asarray(entry["fp32"]))


def test_a_model_path_run_exports_its_own_tokenizer_and_stop_ids(tmp_path):
    base = make_tiny_qwen(tmp_path / "tiny-qwen")
    run_dir = submit(tmp_path / "hf", "export-hf", model=f"{{path: {base}}}", steps=2)
    out = tmp_path / "model"
    export(run_dir, out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (base / name).read_bytes()
    assert (
        json.loads((out / "generation_config.json").read_text())["eos_token_id"]
        == json.loads((base / "generation_config.json").read_text())["eos_token_id"]
    )
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"
    ids = [[5, 70, 80, 90, 100, 110], [200, 201, 202, 203, 204, 205]]
    texts = ["  two  spaces\nand 3+4=7", "<|im_start|>user\nhi<|im_end|>\n"]
    report, logits = fresh_load(out, tmp_path, ids=ids, texts=texts)
    assert report["model_class"] == "Qwen2ForCausalLM"
    tok = load_tokenizer(load_config(run_dir / "config.resolved.yaml").model)
    assert report["encoded"] == [tok.encode(t) for t in texts] and report["decoded"] == texts
    assert report["chat"] == tok.render_chat([{"role": "user", "content": "2+2?"}])
    policy, ckpt = checkpoint_policy(run_dir, 2)
    np.testing.assert_allclose(logits, policy_logits(policy, ids), rtol=0, atol=1e-5)
    record = read_export_info(out, verify=True)
    assert record["model"]["base"] == str(base) and record["weights_sha256"] == ckpt["digest"]
