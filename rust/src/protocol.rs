//! The commit protocol: the non-blocking steps on the shared cursors and record states.
//! Each step either makes progress or reports why it cannot; waiting is wait.rs's job, and
//! what to do about a dead peer is recovery.rs's.
//!
//! Three cursors, `tail <= read <= head`, `head - tail <= capacity`:
//!
//! * **reserve** (producer): under the reservation lock (holder pid in the lock word), write
//!   each record header as WRITING(pid), then publish `head` (release), unlock. Headers are
//!   complete before `head` moves past them, so a crash at any point leaves `head` consistent.
//! * **commit**: one CAS of `state` WRITING(pid) -> COMMITTED (release), outside any lock.
//! * **claim** (consumer): at `read`, CAS COMMITTED -> CLAIMED(pid), then help `read`
//!   forward; anybody finding a finished record at `read` moves it on.
//! * **ack**: CAS CLAIMED(pid) -> DONE; `tail` moves over the leading run of finished
//!   records (never past `read`), freeing their space.

use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release};

use crate::attach::Inner;
use crate::error::Result;
use crate::record::{
    kind, len_check, owner, rec_size, RecordAt, Slot, CLAIMED, COMMITTED, DONE, HDR, PAD, SKIPPED, WRITING,
};
use crate::segment::ALIGN;

/// What a consumer found at `read`.
pub(crate) enum Next {
    Claimed(Slot),
    Empty,
    /// The record at `read` is still being written by `owner`.
    Writing {
        pos: u64,
        owner: u32,
    },
}

/// Where reservations go: a Vec for batches, an Option for one record (no allocation).
pub(crate) trait SlotSink {
    fn put(&mut self, slot: Slot);
    fn count(&self) -> usize;
}
impl SlotSink for Vec<Slot> {
    fn put(&mut self, slot: Slot) {
        self.push(slot)
    }
    fn count(&self) -> usize {
        self.len()
    }
}
impl SlotSink for Option<Slot> {
    fn put(&mut self, slot: Slot) {
        *self = Some(slot)
    }
    fn count(&self) -> usize {
        self.is_some() as usize
    }
}

impl Inner {
    // ---------- producer side ----------

    /// Takes the reservation lock: a CAS of the lock word from 0 to our pid. A holder that
    /// takes long is checked for liveness and its lock stolen if it died (recovery.rs).
    fn lock(&self) {
        let lock = &self.ctl().lock.0;
        let mut rounds = 0u32;
        loop {
            let owner = match lock.compare_exchange_weak(0, self.pid, Acquire, Relaxed) {
                Ok(_) => return,
                Err(owner) => owner,
            };
            rounds += 1;
            if rounds < 64 {
                std::hint::spin_loop();
                continue;
            }
            // The holder only writes a few headers; if it takes this long, check it is alive.
            if rounds.is_multiple_of(256) && self.steal_lock_from_dead(owner) {
                return;
            }
            std::thread::yield_now();
        }
    }

    fn unlock(&self) {
        self.ctl().lock.0.store(0, Release);
    }

    /// Reserves the longest prefix of `lens` that fits now (possibly none).
    pub(crate) fn reserve_locked(&self, lens: &[usize], out: &mut impl SlotSink) -> Result<()> {
        self.lock();
        let r = self.reserve_prefix(lens, out);
        self.unlock();
        r
    }

