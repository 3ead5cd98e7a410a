//! The commit protocol of the ring. See docs/ring.md for the full story.
//!
//! The data area is a byte ring addressed by 64-bit absolute positions that only grow
//! (`offset = pos % capacity`). Every record starts with a 32-byte header:
//!
//! ```text
//! pos u64 | id u64 | len u32 | flags u32 | state u64 = kind (8 bits) | lap tag (24) | owner pid (32)
//! ```
//!
//! * Producers reserve under a tiny lock (holder pid in the lock word, stolen if that pid
//!   dies): write the header as WRITING(pid), bump `head`, unlock. They copy outside the lock
//!   and publish with one release store/CAS of `state` to COMMITTED.
//! * Consumers claim the record at `read` with a CAS COMMITTED -> CLAIMED(pid), then help
//!   `read` forward; acknowledging stores DONE and helps `tail` forward over finished records.
//! * A WRITING record whose pid is dead is marked SKIPPED; a CLAIMED record whose pid is
//!   dead is taken over by a live consumer (at-least-once delivery).
//!
//! Every value read from shared memory is checked before it is used as an offset.

use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release, SeqCst};
use std::sync::atomic::{fence, AtomicU32, AtomicU64};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{Result, RingError};
use crate::segment::{Control, Segment, WaitWord, ALIGN, ATTACH_SLOTS};
use crate::sys;

const WRITING: u64 = 1;
const COMMITTED: u64 = 2;
const CLAIMED: u64 = 3;
const DONE: u64 = 4;
const SKIPPED: u64 = 5;
const PAD: u64 = 6;

const HDR: u64 = ALIGN;
/// A waiter spins this long, then sleeps on the futex: low latency when records flow, no CPU
/// burnt when they do not. (No sched_yield phase: on a busy node one yield can cost milliseconds.)
const SPIN_FOR: Duration = Duration::from_micros(30);
/// After waiting this long a waiter also runs the slow checks: liveness of the producer it
/// waits for, claims of dead consumers.
const PATIENCE: Duration = Duration::from_millis(2);
/// Longest single futex sleep: bounds the cost of a lost wake-up and paces crash checks.
const SLEEP_SLICE: Duration = Duration::from_millis(10);
const ROLE_PRODUCER: u32 = 1;
const ROLE_CONSUMER: u32 = 2;

#[repr(C)]
struct RecHdr {
    pos: AtomicU64,
    id: AtomicU64,
    len: AtomicU32,
    flags: AtomicU32,
    state: AtomicU64,
}
const _: () = assert!(std::mem::size_of::<RecHdr>() as u64 == HDR);

/// A record header as read at a cursor position.
struct RecordAt<'a> {
    hd: &'a RecHdr,
    state: u64,
    len: u32,
    /// Total size; None unless the header is that of a record at this position which fits the
    /// data area (otherwise the space was reused under a stale cursor, or is damaged).
    size: Option<u64>,
}

