//! rollout-ring: the node-local experience ring of rollout-hpc.
//!
//! A crash-tolerant multi-producer multi-consumer ring of variable-length records in a
//! shared-memory file (see `ring` for the protocol, `segment` for the layout and
//! docs/ring.md for the design). `python` (behind the `python` feature that maturin
//! enables) exposes it as `rollout_hpc._ring`.

pub mod error;
pub mod ring;
pub mod segment;
pub mod sys;

pub use error::{Result, RingError};
pub use ring::{Claim, Ring, Stats, WriteSlot};

/// Version of the on-disk/in-memory segment layout. Bumped on any change.
pub const LAYOUT_VERSION: u32 = 1;

#[cfg(feature = "python")]
mod python;
