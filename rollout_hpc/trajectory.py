"""The trajectory record layout: one definition for the ring, the wire and the HDF5 log.

A batch of trajectories is a table of fixed-size fields (`FIXED_DTYPE`, one
row per trajectory) plus ragged token arrays stored flat; each row's lengths
say which slice of the flat arrays is its own. Packing puts everything in one
contiguous buffer behind a small header, so a batch moves as a single ring
record or a single MPI message and is read back as numpy views, never pickled.

Buffer layout (little endian, every section 8-byte aligned):

    header   magic b"RHTB", layout u32, n_records u32, 8 x u64 section sizes, 4 pad bytes (80 bytes)
    fixed    n_records x FIXED_DTYPE
    prompt_ids     int32  (sum of prompt_len)
    response_ids   int32  (sum of response_len)
    logprobs       float32 (sum of response_len)   sampling log-probability of each response token
    loss_mask      uint8  (sum of response_len)   1 = token the policy chose (0 = environment text in multi-turn)
    turn_starts    int32  (sum of n_turns)        response offset where each turn begins
    turn_rewards   float32 (sum of n_turns)       the environment's reward for each turn (multi-turn; 0 otherwise)
    reward_parts   float32 (sum of n_reward_parts) with rewards.models: the rule reward, then each model's raw score
"""

from __future__ import annotations

import itertools
import struct
from dataclasses import dataclass, field

import numpy as np

MAGIC = b"RHTB"
# 2: the header is padded to 64 bytes so every section starts 8-byte aligned. `domain` took a byte of `_pad` without a
# new version: the record size is the same and a record from an older writer reads as domain 0, which is right for it;
# so did episode_status, format_errors and success (an older record reads as single-turn).
# 3: turn_rewards, a seventh section (the header grew to 72 bytes).
# 4: reward_parts, an eighth section sized by n_reward_parts (a byte of `_pad`; the header grew to 80 bytes).
LAYOUT_VERSION = 4

FIXED_DTYPE = np.dtype(
    [
        ("prompt_id", "<u8"),  # index of the prompt in the task's data stream
        ("sample_idx", "<u4"),  # sample within the prompt's group
        ("gen_rank", "<u4"),  # world rank of the generator that produced it
        ("policy_version", "<u8"),  # weight version that generated it
        ("reward", "<f4"),
        ("prompt_len", "<u4"),
        ("response_len", "<u4"),
        ("n_turns", "<u4"),
        ("truncated", "u1"),  # response hit max_new_tokens
        ("reward_status", "u1"),  # REWARD_OK, or why the reward is a stand-in 0 (REWARD_ERROR, REWARD_TIMEOUT)
        ("domain", "u1"),  # source of a mixed dataset (index into the log's `domains` attribute); 0 otherwise
        ("episode_status", "u1"),  # 0 single-turn; multi-turn: EPISODE_OK, or how the environment failed
        ("format_errors", "u1"),  # multi-turn: turns whose reply the environment could not parse (at most 255)
        ("success", "u1"),  # multi-turn: the environment said the episode was solved (info success / solved)
        ("n_reward_parts", "u1"),  # 0, or with rewards.models 1 + their number (rewards/mixing.py)
        ("_pad", "u1", (1,)),
        ("t_start", "<f8"),  # wall clock (time.time()) when generation began
        ("t_end", "<f8"),  # when the reward was computed
    ]
)
assert FIXED_DTYPE.names is not None  # numpy's stubs allow None (a dtype without fields)
FIXED_NAMES: tuple[str, ...] = FIXED_DTYPE.names  # the fixed fields, in order

RAGGED = (
    ("prompt_ids", np.int32, "prompt_len"),
    ("response_ids", np.int32, "response_len"),
    ("logprobs", np.float32, "response_len"),
    ("loss_mask", np.uint8, "response_len"),
    ("turn_starts", np.int32, "n_turns"),
    ("turn_rewards", np.float32, "n_turns"),
    ("reward_parts", np.float32, "n_reward_parts"),
)

# reward_status values: the reward function returned a number / raised / ran past task.reward_timeout.
REWARD_OK, REWARD_ERROR, REWARD_TIMEOUT = 0, 1, 2
# episode_status values: not an episode (single-turn) / an episode the environment played to its end / one whose
# environment raised or gave something that is not (text, number, bool, dict) / one whose environment hung.
SINGLE_TURN, EPISODE_OK, EPISODE_ERROR, EPISODE_TIMEOUT = 0, 1, 2, 3

_LENGTH_FIELDS = {length_field for _, _, length_field in RAGGED}
_HEADER = struct.Struct(f"<4sII{1 + len(RAGGED)}Q4x")


class LayoutError(ValueError):
    """A buffer that is not a trajectory batch of a layout this code knows."""


