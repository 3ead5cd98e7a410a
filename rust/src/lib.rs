//! rollout-ring: the node-local experience ring of rollout-hpc.
//!
//! A crash-tolerant multi-producer multi-consumer ring of variable-length records in a
//! shared-memory file. docs/ring.md tells the design; the modules, bottom up:
//!
//! | module        | concept                                                                      |
//! |---------------|------------------------------------------------------------------------------|
//! | `sys`         | the Linux primitives: shared futex wait/wake, process liveness               |
//! | `segment`     | the file (0600, published atomically), its mapping, static header, control block |
//! | `record`      | the 32-byte record header, record states, lap tag, validated header reads    |
//! | `attach`      | one process's attachment (`Inner`) and the attach table (pids, roles)        |
//! | `protocol`    | the commit protocol's non-blocking steps: reserve, commit, claim, ack, tail  |
//! | `recovery`    | what the living do about dead peers: steal the lock, skip, take over claims  |
//! | `wait`        | blocking: spin, futex slices, deadlines, wake-ups; the `Host` hooks          |
//! | `ring`        | the public handles `Ring`, `WriteSlot`, `Claim` and every operation          |
//! | `python`      | `rollout_hpc._ring` (feature `python`, built by maturin): converts types only |
//!
//! Everything but `python` is plain Rust with no PyO3.

mod attach;
pub mod error;
mod protocol;
mod record;
mod recovery;
pub mod ring;
pub mod segment;
pub mod sys;
pub mod wait;

pub use error::{Result, RingError};
pub use ring::{Claim, Ring, Stats, WriteSlot, POP_MANY_BYTES};
pub use wait::{Host, Plain};

/// Version of the on-disk/in-memory segment layout. Bumped on any change.
pub const LAYOUT_VERSION: u32 = 2; // 2: record headers carry a check word over (pos, len)

#[cfg(feature = "python")]
mod python;
