"""The trajectory record layout: round trips, and clear LayoutErrors for damaged or foreign buffers."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_hpc.trajectory import LAYOUT_VERSION, LayoutError, TrajectoryBatch, record_uid


def _batch(n=3, seed=0):
    rng = np.random.default_rng(seed)
    recs = []
    for i in range(n):
        r = int(rng.integers(0, 9))
        recs.append(
            {
                "prompt_id": 10 + i,
                "sample_idx": i,
                "gen_rank": 2,
                "policy_version": 7,
                "reward": 0.5 * i,
                "prompt_ids": rng.integers(0, 50, int(rng.integers(0, 6))),
                "response_ids": rng.integers(0, 50, r),
                "logprobs": -rng.random(r),
                "loss_mask": rng.integers(0, 2, r),
                "turn_starts": [0, max(0, r - 1)][: 1 + (r > 2)],
            }
        )
    return TrajectoryBatch.from_records(recs), recs


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 12), st.integers(0, 10_000))
def test_pack_unpack_round_trip(n, seed):
    batch, recs = _batch(n, seed)
    back = TrajectoryBatch.unpack(batch.pack())
    assert len(back) == n and back.fixed.tobytes() == batch.fixed.tobytes()
    for i, r in enumerate(recs):
        got = back.record(i)
        assert got["prompt_id"] == r["prompt_id"] and got["reward"] == pytest.approx(r["reward"])
        np.testing.assert_array_equal(got["response_ids"], r["response_ids"])
        np.testing.assert_array_equal(got["logprobs"], np.float32(r["logprobs"]))
        np.testing.assert_array_equal(got["loss_mask"], r["loss_mask"])
    assert TrajectoryBatch.peek(batch.pack()) == (n, batch.n_tokens)


def test_concat_select_and_uids():
    a, _ = _batch(3, 1)
    b, _ = _batch(2, 2)
    both = TrajectoryBatch.concat([a, b])
    assert len(both) == 5 and both.n_tokens == a.n_tokens + b.n_tokens
    tail = both.select(slice(3, None))
    assert tail.pack() == b.pack()
    assert both.uids(4).tolist() == record_uid(both.fixed["prompt_id"], both.fixed["sample_idx"], 4).tolist()


def test_unknown_layout_version_names_both_versions():
    buf = _batch()[0].pack()
    buf[4:8] = (LAYOUT_VERSION + 5).to_bytes(4, "little")
    for read in (TrajectoryBatch.unpack, TrajectoryBatch.peek):
        with pytest.raises(
            LayoutError, match=f"layout version {LAYOUT_VERSION + 5}; this rollout-hpc reads version {LAYOUT_VERSION}"
        ):
            read(buf)


@pytest.mark.parametrize("keep", [0, 10, 60, -1])
def test_truncated_batch(keep):
    buf = bytes(_batch()[0].pack())
    cut = buf[:keep] if keep >= 0 else buf[:-1]
    with pytest.raises(LayoutError, match="truncated trajectory batch"):
        TrajectoryBatch.unpack(cut)


def test_foreign_buffer_and_inconsistent_lengths():
    with pytest.raises(LayoutError, match="not a trajectory batch"):
        TrajectoryBatch.unpack(b"PK\x03\x04" + bytes(80))
    batch, _ = _batch(3, 4)
    batch.fixed["response_len"][0] += 1  # the row claims a token the arrays do not have
    with pytest.raises(LayoutError, match="corrupt trajectory batch"):
        TrajectoryBatch.unpack(batch.pack())
