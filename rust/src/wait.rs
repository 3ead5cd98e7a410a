//! Blocking: how a call that cannot proceed waits, wakes and gives up, and the `Host` hooks
//! through which an embedding (the Python binding) runs the waiting and long copies without
//! its interpreter lock and interrupts them for signals.
//!
//! A blocked call retries its step (`block_on`), spinning for SPIN_FOR, then sleeping on a
//! shared futex in the segment in slices of at most SLEEP_SLICE, until its deadline. Sleepers
//! set their attach slot's bit in the wait word's mask; wakers make a syscall only when the
//! mask is non-zero. Producers waiting for space ask to be woken only once a quarter of the
//! ring (or what they need, if more) is free. After PATIENCE a waiter also runs the crash
//! checks of recovery.rs; every CHECK_EVERY it asks the host whether to stop.

use std::sync::atomic::Ordering::{Acquire, Relaxed, SeqCst};
use std::sync::atomic::{fence, AtomicU64};
use std::time::{Duration, Instant};

use crate::attach::Inner;
use crate::error::{Result, RingError};
use crate::record::{kind, WRITING};
use crate::segment::{WaitWord, ALIGN};
use crate::sys;

/// A waiter spins this long, then sleeps on the futex: low latency when records flow, no CPU
/// burnt when they do not. (No sched_yield phase: on a busy node one yield can cost milliseconds.)
const SPIN_FOR: Duration = Duration::from_micros(30);
/// After waiting this long a waiter also runs the slow checks: liveness of the producer it
/// waits for, claims of dead consumers.
const PATIENCE: Duration = Duration::from_millis(2);
/// Longest single futex sleep: bounds the cost of a lost wake-up and paces crash checks.
const SLEEP_SLICE: Duration = Duration::from_millis(10);
/// A blocked call asks `Host::interrupted` this often (Python: run signal handlers, so Ctrl-C works).
pub const CHECK_EVERY: Duration = Duration::from_millis(100);
/// Copies of a call totalling at least this many bytes run inside `Host::unlocked`
/// (for smaller ones, releasing the Python GIL costs more than it gains).
pub const LONG_COPY: usize = 64 * 1024;

/// What surrounds a call that blocks or copies a lot. Plain Rust callers need nothing
/// (`Plain`); the Python binding releases the GIL in `unlocked` and checks for signals in
/// `interrupted`. Set per handle with `Ring::with_host`.
pub trait Host: Send + Sync {
    /// Runs `f` (a wait that may last until the call's deadline, or a long copy) exactly once.
    fn unlocked(&self, f: &mut (dyn FnMut() + Send)) {
        f()
    }
    /// Called every CHECK_EVERY while a call waits (from inside `unlocked`). An error ends the
    /// call with that error, typically `RingError::Host` wrapping the host's own.
    fn interrupted(&self) -> Result<()> {
        Ok(())
    }
}

/// The host of plain Rust code: waits and copies run in place, nothing interrupts them.
pub struct Plain;
impl Host for Plain {}

/// Copies every (source, destination) pair, inside `host.unlocked` when they total LONG_COPY
/// bytes or more. Each destination is exactly as long as its source.
pub(crate) fn copy_all(host: &dyn Host, pairs: &mut [(&[u8], &mut [u8])]) {
    let long = pairs.iter().map(|(src, _)| src.len()).sum::<usize>() >= LONG_COPY;
    let mut copy = || pairs.iter_mut().for_each(|(src, dst)| dst.copy_from_slice(src));
    if long {
        host.unlocked(&mut copy);
    } else {
        copy();
    }
}

/// Why a step could not proceed: what to wait for.
#[derive(Clone, Copy)]
pub(crate) enum WaitFor {
    /// A record to claim (consumers).
    Data,
    /// `need` bytes of free space (producers).
    Space { need: u64 },
}

/// The outcome of one try of a blocking call's step.
pub(crate) enum Step<T> {
    Done(T),
    Blocked(WaitFor),
}

/// Runs `attempt` until it is done, an error occurs or the deadline passes (RingError::Timeout).
/// `attempt(patient)` is told whether the call has waited long enough for slow checks.
/// The first try runs in the caller's context and reads no clock (most calls need not wait,
/// and `unlocked` costs more than they do); the deadline counts from its end. The waiting
/// and every later try run inside `host.unlocked`.
pub(crate) fn block_on<T: Send>(
    inner: &Inner,
    host: &dyn Host,
    timeout: Option<Duration>,
    mut attempt: impl FnMut(bool) -> Result<Step<T>> + Send,
) -> Result<T> {
    let mut on = match attempt(false)? {
        Step::Done(t) => return Ok(t),
        Step::Blocked(on) => on,
    };
    if timeout == Some(Duration::ZERO) {
        return Err(RingError::Timeout);
    }
    let mut waiter = Waiter::new(timeout);
    let mut result = None;
    host.unlocked(&mut || {
        result = Some(loop {
            if let Err(e) = waiter.wait(inner, host, on) {
                break Err(e);
            }
            match attempt(waiter.patient()) {
                Ok(Step::Done(t)) => {
                    waiter.finish(inner, on);
                    break Ok(t);
                }
                Ok(Step::Blocked(now)) => on = now,
                Err(e) => break Err(e),
            }
        })
    });
    result.expect("Host::unlocked runs its closure")
}

