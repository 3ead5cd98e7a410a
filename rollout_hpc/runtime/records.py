"""A step's trajectory records as the tensors a trainer step needs: sorted by uid (so the arrival order of
batches from different generators never changes what is trained), checked (complete, not too stale),
collated into padded tensors, and split into this rank's share of the prompt groups.

Pure functions of (records, config): the trainer loop calls them, tests and benchmarks can too.
The advantages and the loss that train on these tensors: runtime/objective.py.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from rollout_hpc.runtime import step_plan
from rollout_hpc.trajectory import TrajectoryBatch


class StalenessError(RuntimeError):
    """A record older than exchange.max_staleness reached the trainer (a protocol bug, never user data)."""


def sort_by_uid(batch: TrajectoryBatch, group_size: int) -> TrajectoryBatch:
    order = np.argsort(batch.uids(group_size), kind="stable")
    return batch.select(order)


def check_staleness(batch: TrajectoryBatch, step: int, max_staleness: int) -> int:
    """Largest lag (step - policy_version) in the batch; raises if any record is too old."""
    lag = step - batch.fixed["policy_version"].astype(np.int64)
    worst = int(lag.max()) if len(lag) else 0
    if worst > max_staleness or (len(lag) and int(lag.min()) < 0):
        bad = int(np.argmax(lag)) if worst > max_staleness else int(np.argmin(lag))
        r = batch.record(bad)
        raise StalenessError(
            f"step {step}: record prompt {r['prompt_id']} sample {r['sample_idx']} from generator rank {r['gen_rank']} "
            f"was made by policy version {r['policy_version']} (exchange.max_staleness is {max_staleness})"
        )
    return worst


def check_complete(batch: TrajectoryBatch, step: int, prompts, group_size: int) -> None:
    """Exactly the step's prompts (step_plan.StepPlan.prompts), each with its whole group, each record once."""
    ids = np.asarray(prompts, np.uint64)
    want = (ids[:, None] * np.uint64(group_size) + np.arange(group_size, dtype=np.uint64)[None, :]).reshape(-1)
    got = np.sort(batch.uids(group_size))
    if len(got) != len(want) or not np.array_equal(got, want):
        missing = np.setdiff1d(want, got)[:5]
        extra = np.setdiff1d(got, want)[:5]
        raise StalenessError(
            f"step {step}: the trainer received {len(got)} records, expected the {len(want)} records of prompts "
            f"{step_plan.describe(prompts)} (missing uids {missing.tolist()}, unexpected {extra.tolist()})"
        )


