//! The handles: `Ring` (one per process and segment, cheap to clone, usable from many
//! threads), `WriteSlot` (a reserved record being written) and `Claim` (a claimed record
//! being read), and every public operation, each built once from the protocol steps
//! (protocol.rs, recovery.rs) and the waiting loop (wait.rs). See docs/ring.md for the design.
//!
//! Ownership: a `WriteSlot` commits on `commit` and abandons (consumers skip it) on drop; a
//! `Claim` acknowledges on `ack` or drop. If the process dies first, the living recover the
//! record (recovery.rs).

use std::sync::atomic::Ordering::{Acquire, Relaxed, SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::attach::{Inner, ROLE_CONSUMER, ROLE_PRODUCER};
use crate::error::{Result, RingError};
use crate::protocol::{Next, SlotSink};
use crate::record::{rec_size, Slot, HDR};
use crate::segment::Segment;
use crate::sys;
use crate::wait::{block_on, copy_all, Host, Plain, Step, WaitFor};

/// Bytes `pop_many` claims at most per call (beyond its first record). Its records become new
/// allocations of the caller (Python bytes: malloc), freed together when the caller drops them;
/// glibc returns a free run of more than 128 KiB at the top of the heap to the kernel, so a larger
/// batch page-faults all of its memory back in on every call (4 KiB records, batches of 256 in
/// two processes: 0.70 M records/s, slower than single pops at 1.4 M; under this bound 1.7 M).
pub const POP_MANY_BYTES: usize = 64 * 1024;

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

/// A handle on a ring segment. Cheap to clone; usable from many threads.
#[derive(Clone)]
pub struct Ring {
    inner: Arc<Inner>,
    host: Arc<dyn Host>,
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
        Ring { inner: Arc::new(Inner::attach(seg)), host: Arc::new(Plain) }
    }

    /// This handle with another `Host` around its waits and long copies (the Python binding
    /// releases the GIL and checks for signals). Clones made afterwards share it.
    pub fn with_host(mut self, host: Arc<dyn Host>) -> Ring {
        self.host = host;
        self
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
        self.inner.ctl().closed.0.store(1, SeqCst);
        self.inner.wake_all();
    }

    pub fn is_closed(&self) -> bool {
        self.inner.ctl().closed.0.load(Acquire) != 0
    }

    // ---------- producing ----------

    /// Copies `data` into the ring as one record and commits it. Returns the record id.
    pub fn push(&self, data: &[u8], timeout: Option<Duration>) -> Result<u64> {
        let mut w = self.reserve(data.len(), timeout)?;
        copy_all(&*self.host, &mut [(data, w.data_mut())]);
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

    /// Pushes every item (in order), batching reservations, within one `timeout` for the
    /// whole call. Returns how many were committed: all of them, or fewer if the deadline
    /// passed after some were pushed (`Err(Timeout)` if none was).
    pub fn push_many(&self, items: &[&[u8]], timeout: Option<Duration>) -> Result<usize> {
        let lens: Vec<usize> = items.iter().map(|d| d.len()).collect();
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut done = 0;
        let mut slots = Vec::new();
        while done < items.len() {
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            let n = match self.reserve_many(&lens[done..], &mut slots, left) {
                Ok(n) => n,
                Err(RingError::Timeout) if done > 0 => return Ok(done),
                Err(e) => return Err(e),
            };
            let mut pairs: Vec<(&[u8], &mut [u8])> =
                items[done..done + n].iter().copied().zip(slots.iter_mut().map(WriteSlot::data_mut)).collect();
            copy_all(&*self.host, &mut pairs);
            drop(pairs);
            self.commit_many(&mut slots)?;
            done += n;
        }
        Ok(done)
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

    fn reserve_into<S: SlotSink + Send>(&self, lens: &[usize], out: &mut S, timeout: Option<Duration>) -> Result<()> {
        let inner = &*self.inner;
        if lens.is_empty() {
            return Ok(());
        }
        let max = self.max_record_len();
        if let Some(&len) = lens.iter().find(|&&len| len > max) {
            return Err(RingError::TooLarge { len, max });
        }
        inner.note_role(ROLE_PRODUCER);
        block_on(inner, &*self.host, timeout, |_patient| {
            if inner.ctl().closed.0.load(Acquire) != 0 {
                return Err(RingError::Closed);
            }
            inner.reserve_locked(lens, out)?;
            if out.count() > 0 {
                return Ok(Step::Done(()));
            }
            // Short of space: free what consumers finished (they leave it to us when idle).
            inner.step_read(false)?;
            inner.advance_tail()?;
            Ok(Step::Blocked(WaitFor::Space { need: rec_size(lens[0] as u64) }))
        })
    }

    /// Commits reserved records (in order) with one wake-up of sleeping consumers.
    pub fn commit_many(&self, slots: &mut Vec<WriteSlot>) -> Result<()> {
        let (mut n, mut bytes, mut res) = (0, 0, Ok(()));
        for w in slots.iter_mut() {
            w.open = false;
            n += 1;
            bytes += w.slot.len;
            if let Err(e) = self.inner.commit_one(w.slot) {
                res = Err(e);
            }
        }
        slots.clear();
        self.inner.count_in(n, bytes);
        self.inner.notify_consumers();
        res
    }

    // ---------- consuming ----------

    /// Claims the oldest committed record, waiting up to `timeout` (None: forever).
    pub fn claim(&self, timeout: Option<Duration>) -> Result<Claim> {
        let inner = &*self.inner;
        inner.note_role(ROLE_CONSUMER);
        let slot = block_on(inner, &*self.host, timeout, |patient| loop {
            match inner.next()? {
                Next::Claimed(slot) => return Ok(Step::Done(slot)),
                Next::Writing { pos, owner } => {
                    if patient && !sys::process_alive(owner) {
                        inner.skip_dead_writer(pos, owner);
                        continue;
                    }
                }
                Next::Empty => {
                    let closed = inner.ctl().closed.0.load(Acquire) != 0;
                    if patient || closed {
                        if let Some(slot) = inner.take_orphan()? {
                            return Ok(Step::Done(slot));
                        }
                        if closed && matches!(inner.next()?, Next::Empty) {
                            return Err(RingError::Closed);
                        }
                    }
                }
            }
            return Ok(Step::Blocked(WaitFor::Data));
        })?;
        Ok(self.claim_of(slot))
    }

    /// Claims up to `max_n` records: waits (up to `timeout`) for the first, takes the rest if ready
    /// while they total at most `max_bytes` (the first is taken whatever its size).
    pub fn claim_many(
        &self,
        max_n: usize,
        max_bytes: usize,
        timeout: Option<Duration>,
        out: &mut Vec<Claim>,
    ) -> Result<usize> {
        if max_n == 0 {
            return Ok(0);
        }
        let first = self.claim(timeout)?;
        let budget = (max_bytes as u64).saturating_sub(first.slot.len);
        out.push(first);
        let mut slots = Vec::new();
        self.inner.claim_run(max_n - 1, budget, &mut slots)?;
        out.extend(slots.into_iter().map(|slot| self.claim_of(slot)));
        Ok(out.len())
    }

    fn claim_of(&self, slot: Slot) -> Claim {
        Claim { ring: self.inner.clone(), slot, open: true }
    }

    /// Copies out the oldest record and acknowledges it at once.
    pub fn pop(&self, timeout: Option<Duration>) -> Result<Vec<u8>> {
        self.pop_into(timeout, |len| Ok(vec![0; len]))
    }

    /// `pop` into a buffer that `alloc(len)` makes for the record (e.g. a Python bytes object);
    /// it must be exactly `len` bytes long. If `alloc` fails, the record is acknowledged anyway
    /// (as by any consumer that drops a claim).
    pub fn pop_into<B: AsMut<[u8]>>(
        &self,
        timeout: Option<Duration>,
        alloc: impl FnOnce(usize) -> Result<B>,
    ) -> Result<B> {
        let claim = self.claim(timeout)?;
        let mut buf = alloc(claim.len())?;
        copy_all(&*self.host, &mut [(claim.data(), checked_len(buf.as_mut(), claim.len())?)]);
        claim.ack();
        Ok(buf)
    }

    /// `pop` that never waits: `Ok(None)` when there is nothing to pop right now.
    pub fn try_pop(&self) -> Result<Option<Vec<u8>>> {
        match self.pop(Some(Duration::ZERO)) {
            Ok(v) => Ok(Some(v)),
            Err(RingError::Timeout) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Pops up to `max_n` records into buffers made by `alloc(len)` (appended to `out`):
    /// waits (up to `timeout`) for the first, takes the rest if ready while they total at most
    /// POP_MANY_BYTES, acknowledges them all at once. Returns how many were appended.
    pub fn pop_many_into<B: AsMut<[u8]>>(
        &self,
        max_n: usize,
        timeout: Option<Duration>,
        mut alloc: impl FnMut(usize) -> Result<B>,
        out: &mut Vec<B>,
    ) -> Result<usize> {
        let mut claims = Vec::new();
        let n = self.claim_many(max_n, POP_MANY_BYTES, timeout, &mut claims)?;
        let start = out.len();
        for c in &claims {
            out.push(alloc(c.len())?);
        }
        let mut pairs = Vec::with_capacity(n);
        for (c, b) in claims.iter().zip(&mut out[start..]) {
            pairs.push((c.data(), checked_len(b.as_mut(), c.len())?));
        }
        copy_all(&*self.host, &mut pairs);
        drop(pairs);
        self.ack_many(&mut claims)?;
        Ok(n)
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
        let inner = &*self.inner;
        let c = inner.ctl();
        let _ = inner.step_read(false).and_then(|_| inner.advance_tail()); // make fill_bytes current
        let live = inner.attached();
        let m = &c.misc.0;
        let records_in = c.counters_in.0[0].load(Relaxed);
        let records_out = c.counters_out.0[0].load(Relaxed);
        let head = c.cursor.0.head.load(Acquire);
        let tail = c.tail.0.load(Acquire);
        Stats {
            capacity: inner.cap,
            records_in,
            bytes_in: c.counters_in.0[1].load(Relaxed),
            records_out,
            bytes_out: c.counters_out.0[1].load(Relaxed),
            fill_bytes: head.saturating_sub(tail),
            fill_records: records_in.saturating_sub(records_out),
            high_water_bytes: m.high_water.load(Relaxed),
            push_blocked_s: m.push_blocked_ns.load(Relaxed) as f64 * 1e-9,
            pop_blocked_s: m.pop_blocked_ns.load(Relaxed) as f64 * 1e-9,
            producers: live.producers,
            consumers: live.consumers,
            attached: live.attached,
            reclaimed_slots: m.reclaimed_slots.load(Relaxed),
            requeued_claims: m.requeued_claims.load(Relaxed),
            stolen_locks: m.stolen_locks.load(Relaxed),
            closed: c.closed.0.load(Acquire) != 0,
        }
    }
}

/// `buf`, if it is `len` bytes long (the contract of `pop_into`'s `alloc`).
fn checked_len(buf: &mut [u8], len: usize) -> Result<&mut [u8]> {
    if buf.len() != len {
        return Err(RingError::Invalid(format!("pop buffer is {} bytes, the record {len}", buf.len())));
    }
    Ok(buf)
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
        // In bounds: reserve_prefix placed the whole record inside the data area.
        unsafe { std::slice::from_raw_parts_mut(self.ring.payload_ptr(self.slot), self.slot.len as usize) }
    }
    /// Publishes the record to consumers.
    pub fn commit(mut self) -> Result<()> {
        self.open = false;
        let r = self.ring.commit_one(self.slot);
        self.ring.count_in(1, self.slot.len);
        self.ring.notify_consumers();
        r
    }
}

impl Drop for WriteSlot {
    fn drop(&mut self) {
        if self.open {
            self.ring.abandon(self.slot);
        }
    }
}

impl Claim {
    pub fn data(&self) -> &[u8] {
        // In bounds: the claim checked the record lies inside the data area.
        unsafe { std::slice::from_raw_parts(self.ring.payload_ptr(self.slot), self.slot.len as usize) }
    }
    /// Raw address of the payload (for zero-copy exports); valid until the claim is acknowledged.
    pub fn as_ptr(&self) -> *const u8 {
        self.data().as_ptr()
    }
    pub fn ack(mut self) {
        self.ack_in_place();
    }
    fn ack_in_place(&mut self) {
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