    fn reserve_prefix(&self, lens: &[usize], out: &mut impl SlotSink) -> Result<()> {
        let c = self.ctl();
        let cap = self.cap;
        let mut h = c.cursor.0.head.load(Relaxed);
        let t = c.tail.0.load(Acquire);
        if h < t || h - t > cap || !h.is_multiple_of(ALIGN) {
            return Err(self.corrupt(format!("head={h} tail={t} capacity={cap}")));
        }
        let start = h;
        let mut id = c.cursor.0.next_id.load(Relaxed);
        for &len in lens {
            let size = rec_size(len as u64);
            let off = h % cap;
            if off + size > cap {
                // Does not fit before the end of the data area: pad to the end (if there is room
                // for the pad alone), the record then starts at offset 0 on a later pass.
                let pad = cap - off;
                if h + pad - t > cap {
                    break;
                }
                let p = self.hdr_unchecked(h);
                p.pos.store(h, Relaxed);
                p.id.store(0, Relaxed);
                p.len.store((pad - HDR) as u32, Relaxed);
                p.flags.store(len_check(h, (pad - HDR) as u32), Relaxed);
                p.state.store(self.state_word(h, PAD, 0), Relaxed);
                h += pad;
            }
            if h + size - t > cap {
                break;
            }
            let r = self.hdr_unchecked(h);
            r.pos.store(h, Relaxed);
            r.id.store(id, Relaxed);
            r.len.store(len as u32, Relaxed);
            r.flags.store(len_check(h, len as u32), Relaxed);
            r.state.store(self.state_word(h, WRITING, self.pid), Relaxed);
            out.put(Slot { pos: h, len: len as u64, id });
            id += 1;
            h += size;
        }
        if h != start {
            c.cursor.0.next_id.store(id, Relaxed);
            c.cursor.0.head.store(h, Release);
            // High-water mark of the backlog: bytes reserved but not yet claimed by a consumer.
            c.misc.0.high_water.fetch_max(h - c.read.0.load(Relaxed).min(h), Relaxed);
        }
        Ok(())
    }

    /// Publishes a reserved record. Fails only if a consumer took it from us (it thought we were dead).
    pub(crate) fn commit_one(&self, slot: Slot) -> Result<()> {
        let h = self.hdr_unchecked(slot.pos);
        let want = self.state_word(slot.pos, WRITING, self.pid);
        h.state
            .compare_exchange(want, self.state_word(slot.pos, COMMITTED, 0), Release, Relaxed)
            .map(|_| ())
            .map_err(|st| self.corrupt(format!("record {} was taken from its live producer (state {st:#x})", slot.id)))
    }

    /// Gives up a reserved record (error or panic while writing): consumers skip it.
    pub(crate) fn abandon(&self, slot: Slot) {
        let st = self.state_word(slot.pos, WRITING, self.pid);
        let h = self.hdr_unchecked(slot.pos);
        let _ = h.state.compare_exchange(st, self.state_word(slot.pos, SKIPPED, 0), Release, Relaxed);
        self.notify_consumers();
    }

    pub(crate) fn count_in(&self, n: u64, bytes: u64) {
        let c = &self.ctl().counters_in.0;
        c[0].fetch_add(n, Relaxed);
        c[1].fetch_add(bytes, Relaxed);
    }

    pub(crate) fn count_out(&self, n: u64, bytes: u64) {
        if n > 0 {
            let c = &self.ctl().counters_out.0;
            c[0].fetch_add(n, Relaxed);
            c[1].fetch_add(bytes, Relaxed);
        }
    }

    // ---------- consumer side ----------

    /// Claims the record at `read` if it is committed, stepping over finished ones.
    pub(crate) fn next(&self) -> Result<Next> {
        self.step_read(true)
    }

    /// Moves `read` over finished records and pads (producers do this to free space even
    /// when no consumer is running); with `claim`, also claims the first committed record.
    pub(crate) fn step_read(&self, claim: bool) -> Result<Next> {
        let c = self.ctl();
        loop {
            let r = c.read.0.load(Acquire);
            let h = c.cursor.0.head.load(Acquire);
            if r >= h {
                return Ok(Next::Empty);
            }
            let RecordAt { hd, state: st, len, size } = self.record_at(r)?;
            let Some(size) = size else {
                if c.read.0.load(Acquire) != r {
                    continue; // another consumer moved on and the space was reused
                }
                return Err(self.corrupt(format!(
                    "record header at position {r} is invalid (pos field {}, len {len}, state {st:#x})",
                    hd.pos.load(Relaxed)
                )));
            };
            match kind(st) {
                COMMITTED if !claim => return Ok(Next::Empty),
                COMMITTED => {
                    let mine = self.state_word(r, CLAIMED, self.pid);
                    if hd.state.compare_exchange(st, mine, AcqRel, Relaxed).is_ok() {
                        let _ = c.read.0.compare_exchange(r, r + size, AcqRel, Relaxed);
                        return Ok(Next::Claimed(Slot { pos: r, len: len as u64, id: hd.id.load(Relaxed) }));
                    }
                }
                WRITING => return Ok(Next::Writing { pos: r, owner: owner(st) }),
                CLAIMED | DONE | SKIPPED | PAD => {
                    let _ = c.read.0.compare_exchange(r, r + size, AcqRel, Relaxed);
                }
                other => {
                    if c.read.0.load(Acquire) != r {
                        continue;
                    }
                    return Err(self.corrupt(format!("record at position {r} has unknown state {other}")));
                }
            }
        }
    }

