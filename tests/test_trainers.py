"""Trainer backends behind one interface (rollout_hpc.backends.trainer), on real MPI trainer ranks:
a step lowers a next-token loss, data-parallel replicas stay identical, full weights and checkpoint
state round-trip exactly. Megatron-core runs only where CUDA GPUs are (marked gpu)."""

from __future__ import annotations

import json

import pytest
from mpi_progs.launch import PROGS, mpirun, node_blocks, write_config


def run_backend(tmp_path, overrides, timeout=300):
    cfg = write_config(tmp_path, ["algorithm.lr=0.01", *overrides])
    res = mpirun(node_blocks(cfg, [str(PROGS / "trainer_backend.py"), str(tmp_path)]), timeout=timeout)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return [json.loads((tmp_path / f"trainer-{r}.json").read_text()) for r in range(cfg.trainer.ranks)]


def check_backend(outs):
    for out in outs:
        assert out["losses"][-1] < 0.6 * out["losses"][0]  # eight steps fit the fixed batch
        assert out["before"] != out["after"]  # the weights moved
        assert out["logp_col0_zero"] and out["logp_max"] <= 0 and out["entropy_min"] > 0
        # A fresh trainer loaded from the checkpoint state is exactly where the first one was ...
        assert out["resumed_digest"] == out["after"]
        # ... and its next step gives the same loss (weights, optimizer moments, step count).
        assert out["resumed_next_loss"] == out["next_loss"]
    # Every data-parallel replica holds the same weights: gradients were averaged.
    assert len({o["before"] for o in outs}) == 1 and len({o["after"] for o in outs}) == 1
    # ... while each rank saw its own data.
    assert len({o["losses"][0] for o in outs}) == len(outs)


@pytest.fixture(scope="module")
def torch_ddp(tmp_path_factory):
    return run_backend(tmp_path_factory.mktemp("ddp"), ["trainer.backend=torch", "trainer.tasks_per_node=2"])


def test_torch_ddp_two_ranks(torch_ddp):
    check_backend(torch_ddp)


def test_torch_single_rank_same_code_path(tmp_path):
    check_backend(run_backend(tmp_path, ["trainer.backend=torch"]))


def test_deepspeed_zero3_two_ranks(tmp_path):
    # ZeRO-3 partitions parameters: full_weights must gather them, load must scatter them.
    check_backend(
        run_backend(tmp_path, ["trainer.backend=deepspeed", "trainer.zero_stage=3", "trainer.tasks_per_node=2"])
    )


def test_deepspeed_zero2_agrees_with_torch_ddp(tmp_path, torch_ddp):
    torch_out = torch_ddp
    ds_out = run_backend(
        tmp_path / "ds", ["trainer.backend=deepspeed", "trainer.zero_stage=2", "trainer.tasks_per_node=2"]
    )
    # Same model, data, optimizer and clipping: the same losses up to float reassociation.
    for t, d in zip(torch_out, ds_out):
        assert t["losses"] == pytest.approx(d["losses"], rel=1e-4)


@pytest.mark.gpu
def test_megatron_one_gpu(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    check_backend(run_backend(tmp_path, ["trainer.backend=megatron", "trainer.gpus_per_task=1"]))


@pytest.mark.parametrize(
    "stage, split", [(2, "trainer.max_tokens_per_microbatch=24"), (3, "trainer.micro_batch_size=1")]
)
def test_deepspeed_micro_batches_agree_with_unsplit_ddp(tmp_path, torch_ddp, stage, split):
    # Gradient accumulation over 2 (ZeRO-2) / 4 (ZeRO-3) micro-batches of each rank's 4 rows, one optimizer step
    # per train_step: the same losses as the unsplit torch DDP run, up to float reassociation.
    ds_out = run_backend(
        tmp_path, ["trainer.backend=deepspeed", f"trainer.zero_stage={stage}", "trainer.tasks_per_node=2", split]
    )
    check_backend(ds_out)
    for t, d in zip(torch_ddp, ds_out):
        assert t["losses"] == pytest.approx(d["losses"], rel=1e-4)