def _align8(n: int) -> int:
    return (n + 7) & ~7


def record_uid(prompt_id, sample_idx, group_size: int):
    """Unique id of a trajectory in a run's data stream (works on arrays too)."""
    return np.asarray(prompt_id, dtype=np.uint64) * np.uint64(group_size) + np.asarray(sample_idx, dtype=np.uint64)


@dataclass
class TrajectoryBatch:
    fixed: np.ndarray  # FIXED_DTYPE, shape (n,)
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    logprobs: np.ndarray
    loss_mask: np.ndarray
    turn_starts: np.ndarray
    turn_rewards: np.ndarray
    # (a default: code that builds batches without rewards.models need not know of it; n_reward_parts is 0 then)
    reward_parts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))

    def __len__(self) -> int:
        return len(self.fixed)

    # --- construction ----------------------------------------------------
    @classmethod
    def empty(cls) -> TrajectoryBatch:
        return cls(np.zeros(0, FIXED_DTYPE), *(np.zeros(0, dt) for _, dt, _ in RAGGED))

    @classmethod
    def from_records(cls, records: list[dict]) -> TrajectoryBatch:
        """Build from dicts with fixed fields plus ragged lists (missing ragged = empty,
        missing loss_mask = all ones, missing turn_starts = one turn at 0, missing turn_rewards = zeros, missing reward_parts = none)."""
        given = {name for r in records for name in r}
        fixed = {name: [r.get(name, 0) for r in records] for name in FIXED_NAMES if name in given}
        return cls.from_columns(len(records), fixed, {name: [r.get(name) for r in records] for name, _, _ in RAGGED})

    @classmethod
    def from_columns(cls, n: int, fixed: dict, ragged: dict) -> TrajectoryBatch:
        """Build n rows from columns: `fixed` maps fixed field names to one value or n values; `ragged`
        maps ragged names to n sequences (a missing column or a None row gets from_records' default).
        The lengths come from the ragged sequences."""
        out = np.zeros(n, FIXED_DTYPE)
        for name, values in fixed.items():
            if not name.startswith("_") and name not in _LENGTH_FIELDS:
                out[name] = values

        def column(name, default):
            seqs = ragged.get(name)
            return [default(i) if seqs is None or seqs[i] is None else seqs[i] for i in range(n)]

        prompt = column("prompt_ids", lambda i: ())
        resp = column("response_ids", lambda i: ())
        out["response_len"] = [len(x) for x in resp]
        lp = column("logprobs", lambda i: np.zeros(out["response_len"][i]))
        mask = column("loss_mask", lambda i: np.ones(out["response_len"][i]))
        turns = column("turn_starts", lambda i: (0,))
        turn_rewards = column("turn_rewards", lambda i: np.zeros(len(turns[i])))
        reward_parts = column("reward_parts", lambda i: ())
        for i in range(n):
            if not len(lp[i]) == len(mask[i]) == out["response_len"][i]:
                raise ValueError(f"record {i}: logprobs, loss_mask and response_ids must have equal length")
            if len(turn_rewards[i]) != len(turns[i]):
                raise ValueError(f"record {i}: turn_rewards and turn_starts must have equal length")
        out["prompt_len"] = [len(x) for x in prompt]
        out["n_turns"] = [len(x) for x in turns]
        out["n_reward_parts"] = [len(x) for x in reward_parts]
        flat = [
            np.fromiter(itertools.chain.from_iterable(seqs), dt, count=sum(len(x) for x in seqs))
            for (_, dt, _), seqs in zip(RAGGED, (prompt, resp, lp, mask, turns, turn_rewards, reward_parts))
        ]
        return cls(out, *flat)

    @classmethod
    def concat(cls, batches: list[TrajectoryBatch]) -> TrajectoryBatch:
        if not batches:
            return cls.empty()
        return cls(
            np.concatenate([b.fixed for b in batches]),
            *(np.concatenate([getattr(b, name) for b in batches]) for name, _, _ in RAGGED),
        )

    # --- access ----------------------------------------------------------
    def offsets(self, length_field: str) -> np.ndarray:
        """Start offsets (n+1) of each row's slice for arrays sized by `length_field`."""
        out = np.zeros(len(self.fixed) + 1, np.int64)
        np.cumsum(self.fixed[length_field], out=out[1:])
        return out

    def record(self, i: int) -> dict:
        """One trajectory as a dict of scalars and arrays (views)."""
        row = self.fixed[i]
        out = {name: row[name].item() for name in FIXED_NAMES if not name.startswith("_")}
        for name, _, length_field in RAGGED:
            off = self.offsets(length_field)
            out[name] = getattr(self, name)[off[i] : off[i + 1]]
        return out

    def select(self, index) -> TrajectoryBatch:
        """Rows `index` (indices or boolean mask) as a new batch."""
        idx = np.arange(len(self))[index]
        parts = {}
        for name, _, length_field in RAGGED:
            parts[name] = getattr(self, name)[self._flat_positions(idx, length_field)]
        return TrajectoryBatch(self.fixed[idx].copy(), **parts)

    def _flat_positions(self, idx: np.ndarray, length_field: str) -> np.ndarray:
        """Positions in the flat arrays sized by `length_field` of rows `idx`, in that order (one gather
        instead of a Python loop over rows: select sits on the trainer's critical path)."""
        off = self.offsets(length_field)
        lengths = np.diff(off)[idx]
        starts = np.repeat(off[idx], lengths)
        within = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        return starts + within

    def uids(self, group_size: int) -> np.ndarray:
        return record_uid(self.fixed["prompt_id"], self.fixed["sample_idx"], group_size)

    @property
    def n_tokens(self) -> int:
        return int(self.fixed["prompt_len"].sum() + self.fixed["response_len"].sum())

    # --- packing ---------------------------------------------------------
    def _sections(self) -> list[np.ndarray]:
        return [self.fixed] + [np.ascontiguousarray(getattr(self, name), dt) for name, dt, _ in RAGGED]

    def packed_size(self) -> int:
        return _HEADER.size + sum(_align8(s.nbytes) for s in self._sections())

    def pack_into(self, buf) -> int:
        """Write the packed batch into a writable buffer; returns bytes written."""
        sections = self._sections()
        size = _HEADER.size + sum(_align8(s.nbytes) for s in sections)
        view = memoryview(buf).cast("B")
        if len(view) < size:
            raise ValueError(f"buffer of {len(view)} bytes is too small for a batch of {size} bytes")
        _HEADER.pack_into(view, 0, MAGIC, LAYOUT_VERSION, len(self.fixed), *(s.nbytes for s in sections))
        pos = _HEADER.size
        for s in sections:
            n = s.nbytes
            view[pos : pos + n] = s.view(np.uint8).reshape(-1).data if n else b""
            pad = _align8(n) - n
            if pad:
                view[pos + n : pos + n + pad] = bytes(pad)
            pos += _align8(n)
        return size

    def pack(self) -> bytearray:
        buf = bytearray(self.packed_size())
        self.pack_into(buf)
        return buf

    @staticmethod
    def _check_header(view: memoryview) -> tuple[int, list[int]]:
        """(n_records, section sizes) of a packed batch; LayoutError unless magic, layout and size agree."""
        if len(view) < _HEADER.size:
            raise LayoutError(f"truncated trajectory batch: {len(view)} bytes, the header alone needs {_HEADER.size}")
        magic, layout, n, *sizes = _HEADER.unpack_from(view, 0)
        if magic != MAGIC:
            raise LayoutError(f"not a trajectory batch (magic {magic!r}, expected {MAGIC!r})")
        if layout != LAYOUT_VERSION:
            raise LayoutError(
                f"trajectory batch layout version {layout}; this rollout-hpc reads version {LAYOUT_VERSION} "
                "(were generators and trainers started from different installs?)"
            )
        need = _HEADER.size + sum(_align8(s) for s in sizes)
        if len(view) < need:
            raise LayoutError(f"truncated trajectory batch: {len(view)} bytes, its header says {need}")
        if sizes[0] != n * FIXED_DTYPE.itemsize:
            raise LayoutError(f"corrupt trajectory batch: {n} records but {sizes[0]} bytes of fixed fields")
        return n, sizes

    @classmethod
    def peek(cls, buf) -> tuple[int, int]:
        """(n_records, n_tokens) from the header alone (a cheap check for code that only routes batches;
        `unpack` checks every length as well)."""
        view = memoryview(buf).cast("B")
        n, sizes = cls._check_header(view)
        return n, (sizes[1] + sizes[2]) // 4  # prompt_ids + response_ids, int32 each

    @classmethod
    def unpack(cls, buf) -> TrajectoryBatch:
        """Read a packed batch; arrays are views into `buf` (copy them to keep them past its life)."""
        view = memoryview(buf).cast("B")
        n, sizes = cls._check_header(view)
        arrays = []
        pos = _HEADER.size
        for size, dt in zip(sizes, [FIXED_DTYPE] + [dt for _, dt, _ in RAGGED]):
            arrays.append(np.frombuffer(view, dtype=dt, count=size // np.dtype(dt).itemsize, offset=pos))
            pos += _align8(size)
        batch = cls(*arrays)
        for name, _, length_field in RAGGED:
            expect = int(batch.fixed[length_field].sum())
            if len(getattr(batch, name)) != expect:
                raise LayoutError(
                    f"corrupt trajectory batch: {name} has {len(getattr(batch, name))} entries, lengths say {expect}"
                )
        return batch
