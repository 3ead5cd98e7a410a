//! Semantics, wrap-around, multi-thread stress and crash recovery of the pure-Rust ring.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rollout_ring::{Ring, RingError};

fn tmp(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("ring-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_file(&p);
    p
}

const T: Option<Duration> = Some(Duration::from_secs(20));

/// A record that proves its own integrity: producer, sequence, length, payload, CRC32.
fn make_record(producer: u32, seq: u32, len: usize) -> Vec<u8> {
    let len = len.max(16);
    let mut v = Vec::with_capacity(len);
    v.extend_from_slice(&producer.to_le_bytes());
    v.extend_from_slice(&seq.to_le_bytes());
    let mut x = (producer as u64) << 32 | seq as u64;
    while v.len() < len - 4 {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        v.push((x >> 56) as u8);
    }
    let crc = crc32fast::hash(&v);
    v.extend_from_slice(&crc.to_le_bytes());
    v
}

fn check_record(v: &[u8]) -> (u32, u32) {
    assert!(v.len() >= 16, "short record");
    let (body, crc) = v.split_at(v.len() - 4);
    assert_eq!(crc32fast::hash(body), u32::from_le_bytes(crc.try_into().unwrap()), "record checksum");
    (u32::from_le_bytes(v[0..4].try_into().unwrap()), u32::from_le_bytes(v[4..8].try_into().unwrap()))
}

#[test]
fn fifo_single_thread_and_ids() {
    let p = tmp("fifo");
    let r = Ring::create(&p, 1 << 16).unwrap();
    let a = r.push(b"one", None).unwrap();
    let b = r.push(b"two", None).unwrap();
    assert!(b > a);
    assert_eq!(r.pop(None).unwrap(), b"one");
    let c = r.claim(None).unwrap();
    assert_eq!((c.data(), c.id()), (&b"two"[..], b));
    c.ack();
    assert!(r.try_pop().unwrap().is_none());
    r.unlink().unwrap();
}

#[test]
fn claim_many_and_pop_many_stop_at_their_byte_bound() {
    let p = tmp("bytebound");
    let r = Ring::create(&p, 1 << 20).unwrap();
    for i in 0..10 {
        r.push(&make_record(0, i, 4096), None).unwrap();
    }
    let mut claims = Vec::new();
    // The first is taken whatever its size; then records while the total stays within 10 KiB.
    assert_eq!(r.claim_many(8, 10 << 10, T, &mut claims).unwrap(), 2);
    r.ack_many(&mut claims).unwrap();
    assert_eq!(r.claim_many(8, 100, T, &mut claims).unwrap(), 1);
    r.ack_many(&mut claims).unwrap();
    let mut out: Vec<Vec<u8>> = Vec::new();
    let got = r.pop_many_into(100, T, |len| Ok(vec![0; len]), &mut out).unwrap();
    assert_eq!(got, 7); // the rest: 28 KiB, under POP_MANY_BYTES
    assert_eq!(out.iter().map(|v| check_record(v).1).collect::<Vec<_>>(), (3..10).collect::<Vec<_>>());
    for i in 0..40 {
        r.push(&make_record(0, i, 4096), None).unwrap();
    }
    let got = r.pop_many_into(100, T, |len| Ok(vec![0; len]), &mut out).unwrap();
    assert_eq!(got, rollout_ring::POP_MANY_BYTES / 4096);
    r.unlink().unwrap();
}

#[test]
fn wraparound_keeps_every_byte() {
    let p = tmp("wrap");
    let r = Ring::create(&p, 4096).unwrap();
    let mut pending = std::collections::VecDeque::new();
    for i in 0..20_000u32 {
        let rec = make_record(0, i, (i as usize * 7919) % 2000);
        while !r.try_push(&rec).unwrap() {
            assert_eq!(r.pop(None).unwrap(), pending.pop_front().unwrap());
        }
        pending.push_back(rec);
    }
    while let Some(rec) = pending.pop_front() {
        assert_eq!(r.pop(None).unwrap(), rec);
    }
    let s = r.stats();
    assert_eq!((s.records_in, s.records_out, s.fill_bytes), (20_000, 20_000, 0));
    r.unlink().unwrap();
}

#[test]
fn largest_record_fits_from_any_position() {
    let p = tmp("largest");
    let r = Ring::create(&p, 4096).unwrap();
    let max = r.max_record_len();
    assert!(matches!(r.push(&vec![0; max + 1], None), Err(RingError::TooLarge { .. })));
    for shift in [0usize, 32, 1000, 4000] {
        r.push(&vec![1; shift], None).unwrap();
        r.pop(None).unwrap();
        r.push(&vec![7; max], T).unwrap();
        assert_eq!(r.pop(T).unwrap().len(), max);
    }
    r.unlink().unwrap();
}

#[test]
fn close_drains_then_fails() {
    let p = tmp("close");
    let r = Ring::create(&p, 4096).unwrap();
    r.push(b"x", None).unwrap();
    r.close();
    assert!(matches!(r.push(b"y", None), Err(RingError::Closed)));
    assert_eq!(r.pop(None).unwrap(), b"x");
    assert!(matches!(r.pop(None), Err(RingError::Closed)));
    r.unlink().unwrap();
}

#[test]
fn header_validation() {
    let p = tmp("header");
    Ring::create(&p, 8192).unwrap();
    assert!(matches!(Ring::create(&p, 8192), Err(RingError::Exists { .. })));
    let good = std::fs::read(&p).unwrap();
    let cases: [(usize, &[u8], &str); 4] = [
        (0, b"XXXXXXXX", "bad magic"),
        (8, &[9, 0, 0, 0], "layout version 9"),
        (20, &[1], "checksum"),
        (28, &[1], "checksum"),
    ];
    for (off, bytes, want) in cases {
        let mut bad = good.clone();
        bad[off..off + bytes.len()].copy_from_slice(bytes);
        std::fs::write(&p, &bad).unwrap();
        let err = Ring::open(&p).err().expect("damaged header must be refused").to_string();
        assert!(err.contains(want) && err.contains(p.to_str().unwrap()), "{err}");
    }
    std::fs::write(&p, &good[..5000]).unwrap();
    assert!(Ring::open(&p).err().unwrap().to_string().contains("truncated"));
    // Cursors beyond the capacity are refused at open.
    let mut bad = good.clone();
    bad[128..136].copy_from_slice(&(1u64 << 40).to_le_bytes());
    std::fs::write(&p, &bad).unwrap();
    assert!(Ring::open(&p).err().unwrap().to_string().contains("cursors"));
    std::fs::remove_file(&p).unwrap();
}

#[test]
fn stress_threads_checksummed_exactly_once() {
    const PRODUCERS: u32 = 4;
    const CONSUMERS: usize = 4;
    const PER: u32 = 20_000;
    let p = tmp("stress");
    let r = Ring::create(&p, 1 << 16).unwrap();
    let received = Arc::new(std::sync::Mutex::new(HashMap::<(u32, u32), usize>::new()));
    let got = Arc::new(AtomicUsize::new(0));
    let mut handles = Vec::new();
    for c in 0..CONSUMERS {
        let r = r.clone();
        let received = received.clone();
        let got = got.clone();
        handles.push(std::thread::spawn(move || {
            let mut last = HashMap::<u32, u32>::new();
            let mut batch = Vec::new();
            loop {
                let recs: Vec<Vec<u8>> = if c % 2 == 0 {
                    match r.pop(T) {
                        Ok(v) => vec![v],
                        Err(RingError::Closed) => break,
                        Err(e) => panic!("{e}"),
                    }
                } else {
                    match r.claim_many(32, usize::MAX, T, &mut batch) {
                        Ok(_) => {
                            let v = batch.iter().map(|c| c.data().to_vec()).collect();
                            r.ack_many(&mut batch).unwrap();
                            v
                        }
                        Err(RingError::Closed) => break,
                        Err(e) => panic!("{e}"),
                    }
                };
                for v in recs {
                    let (prod, seq) = check_record(&v);
                    // FIFO per producer as seen by one consumer.
                    if let Some(prev) = last.insert(prod, seq) {
                        assert!(seq > prev, "producer {prod}: {seq} after {prev}");
                    }
                    *received.lock().unwrap().entry((prod, seq)).or_default() += 1;
                    got.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    let producers: Vec<_> = (0..PRODUCERS)
        .map(|pr| {
            let r = r.clone();
            std::thread::spawn(move || {
                let mut seq = 0;
                while seq < PER {
                    if pr % 2 == 0 {
                        r.push(&make_record(pr, seq, 16 + (seq as usize * 131) % 3000), T).unwrap();
                        seq += 1;
                    } else {
                        let recs: Vec<Vec<u8>> =
                            (seq..(seq + 16).min(PER)).map(|s| make_record(pr, s, 16 + (s as usize % 64))).collect();
                        let refs: Vec<&[u8]> = recs.iter().map(|v| v.as_slice()).collect();
                        seq += r.push_many(&refs, T).unwrap() as u32;
                    }
                }
            })
        })
        .collect();
    for h in producers {
        h.join().unwrap();
    }
    r.close();
    for h in handles {
        h.join().unwrap();
    }
    let received = received.lock().unwrap();
    assert_eq!(received.len(), (PRODUCERS * PER) as usize);
    assert!(received.values().all(|&n| n == 1), "a record was delivered twice");
    r.unlink().unwrap();
}

/// Runs `child` in a forked process that then dies with SIGKILL (no destructors run).
fn in_killed_child(child: impl FnOnce()) {
    unsafe {
        let pid = libc::fork();
        assert!(pid >= 0);
        if pid == 0 {
            child();
            libc::kill(libc::getpid(), libc::SIGKILL);
            libc::_exit(1);
        }
        let mut status = 0;
        libc::waitpid(pid, &mut status, 0);
        assert!(libc::WIFSIGNALED(status));
    }
}

#[test]
fn dead_producer_record_is_skipped_and_dead_consumer_claim_requeued() {
    let p = tmp("crash");
    let r = Ring::create(&p, 1 << 14).unwrap();
    r.push(b"before", None).unwrap();
    let path = p.clone();
    in_killed_child(move || {
        let r = Ring::open(&path).unwrap();
        let mut w = r.reserve(100, None).unwrap();
        w.data_mut()[..4].copy_from_slice(b"half");
        std::mem::forget(w); // die mid-write
    });
    r.push(b"after", None).unwrap();
    assert_eq!(r.pop(T).unwrap(), b"before");
    assert_eq!(r.pop(T).unwrap(), b"after");
    assert_eq!(r.stats().reclaimed_slots, 1);

    r.push(b"held", None).unwrap();
    let path = p.clone();
    in_killed_child(move || {
        let r = Ring::open(&path).unwrap();
        let c = r.claim(T).unwrap();
        assert_eq!(c.data(), b"held");
        std::mem::forget(c); // die holding the claim
    });
    let c = r.claim(T).unwrap();
    assert_eq!(c.data(), b"held");
    c.ack();
    let s = r.stats();
    assert_eq!((s.requeued_claims, s.fill_bytes), (1, 0));
    r.unlink().unwrap();
}

#[test]
fn reopen_after_everyone_died_recovers_committed_records() {
    let p = tmp("reopen");
    let path = p.clone();
    Ring::create(&p, 1 << 14).unwrap();
    in_killed_child(move || {
        let r = Ring::open(&path).unwrap();
        for i in 0..10u8 {
            r.push(&[i; 50], None).unwrap();
        }
        std::mem::forget(r.claim(None).unwrap()); // claimed, never acked
        std::mem::forget(r.reserve(10, None).unwrap()); // reserved, never committed
                                                        // lock the reservation lock forever, as if killed inside it
        let ring_file = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
        use std::os::unix::fs::FileExt;
        ring_file.write_at(&std::process::id().to_le_bytes(), 64).unwrap();
    });
    let r = Ring::open(&p).unwrap();
    let mut got = Vec::new();
    while let Ok(v) = r.pop(Some(Duration::from_millis(200))) {
        got.push(v[0]);
    }
    got.sort();
    assert_eq!(got, (0..10).collect::<Vec<u8>>());
    r.push(b"still usable", T).unwrap();
    assert_eq!(r.pop(T).unwrap(), b"still usable");
    let s = r.stats();
    assert_eq!((s.requeued_claims, s.reclaimed_slots, s.stolen_locks), (1, 1, 1));
    r.unlink().unwrap();
}

/// A host that counts its calls and, once asked `stop_after` times, interrupts the waiting call.
struct CountingHost {
    unlocked: AtomicUsize,
    checks: AtomicUsize,
    stop_after: usize,
}

impl rollout_ring::Host for CountingHost {
    fn unlocked(&self, f: &mut (dyn FnMut() + Send)) {
        self.unlocked.fetch_add(1, Ordering::SeqCst);
        f()
    }
    fn interrupted(&self) -> rollout_ring::Result<()> {
        if self.checks.fetch_add(1, Ordering::SeqCst) + 1 >= self.stop_after {
            return Err(RingError::Host("interrupted by the host".into()));
        }
        Ok(())
    }
}

#[test]
fn host_runs_waits_and_long_copies_and_can_interrupt() {
    let p = tmp("host");
    let host = Arc::new(CountingHost { unlocked: AtomicUsize::new(0), checks: AtomicUsize::new(0), stop_after: 2 });
    let r = Ring::create(&p, 1 << 20).unwrap().with_host(host.clone());
    r.unlink().unwrap();
    // Short pushes and pops that need not wait never enter the host.
    r.push(&[1u8; 100], None).unwrap();
    assert_eq!(r.pop(Some(Duration::ZERO)).unwrap(), vec![1u8; 100]);
    assert!(r.try_pop().unwrap().is_none());
    assert_eq!(host.unlocked.load(Ordering::SeqCst), 0);
    // A long copy runs inside `unlocked`, in and out.
    let big = vec![7u8; rollout_ring::wait::LONG_COPY];
    r.push(&big, None).unwrap();
    assert_eq!(host.unlocked.load(Ordering::SeqCst), 1);
    assert_eq!(r.pop(None).unwrap(), big);
    assert_eq!(host.unlocked.load(Ordering::SeqCst), 2);
    // A wait forever ends at the host's second interrupt check (CHECK_EVERY apart).
    let t0 = std::time::Instant::now();
    match r.claim(None) {
        Err(RingError::Host(e)) => assert_eq!(e.to_string(), "interrupted by the host"),
        Err(e) => panic!("expected the host's error, got {e}"),
        Ok(_) => panic!("expected the host's error, got a record"),
    }
    let waited = t0.elapsed();
    assert!(waited >= 2 * rollout_ring::wait::CHECK_EVERY && waited < Duration::from_secs(5), "{waited:?}");
    assert_eq!(host.unlocked.load(Ordering::SeqCst), 3);
    assert!(r.stats().pop_blocked_s > 0.15);
}

#[test]
fn push_many_reports_a_partial_push_and_pop_into_checks_lengths() {
    let p = tmp("many");
    let r = Ring::create(&p, 4096).unwrap();
    r.unlink().unwrap();
    let rec = [3u8; 1000];
    let items: Vec<&[u8]> = vec![&rec; 10];
    // Three 1000-byte records fit (1056 bytes each of 4096): the rest time out, reported as a count.
    let t0 = std::time::Instant::now();
    assert_eq!(r.push_many(&items, Some(Duration::from_millis(200))).unwrap(), 3);
    assert!(t0.elapsed() < Duration::from_secs(2));
    assert!(matches!(r.push_many(&items, Some(Duration::ZERO)), Err(RingError::Timeout)));
    let mut out: Vec<Vec<u8>> = Vec::new();
    assert_eq!(r.pop_many_into(2, None, |n| Ok(vec![0; n]), &mut out).unwrap(), 2);
    assert_eq!(out, vec![rec.to_vec(), rec.to_vec()]);
    // A buffer of the wrong length is refused; the record was claimed, so it is gone (as on any
    // error of `alloc`: the claim is acknowledged when dropped).
    assert!(matches!(r.pop_into(None, |n| Ok(vec![0; n + 1])), Err(RingError::Invalid(_))));
    assert!(r.try_pop().unwrap().is_none());
    assert_eq!(r.stats().records_out, 3);
}
