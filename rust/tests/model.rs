//! Property test: random operation sequences against a simple queue model (FIFO, content,
//! wrap-around, held claims, abandoned reservations, batches, stats).

use std::collections::VecDeque;
use std::time::Duration;

use proptest::prelude::*;
use rollout_ring::{Claim, Ring};

#[derive(Debug, Clone)]
enum Op {
    Push(usize),
    PushMany(Vec<usize>),
    Abandon(usize),
    Pop,
    PopMany(usize),
    Hold,
    AckHeld,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0usize..1500).prop_map(Op::Push),
        1 => proptest::collection::vec(0usize..300, 1..8).prop_map(Op::PushMany),
        1 => (0usize..500).prop_map(Op::Abandon),
        3 => Just(Op::Pop),
        1 => (1usize..6).prop_map(Op::PopMany),
        1 => Just(Op::Hold),
        1 => Just(Op::AckHeld),
    ]
}

fn payload(n: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| (n as usize * 31 + i) as u8).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn ring_matches_queue_model(ops in proptest::collection::vec(op(), 1..120)) {
        let path = std::env::temp_dir().join(format!("ring-model-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let ring = Ring::create(&path, 4096).unwrap();
        ring.unlink().unwrap();
        let z = Some(Duration::ZERO);
        let mut model: VecDeque<Vec<u8>> = VecDeque::new();
        let mut held: VecDeque<(Claim, Vec<u8>)> = VecDeque::new();
        let (mut n, mut pushed, mut popped) = (0u64, 0u64, 0u64);
        for op in ops {
            match op {
                Op::Push(len) => {
                    let data = payload(n, len);
                    if ring.try_push(&data).unwrap() {
                        model.push_back(data);
                        n += 1;
                        pushed += 1;
                    }
                }
                Op::PushMany(lens) => {
                    let items: Vec<Vec<u8>> = lens.iter().enumerate().map(|(i, &l)| payload(n + i as u64, l)).collect();
                    let refs: Vec<&[u8]> = items.iter().map(|v| v.as_slice()).collect();
                    if let Ok(k) = ring.push_many(&refs, z) {
                        model.extend(items.into_iter().take(k));
                        n += k as u64;
                        pushed += k as u64;
                    }
                }
                Op::Abandon(len) => {
                    if let Ok(mut w) = ring.reserve(len, z) {
                        w.data_mut().fill(0xEE);
                        drop(w); // never committed: consumers must skip it
                    }
                }
                Op::Pop => match ring.try_pop().unwrap() {
                    Some(v) => { prop_assert_eq!(Some(v), model.pop_front()); popped += 1; }
                    None => prop_assert!(model.is_empty()),
                },
                Op::PopMany(k) => {
                    let mut out = Vec::new();
                    match ring.claim_many(k, usize::MAX, z, &mut out) {
                        Ok(got) => {
                            prop_assert!(got >= 1 && got <= k);
                            for c in &out { prop_assert_eq!(Some(c.data().to_vec()), model.pop_front()); }
                            popped += got as u64;
                            ring.ack_many(&mut out).unwrap();
                        }
                        Err(_) => prop_assert!(model.is_empty()),
                    }
                }
                Op::Hold => match ring.claim(z) {
                    Ok(c) => { let want = model.pop_front().unwrap(); prop_assert_eq!(c.data(), &want[..]); held.push_back((c, want)); }
                    Err(_) => prop_assert!(model.is_empty()),
                },
                Op::AckHeld => {
                    if let Some((c, want)) = held.pop_front() {
                        prop_assert_eq!(c.data(), &want[..]); // untouched while held, whatever happened since
                        c.ack();
                        popped += 1;
                    }
                }
            }
        }
        for (c, want) in held.drain(..) {
            prop_assert_eq!(c.data(), &want[..]);
            c.ack();
            popped += 1;
        }
        while let Some(v) = ring.try_pop().unwrap() {
            prop_assert_eq!(Some(v), model.pop_front());
            popped += 1;
        }
        prop_assert!(model.is_empty());
        let s = ring.stats();
        prop_assert_eq!((s.records_in, s.records_out, s.fill_bytes), (pushed, popped, 0));
    }
}
