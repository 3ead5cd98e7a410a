//! What the living do about a dead peer. Liveness is `sys::process_alive` (kill(pid, 0) plus
//! /proc state not Z/X); it is only asked on slow paths (a lock held for long, a call that has
//! waited PATIENCE), so healthy traffic never pays for it.
//!
//! | who died                      | found by                              | here                  | counter           |
//! |-------------------------------|---------------------------------------|-----------------------|-------------------|
//! | producer holding the lock     | a producer spinning on the lock       | `steal_lock_from_dead`| `stolen_locks`    |
//! | producer before commit        | a consumer blocked at that record     | `skip_dead_writer`    | `reclaimed_slots` |
//! | consumer holding a claim      | a consumer with nothing else to do    | `take_orphan`         | `requeued_claims` |
//! | anyone, in the attach table   | the next process to attach            | attach.rs             | -                 |

use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed};

use crate::attach::Inner;
use crate::error::Result;
use crate::record::{kind, owner, RecordAt, Slot, CLAIMED, SKIPPED, WRITING};
use crate::sys;

impl Inner {
    /// Takes the reservation lock from `holder` if that process is dead. `head` only moves
    /// after complete headers, so a holder dying mid-reservation leaves nothing half-published.
    pub(crate) fn steal_lock_from_dead(&self, holder: u32) -> bool {
        let lock = &self.ctl().lock.0;
        if holder != 0
            && holder != self.pid
            && !sys::process_alive(holder)
            && lock.compare_exchange(holder, self.pid, Acquire, Relaxed).is_ok()
        {
            self.ctl().misc.0.stolen_locks.fetch_add(1, Relaxed);
            return true;
        }
        false
    }

    /// Marks the unfinished record of a dead producer as skipped; records behind it, from
    /// any producer, are untouched.
    pub(crate) fn skip_dead_writer(&self, pos: u64, owner: u32) {
        let hd = self.hdr_unchecked(pos);
        let writing = self.state_word(pos, WRITING, owner);
        if hd.state.compare_exchange(writing, self.state_word(pos, SKIPPED, 0), AcqRel, Relaxed).is_ok() {
            self.ctl().misc.0.reclaimed_slots.fetch_add(1, Relaxed);
        }
    }

    /// Takes over a record claimed by a consumer that died before acknowledging it: scans
    /// `[tail, read)` for CLAIMED(dead pid). The record is delivered again (at-least-once).
    pub(crate) fn take_orphan(&self) -> Result<Option<Slot>> {
        let c = self.ctl();
        let t = c.tail.0.load(Acquire);
        let r = c.read.0.load(Acquire);
        let mut p = t;
        // Liveness checks cost a syscall and a /proc read: remember the last answer.
        let mut known: Option<(u32, bool)> = None;
        while p < r {
            let RecordAt { hd, state: st, len, size } = self.record_at(p)?;
            let Some(size) = size else {
                if c.tail.0.load(Acquire) != t {
                    return Ok(None); // reused under us; retry later
                }
                return Err(self.corrupt(format!("record header at position {p} is invalid")));
            };
            let holder = owner(st);
            let dead = kind(st) == CLAIMED && holder != self.pid && {
                let alive = match known {
                    Some((pid, alive)) if pid == holder => alive,
                    _ => sys::process_alive(holder),
                };
                known = Some((holder, alive));
                !alive
            };
            if dead {
                let mine = self.state_word(p, CLAIMED, self.pid);
                if hd.state.compare_exchange(st, mine, AcqRel, Relaxed).is_ok() {
                    c.misc.0.requeued_claims.fetch_add(1, Relaxed);
                    return Ok(Some(Slot { pos: p, len: len as u64, id: hd.id.load(Relaxed) }));
                }
            }
            p += size;
        }
        Ok(None)
    }
}
