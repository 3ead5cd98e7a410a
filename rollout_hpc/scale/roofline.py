"""A profile without measuring: costs from the model's size and hardware figures (a roofline estimate).

For planning before any allocation, and for sizes nothing here can run (the 7B example on 1,000 nodes). Decoding
reads every weight once per token step (memory bound) plus 2 FLOPs per parameter per row; training costs ~6 FLOPs
per parameter per token (forward and backward) plus 2 for recomputation and 2 for the log-probs before the
update, at a model FLOPs utilisation. Every figure is an assumption, stated in `Hardware` and docs/scale.md;
replace it with `rollout-hpc profile` once a node can be had.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rollout_hpc.errors import UserError
from rollout_hpc.scale.profile import Costs, Machine, Profile, Workload


@dataclass(frozen=True)
class Hardware:
    """One GPU node of a typical 2024-26 cluster (H100 SXM, 8 per node, 8 x 400 Gb/s InfiniBand, Lustre)."""

    gpus_per_node: int = 8
    gpu_tflops: float = 989.0  # dense bf16
    hbm_gb_per_s: float = 3350.0
    decode_mfu: float = 0.5  # of peak, for the FLOPs of a decode step's rows
    train_mfu: float = 0.4
    link_gb_per_s: float = 50.0  # per GPU rank: one 400 Gb/s NIC each
    link_alpha_s: float = 5e-6
    bcast_gb_per_s: float = 10.0  # a tree stage of the weight broadcast: MPI on host memory, not NCCL
    fs_write_gb_per_s: float = 2.0  # one writer
    fs_read_gb_per_s: float = 4.0
    fs_aggregate_gb_per_s: float = 100.0  # the parallel file system, shared by every writer
    startup_s: float = 300.0  # load the model from the file system, start vLLM and DeepSpeed
    gen_fixed_s: float = 0.2  # scheduling and prefill of a batch
    reward_s_per_sample: float = 0.002
    log_s_per_sample: float = 20e-6
    cores_per_node: int = 96


def count_params(cfg) -> float | None:
    """Parameters of model.path's config.json (a decoder-only transformer), or of the built-in model."""
    path = cfg.model.path
    if path:
        conf = Path(path) / "config.json"
        if not conf.is_file():
            return None
        c = json.loads(conf.read_text())
        c = c.get("text_config", c)
        h, layers = c["hidden_size"], c["num_hidden_layers"]
        heads = c.get("num_attention_heads", 1)
        kv = c.get("num_key_value_heads", heads)
        inter = c.get("intermediate_size", 4 * h)
        vocab = c.get("vocab_size", 32000)
        attn = h * h * 2 + 2 * h * (h // heads) * kv
        per_layer = attn + 3 * h * inter
        embed = vocab * h * (1 if c.get("tie_word_embeddings") else 2)
        return float(layers * per_layer + embed)
    h, layers = cfg.model.hidden_size, cfg.model.num_layers
    return float(layers * 12 * h * h + 2 * 256 * h)


def roofline_profile(cfg, hw: Hardware = Hardware(), params: float | None = None) -> Profile:
    n = params or count_params(cfg)
    if not n:
        raise UserError(
            f"the roofline model needs the model's size: {cfg.model.path}/config.json is not readable here; "
            "pass --params (e.g. --params 7.6e9), or measure with `rollout-hpc profile` and pass --profile"
        )
    bytes_bf16 = 2 * n
    peak = hw.gpu_tflops * 1e12
    a = cfg.algorithm
    train_flops = (6 + 2 + 2 + (2 if a.kl_coef > 0 else 0)) * n
    zero3_gathers = 2 * bytes_bf16 / (hw.link_gb_per_s * 1e9) if cfg.trainer.zero_stage == 3 else 0.0
    costs = Costs(
        gen_fixed_s=hw.gen_fixed_s,
        gen_row_s=2 * n * 256 / (peak * hw.train_mfu),  # the prefill of a ~256-token prompt
        gen_token_s=bytes_bf16 / (hw.hbm_gb_per_s * 1e9),
        gen_token_row_s=2 * n / (peak * hw.decode_mfu),
        train_fixed_s=zero3_gathers * a.mini_batches * a.epochs,
        train_token_s=train_flops * a.epochs / (peak * hw.train_mfu),
        reward_s_per_sample=hw.reward_s_per_sample / max(1, cfg.task.reward_workers),
        log_s_per_sample=hw.log_s_per_sample,
        mpi_alpha_s=hw.link_alpha_s,
        mpi_gb_per_s=hw.link_gb_per_s,
        bcast_alpha_s=hw.link_alpha_s * 10,
        bcast_gb_per_s=hw.bcast_gb_per_s,
        ring_gb_per_s=10.0,
        fs_write_gb_per_s=hw.fs_write_gb_per_s,
        fs_read_gb_per_s=hw.fs_read_gb_per_s,
        fs_aggregate_gb_per_s=hw.fs_aggregate_gb_per_s,
        startup_s=hw.startup_s,
    )
    # Responses: without a measurement, a spread up to max_new_tokens (mean ~ 40%, a long tail to the limit).
    L = a.max_new_tokens
    lengths = [max(1, min(L, int(L * (0.15 + 0.85 * (i / 99) ** 2.5)))) for i in range(100)]
    workload = Workload(
        response_lengths=lengths,
        prompt_len_mean=min(256.0, cfg.model.max_seq_len / 4),
        max_new_tokens=L,
        record_bytes_per_token=12.0,
        record_fixed_bytes=96.0,
        weight_bytes=int(bytes_bf16),
        checkpoint_bytes=int(14 * n),  # bf16 weights + fp32 master weights and two AdamW moments
        weight_chunk_bytes=cfg.exchange.weight_chunk_bytes,
    )
    machine = Machine(
        hostname="roofline",
        cores_per_node=hw.cores_per_node,
        gpus_per_node=hw.gpus_per_node,
        gen_threads=1,
        train_threads=1,
        shared_host=False,
        nodes_measured=0,
        ranks_measured=0,
    )
    return Profile(
        costs,
        workload,
        machine,
        source="roofline",
        config_digest=cfg.digest(),
        measurements={"params": n, "hardware": hw.__dict__},
    )