/// Spin, then sleep on a futex in slices, until a deadline.
struct Waiter {
    start: Instant,
    deadline: Option<Instant>,
    next_check: Instant,
    slept: bool,
}

impl Waiter {
    fn new(timeout: Option<Duration>) -> Waiter {
        let start = Instant::now();
        Waiter { start, deadline: timeout.map(|t| start + t), next_check: start + CHECK_EVERY, slept: false }
    }

    /// True once we waited long enough that slow checks (liveness, orphan scans) are worth it.
    fn patient(&self) -> bool {
        self.slept || self.start.elapsed() >= PATIENCE
    }

    /// Adds the time spent asleep to the blocked-time counter of `on`.
    fn finish(&self, inner: &Inner, on: WaitFor) {
        if self.slept {
            let m = &inner.ctl().misc.0;
            let counter: &AtomicU64 = match on {
                WaitFor::Data => &m.pop_blocked_ns,
                WaitFor::Space { .. } => &m.push_blocked_ns,
            };
            counter.fetch_add(self.start.elapsed().as_nanos() as u64, Relaxed);
        }
    }

    /// One waiting step. The readiness check runs after announcing ourselves as a sleeper, so
    /// a concurrent notify is never missed for long.
    fn wait(&mut self, inner: &Inner, host: &dyn Host, on: WaitFor) -> Result<()> {
        let now = Instant::now();
        let remaining = match self.deadline {
            Some(d) if now >= d => {
                self.finish(inner, on);
                return Err(RingError::Timeout);
            }
            Some(d) => d - now,
            None => SLEEP_SLICE,
        };
        if now >= self.next_check {
            self.next_check = now + CHECK_EVERY;
            if let Err(e) = host.interrupted() {
                self.finish(inner, on);
                return Err(e);
            }
        }
        if now - self.start < SPIN_FOR {
            for _ in 0..32 {
                std::hint::spin_loop();
            }
            return Ok(());
        }
        self.slept = true;
        let (which, want, need) = match on {
            WaitFor::Data => (0, 0, 0),
            // Ask to be woken only once a quarter of the ring is free (or `need`, if more):
            // waking per freed record would cost both sides a syscall per record.
            WaitFor::Space { need } => (1, need.max(inner.cap / 4).min(inner.cap), need),
        };
        let w = inner.wait_word(which);
        let bit = 1u64 << inner.slot.min(63);
        if want > 0 {
            w.want.fetch_max((want / ALIGN) as u32, SeqCst);
        }
        if inner.sleeping[which].fetch_add(1, SeqCst) == 0 {
            w.sleepers.fetch_or(bit, SeqCst);
        }
        let seq = w.seq.load(SeqCst);
        let ready = if which == 0 { inner.data_maybe_ready() } else { inner.space_maybe_free(need) };
        if !ready {
            sys::futex_wait(&w.seq, seq, remaining.min(SLEEP_SLICE));
        }
        if inner.sleeping[which].fetch_sub(1, SeqCst) == 1 {
            w.sleepers.fetch_and(!bit, SeqCst);
        }
        Ok(())
    }
}

impl Inner {
    /// Wait word 0 (data, consumers sleep on it) or 1 (space, producers).
    fn wait_word(&self, which: usize) -> &WaitWord {
        if which == 0 {
            &self.ctl().data_wait.0
        } else {
            &self.ctl().space_wait.0
        }
    }

    /// Wakes sleeping consumers, if there are any.
    pub(crate) fn notify_consumers(&self) {
        let w = &self.ctl().data_wait.0;
        fence(SeqCst);
        if w.sleepers.load(Relaxed) != 0 {
            w.seq.fetch_add(1, SeqCst);
            sys::futex_wake_all(&w.seq);
        }
    }

    /// Wakes sleeping producers once the free space reaches what they asked for.
    pub(crate) fn notify_space(&self) {
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

    /// Wakes everybody (the ring was closed).
    pub(crate) fn wake_all(&self) {
        let c = self.ctl();
        for w in [&c.data_wait.0, &c.space_wait.0] {
            w.seq.fetch_add(1, SeqCst);
            sys::futex_wake_all(&w.seq);
        }
    }

    fn space_maybe_free(&self, need: u64) -> bool {
        let c = self.ctl();
        let h = c.cursor.0.head.load(Acquire);
        let t = c.tail.0.load(Acquire);
        c.closed.0.load(Acquire) != 0 || h.wrapping_sub(t) + need <= self.cap
    }

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
            Ok(hd) => kind(hd.state.load(Acquire)) != WRITING,
            Err(_) => true,
        }
    }
}
