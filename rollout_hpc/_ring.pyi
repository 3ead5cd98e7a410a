"""Types of `rollout_hpc._ring`, the Rust extension (rust/src/python.rs) behind
`rollout_hpc.exchange.ring.Ring`. Use that wrapper; this module is its engine.

Timeouts are seconds (float), None waits forever; negative or NaN raises ValueError.
Blocking calls release the GIL and run signal handlers every 0.1 s while they wait.
tests/test_ring_stub.py checks that this file and the module export the same names.
"""

from collections.abc import Iterable
from typing import Final, TypedDict, final

from typing_extensions import Buffer

__all__ = [
    "__version__",
    "LAYOUT_VERSION",
    "Ring",
    "RecordView",
    "RecordWriter",
    "RingError",
    "RingTimeout",
    "RingClosed",
    "RecordTooLarge",
]

__version__: Final[str]
LAYOUT_VERSION: Final[int]

class RingError(Exception):
    """Any ring failure; the message names the segment file and the fix."""

class RingTimeout(RingError):
    """Nothing could be pushed or popped before the timeout."""

class RingClosed(RingError):
    """The ring was closed (and, for pops, is drained)."""

class RecordTooLarge(RingError):
    """The record is larger than the ring can ever hold."""

class _Stats(TypedDict):
    capacity: int
    records_in: int
    bytes_in: int
    records_out: int
    bytes_out: int
    fill_bytes: int
    fill_records: int
    high_water_bytes: int
    push_blocked_s: float
    pop_blocked_s: float
    producers: int
    consumers: int
    attached: int
    reclaimed_slots: int
    requeued_claims: int
    stolen_locks: int
    closed: bool

@final
class Ring:
    """A handle on a ring segment file. Not constructible: use create / open / open_or_create."""

    @staticmethod
    def create(path: str, capacity: int) -> Ring: ...
    @staticmethod
    def open(path: str) -> Ring: ...
    @staticmethod
    def open_or_create(path: str, capacity: int) -> Ring: ...
    @property
    def path(self) -> str: ...
    @property
    def capacity(self) -> int: ...
    @property
    def max_record_len(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    def push(self, data: Buffer, timeout: float | None = None) -> int:
        """Pushes one record (any C-contiguous buffer); returns its id."""
    def try_push(self, data: Buffer) -> bool: ...
    def push_many(self, items: Iterable[Buffer], timeout: float | None = None) -> int:
        """Pushes every item in order; RingTimeout (saying how many were pushed) if not all fit in time."""
    def pop(self, timeout: float | None = None) -> bytes: ...
    def try_pop(self) -> bytes | None: ...
    def pop_many(self, max_n: int, timeout: float | None = None) -> list[bytes]:
        """Waits up to `timeout` for one record, then takes up to `max_n` that are ready, stopping once the call
        holds 64 KiB beyond the first (larger batches page-fault their freed memory back in on every call)."""
    def pop_view(self, timeout: float | None = None) -> RecordView: ...
    def reserve(self, nbytes: int, timeout: float | None = None) -> RecordWriter: ...
    def close(self) -> None: ...
    def unlink(self) -> None: ...
    def stats(self) -> _Stats: ...

@final
class RecordView:
    """A claimed record, exported read-only through the buffer protocol (`memoryview(view)`)."""

    @property
    def id(self) -> int: ...
    def __len__(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __release_buffer__(self, buffer: memoryview, /) -> None: ...
    def ack(self) -> None:
        """Acknowledges the record; BufferError while a memoryview or numpy array still uses it."""
    def __enter__(self) -> memoryview:
        """A read-only memoryview on the record (released by __exit__)."""
    def __exit__(self, *exc: object) -> bool:
        """Releases the memoryview and acknowledges (RingError if a view or array on it is still alive)."""

@final
class RecordWriter:
    """A reserved record, exported writable through the buffer protocol (`memoryview(writer)`)."""

    @property
    def id(self) -> int: ...
    def __len__(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __release_buffer__(self, buffer: memoryview, /) -> None: ...
    def commit(self) -> None:
        """Publishes the record; BufferError while a memoryview of it is alive."""
    def abandon(self) -> None:
        """Gives the record up: consumers skip it."""
