"""Weight sync over real MPI: identical bytes on every generator, versions advance, staleness rule."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mpi_progs.launch import PROGS, mpirun, node_blocks, write_config

from rollout_hpc.exchange.weights import _transfers, check_staleness
from rollout_hpc.trajectory import TrajectoryBatch


@pytest.mark.parametrize("gen_nodes,gen_tasks,train_tasks", [(2, 2, 2), (1, 1, 1)])
def test_every_generator_gets_identical_weights(tmp_path, gen_nodes, gen_tasks, train_tasks):
    cfg = write_config(
        tmp_path,
        [
            f"generator.nodes={gen_nodes}",
            f"generator.tasks_per_node={gen_tasks}",
            f"trainer.tasks_per_node={train_tasks}",
            "exchange.weight_chunk_bytes=1000",
        ],
    )
    versions = 5
    res = mpirun(node_blocks(cfg, [str(PROGS / "weights_prog.py"), str(tmp_path), str(versions)]))
    assert res.returncode == 0, res.stdout + res.stderr
    out = [json.loads((tmp_path / f"weights-{r}.json").read_text()) for r in range(cfg.world_size)]
    sender = out[cfg.generator.ranks]  # trainer group rank 0
    gens = [o for o in out if o["role"] == "generator"]
    assert len(gens) == cfg.generator.ranks
    for g in gens:
        assert [v["version"] for v in g["versions"]] == list(range(1, versions + 1))
        for mine, sent in zip(g["versions"], sender["versions"]):
            assert mine["digest"] == sent["digest"]  # sha256, dtype and shape of every tensor
            assert mine["poll_after"] is False  # nothing newer was pending
        assert g["closed"] is True
        assert g["held_v1_digest"] == sender["versions"][0]["digest"]  # version 1, still held, intact
        assert g["buffers_reused"] >= 1  # ... while dropped versions' buffers were reused
        assert g["rings"] >= 1  # every rank runs on this host: the sender's doorbell rings reached the receiver
        assert [h["version"] for h in g["history"]] == list(range(1, versions + 1))
    # Consecutive versions differ (they are different weights), so identical digests are not vacuous.
    assert sender["versions"][0]["digest"]["embed"] != sender["versions"][1]["digest"]["embed"]
    embed_bytes = 97 * 33 * 4
    for v in sender["versions"]:
        assert v["stats"]["bytes"] == embed_bytes + 7 * 8 + 8 + 5 * 3 + 8 * 3 * 4
        assert v["stats"]["chunks"] >= embed_bytes // 1000  # chunked by weight_chunk_bytes
        assert v["stats"]["seconds"] > 0


def _batch(versions):
    return TrajectoryBatch.from_records(
        [{"prompt_id": i, "policy_version": v, "response_ids": [1, 2, 3][: i % 3 + 1]} for i, v in enumerate(versions)]
    )


def test_staleness_zero_is_strictly_on_policy():
    kept, rejected = check_staleness(_batch([5, 4, 5, 3, 6]), current_version=5, max_staleness=0)
    assert rejected == 3
    assert kept.fixed["policy_version"].tolist() == [5, 5]
    assert kept.fixed["prompt_id"].tolist() == [0, 2]
    assert kept.response_ids.tolist() == [1, 1, 2, 3]  # ragged slices follow their rows


def test_staleness_bound_keeps_recent_records():
    kept, rejected = check_staleness(_batch([5, 4, 3, 2]), current_version=5, max_staleness=2)
    assert rejected == 1 and kept.fixed["policy_version"].tolist() == [5, 4, 3]
    same, none = check_staleness(_batch([5, 5]), current_version=5, max_staleness=0)
    assert none == 0 and len(same) == 2


def test_the_weight_header_is_json_not_pickle():
    """The header a generator receives over MPI is parsed as JSON data: nothing a peer sends is executed."""
    import pickle

    from rollout_hpc.exchange.weights import _Header

    header = _Header(7, False, ["a", "b"], ["<f4", "<i8"], [(2, 3), ()], 1 << 20)
    wire = header.to_json()
    assert wire.startswith(b"{") and _Header.from_json(bytearray(wire)) == header
    with pytest.raises(ValueError, match="not a numeric tensor"):
        _Header.from_json(_Header(1, False, ["x"], ["|O"], [(1,)], 64).to_json())
    with pytest.raises(ValueError):  # a pickle is not a header
        _Header.from_json(pickle.dumps(header))


@given(
    sizes=st.lists(st.integers(0, 300), max_size=40),
    chunk=st.integers(1, 128),
)
def test_transfers_cover_every_byte_once_in_order_within_a_chunk(sizes, chunk):
    transfers = _transfers(sizes, chunk)
    pieces = [p for t in transfers for p in t]
    # Laid end to end, the pieces are the tensors' bytes in order, each once.
    expected = [(i, lo) for i, size in enumerate(sizes) for lo in range(size)]
    assert [(i, b) for i, lo, hi in pieces for b in range(lo, hi)] == expected
    assert all(sum(hi - lo for _, lo, hi in t) <= chunk for t in transfers)
    # A tensor of a chunk or more is never packed with another (it is sent from its own memory).
    assert all(len(t) == 1 for t in transfers if any(sizes[i] >= chunk for i, _, _ in t))
    # Small tensors share broadcasts: two neighbouring broadcasts of them hold more than a chunk together.
    if all(s < chunk for s in sizes):
        assert len(transfers) <= 2 * sum(sizes) / chunk + 1
