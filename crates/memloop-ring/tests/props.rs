#![cfg(not(loom))]
//! Property tests: rings against a VecDeque model, and consumers fed arbitrary garbage.
mod common;
use common::ring;
use memloop_ring::header::{OFF_CAP, OFF_KIND, OFF_MAGIC, OFF_SLOT, RING_MAGIC};
use memloop_ring::*;
use memloop_shm::ShmSlice;
use proptest::prelude::*;
use std::collections::VecDeque;
use std::io::{IoSlice, IoSliceMut};

#[derive(Debug, Clone)]
enum Op {
    Write(Vec<u8>),
    WriteV(Vec<u8>, usize),
    Read(usize),
    ReadV(usize, usize),
    Peek(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..200).prop_map(Op::Write),
        (proptest::collection::vec(any::<u8>(), 0..200), 0..200usize)
            .prop_map(|(v, s)| Op::WriteV(v, s)),
        (0..200usize).prop_map(Op::Read),
        (0..100usize, 0..100usize).prop_map(|(a, b)| Op::ReadV(a, b)),
        (0..200usize).prop_map(Op::Peek),
    ]
}

fn apply(
    op: Op,
    p: &mut StreamProducer,
    c: &mut StreamConsumer,
    model: &mut VecDeque<u8>,
    cap: usize,
) {
    match op {
        Op::Write(v) => {
            let n = p.write(&v).unwrap();
            assert_eq!(n, v.len().min(cap - model.len()));
            model.extend(&v[..n]);
        }
        Op::WriteV(v, split) => {
            let (a, b) = v.split_at(split.min(v.len()));
            let n = p
                .write_vectored(&[IoSlice::new(a), IoSlice::new(b)])
                .unwrap();
            assert_eq!(n, v.len().min(cap - model.len()));
            model.extend(&v[..n]);
        }
        Op::Read(len) | Op::Peek(len) => {
            let mut buf = vec![0u8; len];
            let peek = matches!(op, Op::Peek(_));
            let n = if peek {
                c.peek(&mut buf).unwrap()
            } else {
                c.read(&mut buf).unwrap()
            };
            assert_eq!(n, len.min(model.len()));
            let expect: Vec<u8> = if peek {
                model.iter().take(n).copied().collect()
            } else {
                model.drain(..n).collect()
            };
            assert_eq!(&buf[..n], &expect[..]);
        }
        Op::ReadV(a, b) => {
            let (mut x, mut y) = (vec![0u8; a], vec![0u8; b]);
            let n = c
                .read_vectored(&mut [IoSliceMut::new(&mut x), IoSliceMut::new(&mut y)])
                .unwrap();
            assert_eq!(n, (a + b).min(model.len()));
            let got: Vec<u8> = x.iter().chain(y.iter()).take(n).copied().collect();
            assert_eq!(got, model.drain(..n).collect::<Vec<_>>());
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn stream_matches_vecdeque(cap_log in 6u32..9, ops in proptest::collection::vec(op(), 1..120)) {
        let cap = 1usize << cap_log;
        let v = ring(RingKind::Stream, cap as u64, 0);
        let (mut p, mut c) = (StreamProducer::attach(v.clone()).unwrap(), StreamConsumer::attach(v).unwrap());
        let mut model = VecDeque::new();
        for op in ops {
            apply(op, &mut p, &mut c, &mut model, cap);
            prop_assert_eq!(c.available().unwrap(), model.len() as u64);
            prop_assert_eq!(p.free_space().unwrap(), (cap - model.len()) as u64);
        }
        prop_assert_eq!(p.total_written() - c.total_read(), model.len() as u64);
    }

    #[test]
    fn records_come_out_in_order(cap_log in 6u32..9, ops in proptest::collection::vec((any::<bool>(), 0usize..300, any::<u8>()), 1..150)) {
        let cap = 1u64 << cap_log;
        let v = ring(RingKind::Record, cap, 0);
        let (mut p, mut c) = (RecordProducer::attach(v.clone()).unwrap(), RecordConsumer::attach(v).unwrap());
        let mut model: VecDeque<Vec<u8>> = VecDeque::new();
        for (send, len, fill) in ops {
            if send {
                let rec = vec![fill; len];
                match p.send(&rec) {
                    Ok(true) => model.push_back(rec),
                    Ok(false) => prop_assert!(!model.is_empty(), "an empty ring must take any legal record"),
                    Err(RingError::TooLarge { max, .. }) => prop_assert!(len as u64 > max),
                    Err(e) => prop_assert!(false, "{e}"),
                }
            } else {
                let mut buf = vec![0u8; len];
                match c.recv(&mut buf).unwrap() {
                    None => prop_assert!(model.is_empty()),
                    Some(info) => {
                        let want = model.pop_front().unwrap();
                        prop_assert_eq!(info.len, want.len() as u64);
                        prop_assert_eq!(&buf[..info.copied], &want[..info.copied]);
                        prop_assert_eq!(info.copied, want.len().min(len));
                    }
                }
            }
        }
    }

    #[test]
    fn consumers_survive_arbitrary_memory(
        cap_log in 6u32..8,
        garbage in proptest::collection::vec(any::<u8>(), 512),
        keep_static in any::<bool>(),
        kind in 1u32..4,
        bufs in proptest::collection::vec(0usize..300, 1..20),
    ) {
        let cap = 1u64 << cap_log;
        let v = ShmSlice::new_heap(ring_bytes(cap) as usize);
        v.write(0, &garbage[..v.len()]).unwrap();
        if keep_static {
            v.u64_at(OFF_MAGIC).unwrap().store(RING_MAGIC, std::sync::atomic::Ordering::SeqCst);
            v.u32_at(OFF_KIND).unwrap().store(kind, std::sync::atomic::Ordering::SeqCst);
            v.u64_at(OFF_CAP).unwrap().store(cap, std::sync::atomic::Ordering::SeqCst);
            v.u32_at(OFF_SLOT).unwrap().store(if kind == 3 { 16 } else { 0 }, std::sync::atomic::Ordering::SeqCst);
        }
        exercise_consumers(&v, &bufs);
        // Also: a consumer attached to a sane ring whose memory is then overwritten.
        let sane = ring(RingKind::Stream, cap, 0);
        let mut c = StreamConsumer::attach(sane.clone()).unwrap();
        let rec_ring = ring(RingKind::Record, cap, 0);
        let mut rc = RecordConsumer::attach(rec_ring.clone()).unwrap();
        sane.write(0, &garbage[..sane.len()]).unwrap();
        rec_ring.write(0, &garbage[..rec_ring.len()]).unwrap();
        for &n in &bufs {
            let mut buf = vec![0u8; n];
            if let Ok(k) = c.read(&mut buf) { prop_assert!(k <= n); }
            if let Ok(Some(i)) = rc.recv(&mut buf) { prop_assert!(i.copied <= n && i.len <= rc.max_record()); }
        }
    }
}

/// Runs every consumer operation on whatever `v` holds: only Ok/Err, never a panic or hang.
fn exercise_consumers(v: &ShmSlice, bufs: &[usize]) {
    let policy = WaitPolicy::default();
    let short = std::time::Duration::from_micros(100);
    if let Ok(mut c) = StreamConsumer::attach(v.clone()) {
        for &n in bufs {
            let mut buf = vec![0u8; n];
            if let Ok(k) = c.read(&mut buf) {
                assert!(k <= n);
            }
            if let Ok(k) = c.peek(&mut buf) {
                assert!(k <= n);
            }
            let _ = (c.available(), c.is_eof(), c.wait_readable(&policy, short));
        }
    }
    if let Ok(mut c) = RecordConsumer::attach(v.clone()) {
        for &n in bufs {
            let mut buf = vec![0u8; n];
            if let Ok(Some(i)) = c.recv(&mut buf) {
                assert!(i.copied <= n && i.len <= c.max_record());
            }
            let _ = (c.peek_len(), c.is_eof(), c.wait_readable(&policy, short));
        }
    }
    if let Ok(mut c) = SlotConsumer::attach(v.clone()) {
        for &n in bufs {
            let mut buf = vec![0u8; n / 16 * 16];
            if let Ok(k) = c.pop_batch(&mut buf) {
                assert!(k * 16 <= buf.len());
            }
            let _ = (c.pop_desc(), c.is_eof(), c.wait_readable(&policy, short));
        }
    }
}