    /// Claims up to `max_n` committed records in a row from `read`, then moves `read` once;
    /// stops before a record that would take the claimed bytes past `max_bytes`.
    pub(crate) fn claim_run(&self, max_n: usize, max_bytes: u64, out: &mut Vec<Slot>) -> Result<()> {
        let c = self.ctl();
        let r = c.read.0.load(Acquire);
        let h = c.cursor.0.head.load(Acquire);
        let mut p = r;
        let mut taken = 0;
        let mut bytes = 0u64;
        while taken < max_n && p < h {
            let RecordAt { hd, state: st, len, size } = self.record_at(p)?;
            let Some(size) = size else {
                break; // moved under us, or damaged: `next` sorts it out (and reports damage)
            };
            match kind(st) {
                COMMITTED if bytes + len as u64 > max_bytes => break,
                COMMITTED => {
                    let mine = self.state_word(p, CLAIMED, self.pid);
                    if hd.state.compare_exchange(st, mine, AcqRel, Relaxed).is_ok() {
                        out.push(Slot { pos: p, len: len as u64, id: hd.id.load(Relaxed) });
                        taken += 1;
                        bytes += len as u64;
                    }
                }
                CLAIMED | DONE | SKIPPED | PAD => {}
                _ => break,
            }
            p += size;
        }
        // Everything in [r, p) is now claimed or finished: `read` may pass it.
        let mut cur = r;
        while cur < p {
            match c.read.0.compare_exchange_weak(cur, p, AcqRel, Relaxed) {
                Ok(_) => break,
                Err(now) => cur = now,
            }
        }
        Ok(())
    }

    /// Marks a claim done. False if it had been taken over (we were presumed dead).
    pub(crate) fn finish_claim(&self, slot: Slot) -> bool {
        let hd = self.hdr_unchecked(slot.pos);
        let mine = self.state_word(slot.pos, CLAIMED, self.pid);
        hd.state.compare_exchange(mine, self.state_word(slot.pos, DONE, 0), Release, Relaxed).is_ok()
    }

    /// After acknowledgements: free space now only if producers wait for it or the ring is
    /// half full; otherwise leave it to a later ack or to a producer that runs short (they
    /// advance the tail themselves), so consumers do not bounce the tail cache line per record.
    pub(crate) fn maybe_advance_tail(&self) -> Result<()> {
        let c = self.ctl();
        let used = c.cursor.0.head.load(Relaxed).saturating_sub(c.tail.0.load(Relaxed));
        if c.space_wait.0.sleepers.load(Relaxed) != 0 || used > self.cap / 2 {
            self.advance_tail()?;
        }
        Ok(())
    }

    /// Frees the run of finished records at `tail` (never past `read`).
    pub(crate) fn advance_tail(&self) -> Result<()> {
        let c = self.ctl();
        loop {
            let t = c.tail.0.load(Acquire);
            let r = c.read.0.load(Acquire);
            let mut e = t;
            while e < r {
                let RecordAt { state, size, .. } = self.record_at(e)?;
                let Some(size) = size else {
                    if c.tail.0.load(Acquire) != t {
                        break;
                    }
                    return Err(self.corrupt(format!("record header at position {e} is invalid")));
                };
                if !matches!(kind(state), DONE | SKIPPED | PAD) {
                    break;
                }
                e += size;
            }
            if e == t {
                return Ok(());
            }
            if c.tail.0.compare_exchange(t, e, AcqRel, Relaxed).is_ok() {
                self.notify_space();
                return Ok(());
            }
        }
    }
}