/// Where reservations go: a Vec for batches, an Option for one record (no allocation).
trait SlotSink {
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

fn rec_size(len: u64) -> u64 {
    (HDR + len).div_ceil(ALIGN) * ALIGN
}

/// Statistics snapshot (shared by all processes attached to the segment).
#[derive(Debug, Clone, Default)]
pub struct Stats {
    pub capacity: u64,
    pub records_in: u64,
    pub bytes_in: u64,
    pub records_out: u64,
    pub bytes_out: u64,
    pub fill_bytes: u64,
    pub fill_records: u64,
    pub high_water_bytes: u64,
    pub push_blocked_s: f64,
    pub pop_blocked_s: f64,
    pub producers: u64,
    pub consumers: u64,
    pub attached: u64,
    pub reclaimed_slots: u64,
    pub requeued_claims: u64,
    pub stolen_locks: u64,
    pub closed: bool,
}

/// What the consumer found at `read`.
enum Next {
    Claimed(Slot),
    Empty,
    /// The record at `read` is still being written by `owner`.
    Writing { pos: u64, owner: u32 },
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    pos: u64,
    len: u64,
    id: u64,
}

pub(crate) struct Inner {
    seg: Segment,
    cap: u64,
    pid: u32,
    /// Index in the attach table, or ATTACH_SLOTS when the table was full.
    slot: usize,
    roles: AtomicU32,
    /// Threads of this handle sleeping on data / space (the shared bitmask holds one bit per handle).
    sleeping: [AtomicU32; 2],
}

/// A handle on a ring segment. Cheap to clone; usable from many threads.
#[derive(Clone)]
pub struct Ring {
    inner: Arc<Inner>,
}

/// A record reserved for writing. `commit` publishes it; dropping it abandons it (consumers skip it).
pub struct WriteSlot {
    ring: Arc<Inner>,
    slot: Slot,
    open: bool,
}

/// A claimed record. Its bytes stay valid and untouched until it is acknowledged
/// (`ack`, or drop). If this process dies first, another consumer gets the record.
pub struct Claim {
    ring: Arc<Inner>,
    slot: Slot,
    open: bool,
}

impl Ring {
    /// Creates a new segment file (fails if the path exists).
    pub fn create(path: impl AsRef<std::path::Path>, capacity: u64) -> Result<Ring> {
        Ok(Ring::attach(Segment::create(path.as_ref(), capacity)?))
    }

    /// Opens an existing segment, validating its header and cursors.
    pub fn open(path: impl AsRef<std::path::Path>) -> Result<Ring> {
        let ring = Ring::attach(Segment::open(path.as_ref())?);
        ring.inner.check_cursors()?;
        Ok(ring)
    }