def collate(batch: TrajectoryBatch, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded [B, T] tensors: prompt+response tokens, attention mask, response (loss) mask,
    the generators' sampling log-probabilities at response positions, and per-sequence rewards."""
    f = batch.fixed
    n = len(batch)
    plen = f["prompt_len"].astype(np.int64)
    rlen = f["response_len"].astype(np.int64)
    T = int((plen + rlen).max()) if n else 1
    ids = np.full((n, T), pad_id, np.int64)
    attn = np.zeros((n, T), np.int64)
    mask = np.zeros((n, T), np.float32)
    old_lp = np.zeros((n, T), np.float32)
    poff, roff = batch.offsets("prompt_len"), batch.offsets("response_len")
    for i in range(n):
        p, r = plen[i], rlen[i]
        ids[i, :p] = batch.prompt_ids[poff[i] : poff[i + 1]]
        ids[i, p : p + r] = batch.response_ids[roff[i] : roff[i + 1]]
        attn[i, : p + r] = 1
        mask[i, p : p + r] = batch.loss_mask[roff[i] : roff[i + 1]]
        old_lp[i, p : p + r] = batch.logprobs[roff[i] : roff[i + 1]]
    return {
        "input_ids": torch.from_numpy(ids),
        "attention_mask": torch.from_numpy(attn),
        "mask": torch.from_numpy(mask),
        "old_logprobs": torch.from_numpy(old_lp),
        "rewards": torch.from_numpy(f["reward"].astype(np.float32)),
        "response_len": torch.from_numpy(rlen.astype(np.float32)),
        "domain": torch.from_numpy(f["domain"].astype(np.int64)),
    }


def turn_table(batch: TrajectoryBatch, gamma: float) -> dict[str, torch.Tensor]:
    """One entry per turn of the batch's episodes, for step-level advantages (algos.anchor_state_advantages):
    `row`, and `start`/`end`, the turn's columns in collate()'s layout (its reply and the observation after it);
    `state`, an id of the observation the turn acted on (the prompt for the first turn, else the tokens after the
    previous reply: equal ids, equal observations); `ret`, its return-to-go sum_j>=k gamma^(j-k) turn_rewards[j].
    Rows are the batch's (sorted by uid, so a group's turns are contiguous). Single-turn records give one turn."""
    plen = batch.fixed["prompt_len"].astype(np.int64)
    rlen = batch.fixed["response_len"].astype(np.int64)
    poff, roff, toff = batch.offsets("prompt_len"), batch.offsets("response_len"), batch.offsets("n_turns")
    rows, starts, ends, states, rets = [], [], [], [], []
    for i in range(len(batch)):
        turn_at = batch.turn_starts[toff[i] : toff[i + 1]].astype(np.int64)
        rewards = batch.turn_rewards[toff[i] : toff[i + 1]].astype(np.float64)
        response = batch.response_ids[roff[i] : roff[i + 1]]
        trained = batch.loss_mask[roff[i] : roff[i + 1]] > 0
        ret = 0.0
        to_go = np.zeros(len(rewards))
        for k in range(len(rewards) - 1, -1, -1):
            ret = rewards[k] + gamma * ret
            to_go[k] = ret
        for k, at in enumerate(turn_at):
            before = turn_at[k - 1] if k else 0
            seen = batch.prompt_ids[poff[i] : poff[i + 1]] if k == 0 else response[before:at][~trained[before:at]]
            digest = hashlib.blake2b(np.ascontiguousarray(seen, np.int64).tobytes(), digest_size=8).digest()
            rows.append(i)
            starts.append(plen[i] + at)
            ends.append(plen[i] + (turn_at[k + 1] if k + 1 < len(turn_at) else rlen[i]))
            states.append(int.from_bytes(digest, "little", signed=True))
            rets.append(to_go[k])
    return {
        "row": torch.tensor(rows, dtype=torch.int64),
        "start": torch.tensor(starts, dtype=torch.int64),
        "end": torch.tensor(ends, dtype=torch.int64),
        "state": torch.tensor(states, dtype=torch.int64),
        "ret": torch.tensor(rets, dtype=torch.float32),
    }


def empty_like(tensors: dict) -> dict:
    """Row 0 with a zero loss mask: an update that changes nothing but keeps the ranks' collectives in step."""
    out = select_rows(tensors, np.zeros(1, np.int64))
    out["mask"] = torch.zeros_like(out["mask"])
    return out


def trainable_groups(mask: torch.Tensor, group_size: int) -> np.ndarray:
    """Indices of the prompt groups with any loss token (dynamic sampling zeroes the masks of dropped groups)."""
    tokens = mask.reshape(-1, group_size * mask.shape[-1]).sum(dim=1) if mask.numel() else torch.zeros(0)
    return torch.nonzero(tokens > 0).flatten().numpy()


def shard_groups(groups: np.ndarray, group_size: int, group_rank: int, group_size_ranks: int) -> np.ndarray:
    """Record indices this trainer rank trains on: whole prompt groups (from `groups`), contiguous, split evenly."""
    mine = np.array_split(np.asarray(groups, np.int64), group_size_ranks)[group_rank]
    return (mine[:, None] * group_size + np.arange(group_size)[None, :]).reshape(-1)


def select_rows(tensors: dict, rows: np.ndarray) -> dict:
    idx = torch.from_numpy(rows)
    return {k: v.index_select(0, idx) for k, v in tensors.items()}
