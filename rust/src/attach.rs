//! One process's attachment to a segment, and the segment's attach table.
//!
//! `Inner` is shared (through an `Arc`) by the clones of a `Ring` handle and by the records it
//! holds (`WriteSlot`, `Claim`): the mapping stays alive while any of them does. The attach
//! table (62 entries of pid and roles in the control block) says which processes use the
//! ring, and whether they pushed or popped; it feeds `stats()` and gives every process one
//! bit in the futex sleeper masks. An entry of a dead pid is reused, and its sleeper bits
//! cleared, by the next process to attach. Processes beyond 62 still work, uncounted.

use std::sync::atomic::AtomicU32;
use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed};

use crate::segment::{Control, Segment, ATTACH_SLOTS};
use crate::sys;

pub(crate) const ROLE_PRODUCER: u32 = 1;
pub(crate) const ROLE_CONSUMER: u32 = 2;

pub(crate) struct Inner {
    pub(crate) seg: Segment,
    pub(crate) cap: u64,
    pub(crate) pid: u32,
    /// Index in the attach table, or ATTACH_SLOTS when the table was full.
    pub(crate) slot: usize,
    roles: AtomicU32,
    /// Threads of this handle sleeping on data / space (the shared bitmask holds one bit per handle).
    pub(crate) sleeping: [AtomicU32; 2],
}

/// Live processes in the attach table: (producers, consumers, attached).
pub(crate) struct Attached {
    pub producers: u64,
    pub consumers: u64,
    pub attached: u64,
}

impl Inner {
    /// Maps this process onto a segment: takes a free (or dead process's) attach-table entry.
    pub(crate) fn attach(seg: Segment) -> Inner {
        let pid = sys::current_pid();
        let cap = seg.capacity;
        let slot = attach_slot(seg.control(), pid);
        Inner { seg, cap, pid, slot, roles: AtomicU32::new(0), sleeping: [AtomicU32::new(0), AtomicU32::new(0)] }
    }

    pub(crate) fn ctl(&self) -> &Control {
        self.seg.control()
    }

    /// Records that this process pushed (ROLE_PRODUCER) or popped (ROLE_CONSUMER).
    pub(crate) fn note_role(&self, role: u32) {
        if self.roles.load(Relaxed) & role == 0 {
            self.roles.fetch_or(role, Relaxed);
            if self.slot < ATTACH_SLOTS {
                self.ctl().attach[self.slot].roles.fetch_or(role, Relaxed);
            }
        }
    }

    /// Counts the live processes of the attach table by role.
    pub(crate) fn attached(&self) -> Attached {
        let mut n = Attached { producers: 0, consumers: 0, attached: 0 };
        for a in self.ctl().attach.iter() {
            let pid = a.pid.load(Acquire);
            if pid == 0 || (pid != self.pid && !sys::process_alive(pid)) {
                continue;
            }
            n.attached += 1;
            let roles = a.roles.load(Relaxed);
            n.producers += (roles & ROLE_PRODUCER != 0) as u64;
            n.consumers += (roles & ROLE_CONSUMER != 0) as u64;
        }
        n
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if self.slot < ATTACH_SLOTS {
            let a = &self.ctl().attach[self.slot];
            a.roles.store(0, Relaxed);
            let _ = a.pid.compare_exchange(self.pid, 0, AcqRel, Relaxed);
        }
    }
}

/// Takes the first attach-table entry that is free or whose process is dead.
fn attach_slot(c: &Control, pid: u32) -> usize {
    for (i, a) in c.attach.iter().enumerate() {
        let cur = a.pid.load(Acquire);
        let free = cur == 0 || (cur != pid && !sys::process_alive(cur));
        if free && a.pid.compare_exchange(cur, pid, AcqRel, Relaxed).is_ok() {
            a.roles.store(0, Relaxed);
            // A dead process may have left its sleeping bits set: clear them.
            c.data_wait.0.sleepers.fetch_and(!(1u64 << i), Relaxed);
            c.space_wait.0.sleepers.fetch_and(!(1u64 << i), Relaxed);
            return i;
        }
    }
    ATTACH_SLOTS
}
