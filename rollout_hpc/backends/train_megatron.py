"""Megatron-core trainer: a GPTModel with tensor parallelism, data parallel over the rest (GPU only).

The policy is defined by the Hugging Face Llama model the generators run; this
backend builds the equivalent megatron-core GPTModel (RMSNorm, SwiGLU, RoPE,
no biases, tied embeddings as configured), converts the weights in, and
converts them back for `full_weights`, so the weight sync sends the names and
layout the generators load. Tensor-parallel shards are gathered over the
tensor-parallel group. Pipeline parallelism is not wired into the RL loop yet
(trainer.pipeline_parallel must be 1).

megatron-core needs CUDA even with CPU initialisation, so this module imports
it lazily and fails with a clear message where it or a GPU is missing.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from rollout_hpc.backends.optimizer import make_optimizer
from rollout_hpc.backends.trainer import Trainer, init_torch_distributed
from rollout_hpc.errors import TrainerError
from rollout_hpc.store.rng import capture_rng_state, restore_rng_state

NEEDS = "trainer.backend 'megatron' needs megatron-core and CUDA GPUs; use torch or deepspeed on CPUs"


def _require_megatron():
    if not torch.cuda.is_available():
        raise TrainerError(f"{NEEDS} (no CUDA device is visible here)")
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        raise TrainerError(f"{NEEDS} ({exc}; pip install megatron-core)") from None


def _hf_shape(hf_model) -> dict:
    c = hf_model.config
    heads = c.num_attention_heads
    return {
        "layers": c.num_hidden_layers,
        "hidden": c.hidden_size,
        "heads": heads,
        "kv_heads": getattr(c, "num_key_value_heads", None) or heads,
        "head_dim": c.hidden_size // heads,
        "ffn": c.intermediate_size,
        "vocab": c.vocab_size,
        "max_len": c.max_position_embeddings,
        "eps": getattr(c, "rms_norm_eps", 1e-6),
        "rope_theta": getattr(c, "rope_theta", 10000.0),
        "tied": bool(getattr(c, "tie_word_embeddings", False)),
    }


# --- weight layout: Hugging Face Llama <-> megatron-core GPTModel (unsharded) -------------


def hf_to_megatron(hf: dict[str, torch.Tensor], s: dict) -> dict[str, torch.Tensor]:
    out = {
        "embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
    }
    if not s["tied"]:
        out["output_layer.weight"] = hf["lm_head.weight"]
    groups, per_group, d = s["kv_heads"], s["heads"] // s["kv_heads"], s["head_dim"]
    for i in range(s["layers"]):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = hf[p + "self_attn.q_proj.weight"].view(groups, per_group * d, -1)
        k = hf[p + "self_attn.k_proj.weight"].view(groups, d, -1)
        v = hf[p + "self_attn.v_proj.weight"].view(groups, d, -1)
        # megatron interleaves per query group: [q heads of the group, k, v]
        out[m + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, s["hidden"])
        out[m + "self_attention.linear_proj.weight"] = hf[p + "self_attn.o_proj.weight"]
        out[m + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]], 0)
        out[m + "mlp.linear_fc2.weight"] = hf[p + "mlp.down_proj.weight"]
    return out


def megatron_to_hf(mg: dict[str, torch.Tensor], s: dict) -> dict[str, torch.Tensor]:
    out = {
        "model.embed_tokens.weight": mg["embedding.word_embeddings.weight"],
        "model.norm.weight": mg["decoder.final_layernorm.weight"],
        "lm_head.weight": mg["embedding.word_embeddings.weight"] if s["tied"] else mg["output_layer.weight"],
    }
    groups, per_group, d = s["kv_heads"], s["heads"] // s["kv_heads"], s["head_dim"]
    for i in range(s["layers"]):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        qkv = mg[m + "self_attention.linear_qkv.weight"].view(groups, (per_group + 2) * d, -1)
        q, k, v = torch.split(qkv, [per_group * d, d, d], dim=1)
        out[p + "self_attn.q_proj.weight"] = q.reshape(-1, s["hidden"])
        out[p + "self_attn.k_proj.weight"] = k.reshape(-1, s["hidden"])
        out[p + "self_attn.v_proj.weight"] = v.reshape(-1, s["hidden"])
        out[p + "self_attn.o_proj.weight"] = mg[m + "self_attention.linear_proj.weight"]
        out[p + "input_layernorm.weight"] = mg[m + "input_layernorm.weight"]
        out[p + "post_attention_layernorm.weight"] = mg[m + "pre_mlp_layernorm.weight"]
        gate, up = torch.chunk(mg[m + "mlp.linear_fc1.weight"], 2, dim=0)
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
        out[p + "mlp.down_proj.weight"] = mg[m + "mlp.linear_fc2.weight"]
    return out


def _tp_dim(name: str) -> int | None:
    """The dimension a tensor-parallel layer splits (None: replicated)."""
    if name.endswith(("linear_qkv.weight", "word_embeddings.weight", "output_layer.weight")):
        return 0
    if name.endswith("linear_fc1.weight"):
        return 0  # gate and up are split separately: see _split_fc1 / _join_fc1
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return None


def _shard(name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    dim = _tp_dim(name)
    if dim is None or tp == 1:
        return full
    if name.endswith("linear_fc1.weight"):  # [gate; up] -> each rank holds [gate_r; up_r]
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, tp, 0)[rank], torch.chunk(up, tp, 0)[rank]], 0)
    return torch.chunk(full, tp, dim=dim)[rank]


def _unshard(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    dim = _tp_dim(name)
    if dim is None or len(parts) == 1:
        return parts[0]
    if name.endswith("linear_fc1.weight"):
        gates, ups = zip(*(torch.chunk(p, 2, 0) for p in parts))
        return torch.cat([*gates, *ups], 0)
    return torch.cat(parts, dim=dim)


class MegatronTrainer(Trainer):
    def __init__(self, cfg, model: torch.nn.Module, world):
        _require_megatron()
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.transformer.transformer_config import TransformerConfig

        super().__init__(cfg, world)
        t = cfg.trainer
        if t.pipeline_parallel != 1:
            raise TrainerError(
                "trainer.pipeline_parallel > 1 is not supported by the RL loop yet; use tensor_parallel and data parallel"
            )
        if world.group_size % t.tensor_parallel:
            raise TrainerError(
                f"trainer ranks ({world.group_size}) must be a multiple of trainer.tensor_parallel ({t.tensor_parallel})"
            )
        torch.cuda.set_device(self.device)
        init_torch_distributed(world, "nccl")
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=t.tensor_parallel, pipeline_model_parallel_size=1
        )
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.run.seed)
        self._ps = parallel_state
        self.shape = s = _hf_shape(model)
        self.tp = t.tensor_parallel
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.model.dtype]
        config = TransformerConfig(
            num_layers=s["layers"],
            hidden_size=s["hidden"],
            num_attention_heads=s["heads"],
            num_query_groups=s["kv_heads"],
            ffn_hidden_size=s["ffn"],
            kv_channels=s["head_dim"],
            normalization="RMSNorm",
            layernorm_epsilon=s["eps"],
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            add_bias_linear=False,
            add_qkv_bias=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            tensor_model_parallel_size=self.tp,
            params_dtype=dtype,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
        )
        self.module = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=s["vocab"],
            max_sequence_length=s["max_len"],
            position_embedding_type="rope",
            rotary_base=int(s["rope_theta"]),
            share_embeddings_and_output_weights=s["tied"],
        ).to(self.device)
        self.load_full_weights({k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()})
        self.engine = self.module
        self.dp_group = parallel_state.get_data_parallel_group()
        if parallel_state.get_data_parallel_world_size() > 1:
            self.engine = DistributedDataParallel(
                self.module, device_ids=[self.device.index], process_group=self.dp_group
            )
        a = cfg.algorithm
        self.optimizer = make_optimizer(self.module.parameters(), a)  # LR set per step from algorithm.lr_schedule

    def _forward_logits(self, input_ids, attention_mask):
        T = input_ids.shape[1]
        position_ids = torch.arange(T, device=input_ids.device).expand_as(input_ids)
        # True = masked. Rows are right-padded, so the causal mask is enough; padding is outside every loss mask.
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool, device=input_ids.device), diagonal=1)[None, None]
        logits = self.engine(input_ids, position_ids, causal)
        if self.tp > 1:  # the output layer is vocab-parallel: gather the vocabulary
            from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

            logits = gather_from_tensor_model_parallel_region(logits)
        return logits

    def _set_train(self, mode: bool) -> None:
        self.engine.train(mode)

    def _backward_and_step(self, loss: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.tp > 1:  # replicated parameters (norms) get partial gradients on each tensor-parallel rank
            g = self._ps.get_tensor_model_parallel_group()
            for name, p in self.module.named_parameters():
                if p.grad is not None and _tp_dim(name) is None:
                    torch.distributed.all_reduce(p.grad, group=g)
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg.algorithm.max_grad_norm)
        self.optimizer.step()
        return float(norm)

    def _megatron_full(self) -> dict[str, torch.Tensor]:
        """Unsharded megatron state (gathered over the tensor-parallel group)."""
        g = self._ps.get_tensor_model_parallel_group()
        out = {}
        for name, tensor in self.module.state_dict().items():
            if name.endswith("_extra_state") or not isinstance(tensor, torch.Tensor):
                continue
            if _tp_dim(name) is None or self.tp == 1:
                out[name] = tensor
            else:
                parts = [torch.empty_like(tensor) for _ in range(self.tp)]
                torch.distributed.all_gather(parts, tensor.contiguous(), group=g)
                out[name] = _unshard(name, parts)
        return out

    def full_weights(self) -> dict[str, np.ndarray]:
        hf = megatron_to_hf(self._megatron_full(), self.shape)
        return {k: v.detach().to("cpu", torch.float32, copy=True).numpy() for k, v in hf.items()}

    def load_full_weights(self, weights: dict[str, np.ndarray]) -> None:
        full = hf_to_megatron({k: torch.as_tensor(np.asarray(v)) for k, v in weights.items()}, self.shape)
        state = self.module.state_dict()
        with torch.no_grad():
            for name, value in full.items():
                state[name].copy_(_shard(name, value, self.tp, self.tp_rank).to(state[name].dtype))

    def state_dict_for_checkpoint(self) -> dict[str, Any]:
        # Tensor-parallel ranks hold different optimizer shards: like ZeRO, one checkpoint shard per rank.
        state = {
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "rng": capture_rng_state(),
            "steps_done": self.steps_done,
            "tp": self.tp,
        }
        weights = self.full_weights()  # collective over the tensor-parallel group
        if self.world.group_rank == 0:
            state["weights"] = weights
        return state

    sharded_checkpoint = True

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        if int(state["tp"]) != self.tp:
            raise TrainerError(
                f"the checkpoint was written with trainer.tensor_parallel {int(state['tp'])}; this run has {self.tp}"
            )
        weights = self.world.group_comm.bcast(state.get("weights"), root=0)
        self.load_full_weights(weights)
        saved = state["optimizer"]
        self.optimizer.load_state_dict(
            {"state": saved["state"], "param_groups": self.optimizer.state_dict()["param_groups"]}
        )
        restore_rng_state(state["rng"])
        self.steps_done = int(state["steps_done"])