    /// Opens the segment if it exists, else creates it (race-free between processes).
    pub fn open_or_create(path: impl AsRef<std::path::Path>, capacity: u64) -> Result<Ring> {
        let path = path.as_ref();
        loop {
            match Ring::open(path) {
                Err(RingError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {}
                other => return other,
            }
            match Ring::create(path, capacity) {
                Err(RingError::Exists { .. }) => continue,
                other => return other,
            }
        }
    }

    fn attach(seg: Segment) -> Ring {
        let pid = sys::current_pid();
        let cap = seg.capacity;
        let slot = attach_slot(seg.control(), pid);
        Ring {
            inner: Arc::new(Inner {
                seg,
                cap,
                pid,
                slot,
                roles: AtomicU32::new(0),
                sleeping: [AtomicU32::new(0), AtomicU32::new(0)],
            }),
        }
    }

    pub fn path(&self) -> &str {
        &self.inner.seg.path
    }

    pub fn capacity(&self) -> u64 {
        self.inner.cap
    }

    /// Largest payload a record may have.
    pub fn max_record_len(&self) -> usize {
        (self.inner.cap - HDR).min(u32::MAX as u64) as usize
    }

    /// Removes the segment file; processes that have it mapped keep working.
    pub fn unlink(&self) -> Result<()> {
        std::fs::remove_file(&self.inner.seg.path).map_err(|source| RingError::Io {
            path: self.inner.seg.path.clone(),
            op: "unlink",
            source,
        })
    }

    /// Ends the stream: pushes fail from now on; pops drain what is left, then fail with `Closed`.
    pub fn close(&self) {
        let c = self.inner.ctl();
        c.closed.0.store(1, SeqCst);
        for w in [&c.data_wait.0, &c.space_wait.0] {
            w.seq.fetch_add(1, SeqCst);
            sys::futex_wake_all(&w.seq);
        }
    }

    pub fn is_closed(&self) -> bool {
        self.inner.ctl().closed.0.load(Acquire) != 0
    }

    /// Copies `data` into the ring as one record and commits it. Returns the record id.
    pub fn push(&self, data: &[u8], timeout: Option<Duration>) -> Result<u64> {
        let mut w = self.reserve(data.len(), timeout)?;
        w.data_mut().copy_from_slice(data);
        let id = w.id();
        w.commit()?;
        Ok(id)
    }

    /// `push` that never waits: `Ok(false)` when the ring has no room right now.
    pub fn try_push(&self, data: &[u8]) -> Result<bool> {
        match self.push(data, Some(Duration::ZERO)) {
            Ok(_) => Ok(true),
            Err(RingError::Timeout) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Reserves room for a record of `len` bytes to be written in place (zero copy).
    pub fn reserve(&self, len: usize, timeout: Option<Duration>) -> Result<WriteSlot> {
        let mut one: Option<Slot> = None;
        self.reserve_into(&[len], &mut one, timeout)?;
        let slot = one.expect("reserve_into reserves at least one record");
        Ok(WriteSlot { ring: self.inner.clone(), slot, open: true })
    }

    /// Reserves as many of `lens` (in order) as fit at once, waiting until at least one fits.
    pub fn reserve_many(&self, lens: &[usize], out: &mut Vec<WriteSlot>, timeout: Option<Duration>) -> Result<usize> {
        let mut slots: Vec<Slot> = Vec::with_capacity(lens.len().min(1024));
        self.reserve_into(lens, &mut slots, timeout)?;
        let n = slots.len();
        out.extend(slots.into_iter().map(|slot| WriteSlot { ring: self.inner.clone(), slot, open: true }));
        Ok(n)
    }

    fn reserve_into<S: SlotSink>(&self, lens: &[usize], out: &mut S, timeout: Option<Duration>) -> Result<()> {
        let inner = &self.inner;
        if lens.is_empty() {
            return Ok(());
        }
        let max = self.max_record_len();
        for &len in lens {
            if len > max {
                return Err(RingError::TooLarge { len, max });
            }
        }
        inner.note_role(ROLE_PRODUCER);
        let mut waiter = Waiter::new(timeout);
        loop {
            if inner.ctl().closed.0.load(Acquire) != 0 {
                return Err(RingError::Closed);
            }
            inner.reserve_locked(lens, out)?;
            if out.count() > 0 {
                waiter.finish(&inner.ctl().misc.0.push_blocked_ns);
                return Ok(());
            }
            inner.step_read(false)?;
            inner.advance_tail()?;
            let need = rec_size(lens[0] as u64);
            // Ask to be woken only once a quarter of the ring is free (or `need`, if more):
            // waking per freed record would cost both sides a syscall per record.
            let want = need.max(inner.cap / 4).min(inner.cap);
            waiter.wait(inner, 1, want, || inner.space_maybe_free(need))?;
        }
    }

    /// Pushes every item (in order), batching reservations. Returns when all are committed.
    pub fn push_many(&self, items: &[&[u8]], timeout: Option<Duration>) -> Result<usize> {
        let lens: Vec<usize> = items.iter().map(|d| d.len()).collect();
        let mut done = 0;
        let mut slots = Vec::new();
        while done < items.len() {
            let n = match self.reserve_many(&lens[done..], &mut slots, timeout) {
                Ok(n) => n,
                Err(RingError::Timeout) if done > 0 => return Ok(done),
                Err(e) => return Err(e),
            };
            for (w, d) in slots.iter_mut().zip(&items[done..done + n]) {
                w.data_mut().copy_from_slice(d);
            }
            self.commit_many(&mut slots)?;
            done += n;
        }
        Ok(done)
    }

    /// Commits reserved records (in order) with one wake-up of sleeping consumers.
    pub fn commit_many(&self, slots: &mut Vec<WriteSlot>) -> Result<()> {
        self.inner.commit_many(slots)
    }

    /// Claims the oldest committed record, waiting up to `timeout` (None: forever).
    pub fn claim(&self, timeout: Option<Duration>) -> Result<Claim> {
        let inner = &self.inner;
        inner.note_role(ROLE_CONSUMER);
        let mut waiter = Waiter::new(timeout);
        loop {
            match inner.next()? {
                Next::Claimed(slot) => {
                    waiter.finish(&inner.ctl().misc.0.pop_blocked_ns);
                    return Ok(Claim { ring: inner.clone(), slot, open: true });
                }
                Next::Writing { pos, owner } => {
                    if waiter.patient() && !sys::process_alive(owner) {
                        inner.skip_dead_writer(pos, owner);
                        continue;
                    }
                }
                Next::Empty => {
                    let closed = inner.ctl().closed.0.load(Acquire) != 0;
                    if waiter.patient() || closed {
                        if let Some(slot) = inner.take_orphan()? {
                            waiter.finish(&inner.ctl().misc.0.pop_blocked_ns);
                            return Ok(Claim { ring: inner.clone(), slot, open: true });
                        }
                        if closed && matches!(inner.next()?, Next::Empty) {
                            return Err(RingError::Closed);
                        }
                    }
                }
            }
            waiter.wait(inner, 0, 0, || inner.data_maybe_ready())?;
        }
    }

    /// Claims up to `max_n` records: waits (up to `timeout`) for the first, takes the rest if ready.
    pub fn claim_many(&self, max_n: usize, timeout: Option<Duration>, out: &mut Vec<Claim>) -> Result<usize> {
        if max_n == 0 {
            return Ok(0);
        }
        out.push(self.claim(timeout)?);
        let mut slots = Vec::new();
        self.inner.claim_run(max_n - 1, &mut slots)?;
        out.extend(slots.into_iter().map(|slot| Claim { ring: self.inner.clone(), slot, open: true }));
        Ok(out.len())
    }

    /// Copies out the oldest record and acknowledges it at once.
    pub fn pop(&self, timeout: Option<Duration>) -> Result<Vec<u8>> {
        let c = self.claim(timeout)?;
        let v = c.data().to_vec();
        c.ack();
        Ok(v)
    }

    pub fn try_pop(&self) -> Result<Option<Vec<u8>>> {
        match self.pop(Some(Duration::ZERO)) {
            Ok(v) => Ok(Some(v)),
            Err(RingError::Timeout) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Acknowledges many claims with one pass over the tail.
    pub fn ack_many(&self, claims: &mut Vec<Claim>) -> Result<()> {
        let (mut n, mut bytes) = (0u64, 0u64);
        for c in claims.iter_mut() {
            if c.open {
                c.open = false;
                if c.ring.finish_claim(c.slot) {
                    n += 1;
                    bytes += c.slot.len;
                }
            }
        }
        claims.clear();
        self.inner.count_out(n, bytes);
        self.inner.maybe_advance_tail()
    }

    pub fn stats(&self) -> Stats {
        self.inner.stats()
    }
}

/// `id`, `len` and `is_empty` of a record handle, read from the slot it holds.
macro_rules! record_accessors {
    ($($handle:ty),+) => {$(
        impl $handle {
            pub fn id(&self) -> u64 {
                self.slot.id
            }
            pub fn len(&self) -> usize {
                self.slot.len as usize
            }
            pub fn is_empty(&self) -> bool {
                self.slot.len == 0
            }
        }
    )+};
}

record_accessors!(WriteSlot, Claim);

impl WriteSlot {
    pub fn data_mut(&mut self) -> &mut [u8] {
        // In bounds: reserve_locked placed the whole record inside the data area.
        unsafe { std::slice::from_raw_parts_mut(self.ring.payload_ptr(self.slot), self.slot.len as usize) }
    }
    /// Publishes the record to consumers.
    pub fn commit(mut self) -> Result<()> {
        self.open = false;
        let r = self.ring.commit_one(self.slot);
        self.ring.count_in(1, self.slot.len);
        self.ring.notify(0);
        r
    }
}

impl Drop for WriteSlot {
    fn drop(&mut self) {
        if self.open {
            // Abandoned (error or panic while writing): consumers skip it.
            let st = self.ring.state_word(self.slot.pos, WRITING, self.ring.pid);
            let h = self.ring.hdr_unchecked(self.slot.pos);
            let _ = h.state.compare_exchange(st, self.ring.state_word(self.slot.pos, SKIPPED, 0), Release, Relaxed);
            self.ring.notify(0);
        }
    }
}

impl Claim {
    pub fn data(&self) -> &[u8] {
        // In bounds: `next` checked the record lies inside the data area.
        unsafe { std::slice::from_raw_parts(self.ring.payload_ptr(self.slot), self.slot.len as usize) }
    }
    /// Raw address of the payload (for zero-copy exports); valid until the claim is acknowledged.
    pub fn as_ptr(&self) -> *const u8 {
        self.data().as_ptr()
    }
    pub fn ack(mut self) {
        self.ack_in_place();
    }
    pub(crate) fn ack_in_place(&mut self) {
        if self.open {
            self.open = false;
            if self.ring.finish_claim(self.slot) {
                self.ring.count_out(1, self.slot.len);
            }
            let _ = self.ring.maybe_advance_tail();
        }
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.ack_in_place();
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

/// Spin, then sleep on a futex in slices, until a deadline.
struct Waiter {
    start: Instant,
    deadline: Option<Instant>,
    slept: bool,
}

impl Waiter {
    fn new(timeout: Option<Duration>) -> Waiter {
        let start = Instant::now();
        Waiter { start, deadline: timeout.map(|t| start + t), slept: false }
    }

    /// True once we waited long enough that slow checks (liveness, orphan scans) are worth it.
    fn patient(&self) -> bool {
        self.slept || self.start.elapsed() >= PATIENCE
    }

    fn finish(&self, counter: &AtomicU64) {
        if self.slept {
            counter.fetch_add(self.start.elapsed().as_nanos() as u64, Relaxed);
        }
    }

    /// One waiting step on wait word `which` (0 data, 1 space). `ready` re-checks the condition
    /// after announcing ourselves as a sleeper, so a concurrent notify is never missed for long.
    fn wait(&mut self, inner: &Inner, which: usize, want: u64, ready: impl Fn() -> bool) -> Result<()> {
        let now = Instant::now();
        let remaining = match self.deadline {
            Some(d) if now >= d => {
                let m = &inner.ctl().misc.0;
                self.finish(if which == 0 { &m.pop_blocked_ns } else { &m.push_blocked_ns });
                return Err(RingError::Timeout);
            }
            Some(d) => d - now,
            None => SLEEP_SLICE,
        };
        let waited = now - self.start;
        if waited < SPIN_FOR {
            for _ in 0..32 {
                std::hint::spin_loop();
            }
            return Ok(());
        }
        self.slept = true;
        let w = inner.wait_word(which);
        let bit = 1u64 << inner.slot.min(63);
        if want > 0 {
            w.want.fetch_max((want / ALIGN) as u32, SeqCst);
        }
        if inner.sleeping[which].fetch_add(1, SeqCst) == 0 {
            w.sleepers.fetch_or(bit, SeqCst);
        }
        let seq = w.seq.load(SeqCst);
        if !ready() {
            sys::futex_wait(&w.seq, seq, remaining.min(SLEEP_SLICE));
        }
        if inner.sleeping[which].fetch_sub(1, SeqCst) == 1 {
            w.sleepers.fetch_and(!bit, SeqCst);
        }
        Ok(())
    }
}

impl Inner {
    fn ctl(&self) -> &Control {
        self.seg.control()
    }

    fn wait_word(&self, which: usize) -> &WaitWord {
        if which == 0 {
            &self.ctl().data_wait.0
        } else {
            &self.ctl().space_wait.0
        }
    }

    fn corrupt(&self, what: String) -> RingError {
        RingError::Corrupt { path: self.seg.path.clone(), what }
    }

    fn tag(&self, pos: u64) -> u64 {
        (((pos / self.cap) ^ 0xA5_5A5A) & 0xFF_FFFF) << 8
    }

    fn state_word(&self, pos: u64, kind: u64, owner: u32) -> u64 {
        kind | self.tag(pos) | ((owner as u64) << 32)
    }

    /// First payload byte of a reserved or claimed record (just past its header).
    fn payload_ptr(&self, slot: Slot) -> *mut u8 {
        let off = (slot.pos % self.cap + HDR) as usize;
        // In bounds: slots come from reserve_locked or `next`, which keep records inside the data area.
        unsafe { self.seg.data().add(off) }
    }

    /// Header of the record at `pos`, which the caller has verified to be 32-aligned.
    fn hdr_unchecked(&self, pos: u64) -> &RecHdr {
        let off = (pos % self.cap) as usize;
        unsafe { &*(self.seg.data().add(off) as *const RecHdr) }
    }

    /// Header at a position read from shared memory: alignment checked, so always in bounds.
    fn hdr(&self, pos: u64) -> Result<&RecHdr> {
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
    fn record_at(&self, pos: u64) -> Result<RecordAt<'_>> {
        let hd = self.hdr(pos)?;
        let state = hd.state.load(Acquire);
        let len = hd.len.load(Relaxed);
        let is_here = hd.pos.load(Relaxed) == pos && (state & 0xFFFF_FF00) == self.tag(pos);
        let size = if is_here { self.checked_size(pos, len) } else { None };
        Ok(RecordAt { hd, state, len, size })
    }

    fn check_cursors(&self) -> Result<()> {
        let c = self.ctl();
        let t = c.tail.0.load(Acquire);
        let r = c.read.0.load(Acquire);
        let h = c.cursor.0.head.load(Acquire);
        if !(t <= r && r <= h && h - t <= self.cap && (t | r | h).is_multiple_of(ALIGN)) {
            return Err(self.corrupt(format!("cursors tail={t} read={r} head={h} capacity={}", self.cap)));
        }
        Ok(())
    }

    fn note_role(&self, role: u32) {
        if self.roles.load(Relaxed) & role == 0 {
            self.roles.fetch_or(role, Relaxed);
            if self.slot < ATTACH_SLOTS {
                self.ctl().attach[self.slot].roles.fetch_or(role, Relaxed);
            }
        }
    }

    // ---------- producer side ----------

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
            if rounds.is_multiple_of(256) && owner != 0 && owner != self.pid && !sys::process_alive(owner)
                && lock.compare_exchange(owner, self.pid, Acquire, Relaxed).is_ok() {
                    self.ctl().misc.0.stolen_locks.fetch_add(1, Relaxed);
                    return;
                }
            std::thread::yield_now();
        }
    }

    fn unlock(&self) {
        self.ctl().lock.0.store(0, Release);
    }

    /// Reserves the longest prefix of `lens` that fits now. Headers are complete before
    /// `head` moves past them, so a crash at any point leaves `head` consistent.
    fn reserve_locked(&self, lens: &[usize], out: &mut impl SlotSink) -> Result<()> {
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
                p.flags.store(0, Relaxed);
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
            r.flags.store(0, Relaxed);
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

    fn commit_one(&self, slot: Slot) -> Result<()> {
        let h = self.hdr_unchecked(slot.pos);
        let want = self.state_word(slot.pos, WRITING, self.pid);
        h.state
            .compare_exchange(want, self.state_word(slot.pos, COMMITTED, 0), Release, Relaxed)
            .map(|_| ())
            .map_err(|st| self.corrupt(format!("record {} was taken from its live producer (state {st:#x})", slot.id)))
    }

    fn commit_many(&self, slots: &mut Vec<WriteSlot>) -> Result<()> {
        let (mut n, mut bytes, mut res) = (0, 0, Ok(()));
        for w in slots.iter_mut() {
            w.open = false;
            n += 1;
            bytes += w.slot.len;
            if let Err(e) = self.commit_one(w.slot) {
                res = Err(e);
            }
        }
        slots.clear();
        self.count_in(n, bytes);
        self.notify(0);
        res
    }

    fn count_in(&self, n: u64, bytes: u64) {
        let c = &self.ctl().counters_in.0;
        c[0].fetch_add(n, Relaxed);
        c[1].fetch_add(bytes, Relaxed);
    }

    fn count_out(&self, n: u64, bytes: u64) {
        if n > 0 {
            let c = &self.ctl().counters_out.0;
            c[0].fetch_add(n, Relaxed);
            c[1].fetch_add(bytes, Relaxed);
        }
    }

    /// Wakes sleepers on wait word `which` if there are any.
    fn notify(&self, which: usize) {
        let w = self.wait_word(which);
        fence(SeqCst);
        if w.sleepers.load(Relaxed) != 0 {
            w.seq.fetch_add(1, SeqCst);
            sys::futex_wake_all(&w.seq);
        }
    }

    /// Wakes sleeping producers once the free space reaches what they asked for.
    fn notify_space(&self) {
        let c = self.ctl();
        let w = &c.space_wait.0;
        fence(SeqCst);
        if w.sleepers.load(Relaxed) != 0 {
            let used = c.cursor.0.head.load(Acquire).saturating_sub(c.tail.0.load(Acquire));
            let free = self.cap.saturating_sub(used);
            if free >= (w.want.load(SeqCst) as u64) * ALIGN || c.closed.0.load(Relaxed) != 0 {
                w.want.store(0, SeqCst);
                w.seq.fetch_add(1, SeqCst);
                sys::futex_wake_all(&w.seq);
            }
        }
    }

    /// After acknowledgements: free space now only if producers wait for it or the ring is
    /// half full; otherwise leave it to a later ack or to a producer that runs short (they
    /// advance the tail themselves), so consumers do not bounce the tail cache line per record.
    fn maybe_advance_tail(&self) -> Result<()> {
        let c = self.ctl();
        let used = c.cursor.0.head.load(Relaxed).saturating_sub(c.tail.0.load(Relaxed));
        if c.space_wait.0.sleepers.load(Relaxed) != 0 || used > self.cap / 2 {
            self.advance_tail()?;
        }
        Ok(())
    }

    fn space_maybe_free(&self, need: u64) -> bool {
        let c = self.ctl();
        let h = c.cursor.0.head.load(Acquire);
        let t = c.tail.0.load(Acquire);
        c.closed.0.load(Acquire) != 0 || h.wrapping_sub(t) + need <= self.cap
    }

    // ---------- consumer side ----------

    fn data_maybe_ready(&self) -> bool {
        let c = self.ctl();
        if c.closed.0.load(Acquire) != 0 {
            return true;
        }
        let r = c.read.0.load(Acquire);
        let h = c.cursor.0.head.load(Acquire);
        if r >= h {
            return false;
        }
        match self.hdr(r) {
            Ok(hd) => hd.state.load(Acquire) & 0xFF != WRITING,
            Err(_) => true,
        }
    }

    /// Claims the record at `read` if it is committed, stepping over finished ones.
    fn next(&self) -> Result<Next> {
        self.step_read(true)
    }

    /// Moves `read` over finished records and pads (producers do this to free space even
    /// when no consumer is running); with `claim`, also claims the first committed record.
    fn step_read(&self, claim: bool) -> Result<Next> {
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
            match st & 0xFF {
                COMMITTED if !claim => return Ok(Next::Empty),
                COMMITTED => {
                    let mine = self.state_word(r, CLAIMED, self.pid);
                    if hd.state.compare_exchange(st, mine, AcqRel, Relaxed).is_ok() {
                        let _ = c.read.0.compare_exchange(r, r + size, AcqRel, Relaxed);
                        return Ok(Next::Claimed(Slot { pos: r, len: len as u64, id: hd.id.load(Relaxed) }));
                    }
                }
                WRITING => return Ok(Next::Writing { pos: r, owner: (st >> 32) as u32 }),
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

    /// Claims up to `max_n` committed records in a row from `read`, then moves `read` once.
    fn claim_run(&self, max_n: usize, out: &mut Vec<Slot>) -> Result<()> {
        let c = self.ctl();
        let r = c.read.0.load(Acquire);
        let h = c.cursor.0.head.load(Acquire);
        let mut p = r;
        let mut taken = 0;
        while taken < max_n && p < h {
            let RecordAt { hd, state: st, len, size } = self.record_at(p)?;
            let Some(size) = size else {
                break; // moved under us, or damaged: `next` sorts it out (and reports damage)
            };
            match st & 0xFF {
                COMMITTED => {
                    let mine = self.state_word(p, CLAIMED, self.pid);
                    if hd.state.compare_exchange(st, mine, AcqRel, Relaxed).is_ok() {
                        out.push(Slot { pos: p, len: len as u64, id: hd.id.load(Relaxed) });
                        taken += 1;
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

    /// Marks the unfinished record of a dead producer as skipped.
    fn skip_dead_writer(&self, pos: u64, owner: u32) {
        let hd = self.hdr_unchecked(pos);
        let writing = self.state_word(pos, WRITING, owner);
        if hd.state.compare_exchange(writing, self.state_word(pos, SKIPPED, 0), AcqRel, Relaxed).is_ok() {
            self.ctl().misc.0.reclaimed_slots.fetch_add(1, Relaxed);
        }
    }

    /// Takes over a record claimed by a consumer that died before acknowledging it.
    fn take_orphan(&self) -> Result<Option<Slot>> {
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
            let owner = (st >> 32) as u32;
            let dead = st & 0xFF == CLAIMED && owner != self.pid && {
                let alive = match known {
                    Some((pid, alive)) if pid == owner => alive,
                    _ => sys::process_alive(owner),
                };
                known = Some((owner, alive));
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

    /// Marks a claim done. False if it had been taken over (we were presumed dead).
    fn finish_claim(&self, slot: Slot) -> bool {
        let hd = self.hdr_unchecked(slot.pos);
        let mine = self.state_word(slot.pos, CLAIMED, self.pid);
        hd.state.compare_exchange(mine, self.state_word(slot.pos, DONE, 0), Release, Relaxed).is_ok()
    }

    /// Frees the run of finished records at `tail` (never past `read`).
    fn advance_tail(&self) -> Result<()> {
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
                if !matches!(state & 0xFF, DONE | SKIPPED | PAD) {
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

    fn stats(&self) -> Stats {
        let c = self.ctl();
        let _ = self.step_read(false).and_then(|_| self.advance_tail()); // make fill_bytes current
        let (mut producers, mut consumers, mut attached) = (0, 0, 0);
        for a in c.attach.iter() {
            let pid = a.pid.load(Acquire);
            if pid == 0 {
                continue;
            }
            if pid != self.pid && !sys::process_alive(pid) {
                continue;
            }
            attached += 1;
            let roles = a.roles.load(Relaxed);
            producers += (roles & ROLE_PRODUCER != 0) as u64;
            consumers += (roles & ROLE_CONSUMER != 0) as u64;
        }
        let m = &c.misc.0;
        let records_in = c.counters_in.0[0].load(Relaxed);
        let records_out = c.counters_out.0[0].load(Relaxed);
        let head = c.cursor.0.head.load(Acquire);
        let tail = c.tail.0.load(Acquire);
        Stats {
            capacity: self.cap,
            records_in,
            bytes_in: c.counters_in.0[1].load(Relaxed),
            records_out,
            bytes_out: c.counters_out.0[1].load(Relaxed),
            fill_bytes: head.saturating_sub(tail),
            fill_records: records_in.saturating_sub(records_out),
            high_water_bytes: m.high_water.load(Relaxed),
            push_blocked_s: m.push_blocked_ns.load(Relaxed) as f64 * 1e-9,
            pop_blocked_s: m.pop_blocked_ns.load(Relaxed) as f64 * 1e-9,
            producers,
            consumers,
            attached,
            reclaimed_slots: m.reclaimed_slots.load(Relaxed),
            requeued_claims: m.requeued_claims.load(Relaxed),
            stolen_locks: m.stolen_locks.load(Relaxed),
            closed: c.closed.0.load(Acquire) != 0,
        }
    }
}
