//! Records in the data area: the 32-byte record header, its states and lap tag, and the
//! validated read of a header at a position taken from shared memory.
//!
//! ```text
//! pos u64 | id u64 | len u32 | check u32 | state u64 = kind (8 bits) | lap tag (24) | owner pid (32)
//! ```
//!
//! A record starts on a 32-byte boundary with this header, its payload right after it, total
//! rounded up to 32. It never wraps: a PAD record fills the end of the data area instead.
//! Positions are absolute and only grow (`offset = pos % capacity`); the lap tag (from
//! `pos / capacity`) makes a stale header from an earlier lap never match a compare-and-swap
//! meant for the current one. Every value read from shared memory is checked before it is
//! used as an offset.

use std::sync::atomic::Ordering::{Acquire, Relaxed};
use std::sync::atomic::{AtomicU32, AtomicU64};

use crate::attach::Inner;
use crate::error::{Result, RingError};
use crate::segment::ALIGN;

/// Reserved by the owner pid, payload being written.
pub(crate) const WRITING: u64 = 1;
/// Published: consumers may claim it.
pub(crate) const COMMITTED: u64 = 2;
/// Taken by the owner pid; its bytes stay untouched until acknowledged.
pub(crate) const CLAIMED: u64 = 3;
/// Acknowledged: the space may be freed.
pub(crate) const DONE: u64 = 4;
/// Abandoned by its producer (error, panic, or death before commit): consumers step over it.
pub(crate) const SKIPPED: u64 = 5;
/// Filler from a record's position to the end of the data area.
pub(crate) const PAD: u64 = 6;

/// Size of a record header.
pub(crate) const HDR: u64 = ALIGN;

#[repr(C)]
pub(crate) struct RecHdr {
    pub pos: AtomicU64,
    pub id: AtomicU64,
    pub len: AtomicU32,
    pub flags: AtomicU32,
    pub state: AtomicU64,
}
const _: () = assert!(std::mem::size_of::<RecHdr>() as u64 == HDR);

/// The check word of a header at `pos` with payload length `len` (stored in its `flags` field). A header whose len
/// or pos was damaged no longer matches it, so a damaged length is reported as corruption instead of delivering a
/// record cut short or stretched over its neighbours.
pub(crate) fn len_check(pos: u64, len: u32) -> u32 {
    let x = pos ^ ((len as u64) << 32) ^ 0x9E37_79B9_7F4A_7C15;
    let x = (x ^ (x >> 29)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    (x ^ (x >> 32)) as u32
}

/// Total size of a record of `len` payload bytes (header included, rounded up to ALIGN).
pub(crate) fn rec_size(len: u64) -> u64 {
    (HDR + len).div_ceil(ALIGN) * ALIGN
}

/// The kind (WRITING, COMMITTED, ...) of a state word.
pub(crate) fn kind(state: u64) -> u64 {
    state & 0xFF
}

/// The owner pid of a state word (WRITING and CLAIMED records have one).
pub(crate) fn owner(state: u64) -> u32 {
    (state >> 32) as u32
}

/// A record this process reserved or claimed.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Slot {
    pub pos: u64,
    pub len: u64,
    pub id: u64,
}

/// A record header as read at a cursor position.
pub(crate) struct RecordAt<'a> {
    pub hd: &'a RecHdr,
    pub state: u64,
    pub len: u32,
    /// Total size; None unless the header is that of a record at this position which fits the
    /// data area (otherwise the space was reused under a stale cursor, or is damaged).
    pub size: Option<u64>,
}

impl Inner {
    pub(crate) fn corrupt(&self, what: String) -> RingError {
        RingError::Corrupt { path: self.seg.path.clone(), what }
    }

    fn tag(&self, pos: u64) -> u64 {
        (((pos / self.cap) ^ 0xA5_5A5A) & 0xFF_FFFF) << 8
    }

    /// The state word of a record of `kind` at `pos` owned by `owner` (0: nobody).
    pub(crate) fn state_word(&self, pos: u64, kind: u64, owner: u32) -> u64 {
        kind | self.tag(pos) | ((owner as u64) << 32)
    }

    /// First payload byte of a reserved or claimed record (just past its header).
    pub(crate) fn payload_ptr(&self, slot: Slot) -> *mut u8 {
        let off = (slot.pos % self.cap + HDR) as usize;
        // In bounds: slots come from reserve_prefix or a claim, which keep records inside the data area.
        unsafe { self.seg.data().add(off) }
    }

    /// Header of the record at `pos`, which the caller has verified to be 32-aligned.
    pub(crate) fn hdr_unchecked(&self, pos: u64) -> &RecHdr {
        let off = (pos % self.cap) as usize;
        unsafe { &*(self.seg.data().add(off) as *const RecHdr) }
    }

    /// Header at a position read from shared memory: alignment checked, so always in bounds.
    pub(crate) fn hdr(&self, pos: u64) -> Result<&RecHdr> {
        if !pos.is_multiple_of(ALIGN) {
            return Err(self.corrupt(format!("cursor {pos} is not a multiple of {ALIGN}")));
        }
        Ok(self.hdr_unchecked(pos))
    }

    /// Total size of the record at `pos` whose header says `len`, if it lies inside the data area.
    fn checked_size(&self, pos: u64, len: u32) -> Option<u64> {
        let size = rec_size(len as u64);
        (pos % self.cap + size <= self.cap).then_some(size)
    }

    /// Reads the header at `pos`, which a cursor (read, tail) pointed at.
    pub(crate) fn record_at(&self, pos: u64) -> Result<RecordAt<'_>> {
        let hd = self.hdr(pos)?;
        let state = hd.state.load(Acquire);
        let len = hd.len.load(Relaxed);
        let is_here = hd.pos.load(Relaxed) == pos
            && (state & 0xFFFF_FF00) == self.tag(pos)
            && hd.flags.load(Relaxed) == len_check(pos, len);
        let size = if is_here { self.checked_size(pos, len) } else { None };
        Ok(RecordAt { hd, state, len, size })
    }

    /// `tail <= read <= head`, `head - tail <= capacity`, all aligned (checked on open).
    pub(crate) fn check_cursors(&self) -> Result<()> {
        let c = self.ctl();
        let t = c.tail.0.load(Acquire);
        let r = c.read.0.load(Acquire);
        let h = c.cursor.0.head.load(Acquire);
        if !(t <= r && r <= h && h - t <= self.cap && (t | r | h).is_multiple_of(ALIGN)) {
            return Err(self.corrupt(format!("cursors tail={t} read={r} head={h} capacity={}", self.cap)));
        }
        Ok(())
    }
}
