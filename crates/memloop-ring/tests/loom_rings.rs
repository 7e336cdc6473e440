#![cfg(loom)]
//! Loom models of the three ring flavours across a wrap (capacity 64, indices pre-advanced).
//! Run: RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 CARGO_TARGET_DIR=target/loom \
//!      cargo test -p memloop-ring --release
use loom::thread;
use memloop_ring::header::{OFF_HEAD, OFF_TAIL};
use memloop_ring::*;
use memloop_shm::sync::Ordering::Relaxed;
use memloop_shm::ShmSlice;
use std::time::Duration;

fn ring_at(kind: RingKind, slot: u32, start: u64) -> ShmSlice {
    let v = ShmSlice::new_model(ring_bytes(64) as usize);
    init_ring(&v, kind, 64, slot).unwrap();
    v.u64_at(OFF_TAIL).unwrap().store(start, Relaxed);
    v.u64_at(OFF_HEAD).unwrap().store(start, Relaxed);
    v
}

#[test]
fn stream_across_the_wrap() {
    loom::model(|| {
        let v = ring_at(RingKind::Stream, 0, 61);
        let mut p = StreamProducer::attach(v.clone()).unwrap();
        let mut c = StreamConsumer::attach(v).unwrap();
        let t = thread::spawn(move || {
            assert_eq!(p.write(&[1, 2]).unwrap(), 2);
            assert_eq!(p.write(&[3, 4]).unwrap(), 2); // 63, 0: crosses the end
            p.shutdown();
        });
        let mut got = Vec::new();
        loop {
            let mut b = [0u8; 4];
            let n = c.read(&mut b).unwrap();
            got.extend_from_slice(&b[..n]);
            if n == 0 && c.is_eof().unwrap() {
                break;
            }
            if n == 0 {
                thread::yield_now();
            }
        }
        assert_eq!(got, [1, 2, 3, 4]);
        t.join().unwrap();
    });
}

#[test]
fn stream_blocking_wait_sees_data_and_eof() {
    loom::model(|| {
        let v = ring_at(RingKind::Stream, 0, 63);
        let mut p = StreamProducer::attach(v.clone()).unwrap();
        let mut c = StreamConsumer::attach(v).unwrap();
        let t = thread::spawn(move || {
            assert_eq!(p.write(&[7, 8]).unwrap(), 2);
            p.shutdown();
        });
        let policy = WaitPolicy {
            spin: Duration::ZERO,
            ..WaitPolicy::default()
        };
        let mut got = Vec::new();
        while !c.is_eof().unwrap() {
            c.wait_readable(&policy, Duration::from_millis(3)).unwrap();
            let mut b = [0u8; 2];
            let n = c.read(&mut b).unwrap();
            got.extend_from_slice(&b[..n]);
        }
        assert_eq!(got, [7, 8]);
        t.join().unwrap();
    });
}

#[test]
fn record_with_padding() {
    loom::model(|| {
        let v = ring_at(RingKind::Record, 0, 48);
        let mut p = RecordProducer::attach(v.clone()).unwrap();
        let mut c = RecordConsumer::attach(v).unwrap();
        let t = thread::spawn(move || {
            // 16 bytes to the end, the record needs 8 + 16: a padding record goes first.
            assert!(p.send(&[5; 9]).unwrap());
        });
        let mut b = [0u8; 16];
        let info = loop {
            if let Some(i) = c.recv(&mut b).unwrap() {
                break i;
            }
            thread::yield_now();
        };
        assert_eq!((info.len, info.copied), (9, 9));
        assert_eq!(&b[..9], &[5; 9]);
        t.join().unwrap();
    });
}

/// A record written in place (reserved for more than it uses, padded to the ring end) and read
/// in place: the reader never sees it before the commit, and sees exactly the bytes written.
#[test]
fn record_reserved_written_in_place_across_the_wrap() {
    loom::model(|| {
        let v = ring_at(RingKind::Record, 0, 48);
        let mut p = RecordProducer::attach(v.clone()).unwrap();
        let mut c = RecordConsumer::attach(v).unwrap();
        let t = thread::spawn(move || {
            // 16 bytes to the end; room for 16 is reserved: a padding record goes first.
            let r = p.reserve(16).unwrap().expect("an empty ring has room");
            p.data().write(r.at, &[7; 5]).unwrap();
            p.commit(r, 5).unwrap();
        });
        let (at, len) = loop {
            if let Some(x) = c.peek_in_place().unwrap() {
                break x;
            }
            thread::yield_now();
        };
        assert_eq!(len, 5);
        let mut b = [0u8; 5];
        c.data().read(at, &mut b).unwrap();
        assert_eq!(b, [7; 5]);
        assert!(c.consume_peeked().unwrap());
        assert_eq!(c.peek_in_place().unwrap(), None);
        t.join().unwrap();
    });
}

#[test]
fn slots_batch_across_the_wrap_with_backpressure() {
    loom::model(|| {
        let v = ring_at(RingKind::Slots, 16, 48);
        let mut p = SlotProducer::attach(v.clone()).unwrap();
        let mut c = SlotConsumer::attach(v).unwrap();
        let t = thread::spawn(move || {
            let (a, b) = ([1u8; 16], [2u8; 16]);
            let mut sent = 0;
            while sent < 2 {
                sent += p.push_batch(&[&a[..], &b[..]][sent..]).unwrap();
                thread::yield_now();
            }
        });
        let mut out = Vec::new();
        while out.len() < 2 {
            let mut b = [0u8; 16];
            if c.pop(&mut b).unwrap() {
                out.push(b[0]);
                assert!(b.iter().all(|&x| x == b[0]), "torn slot");
            } else {
                thread::yield_now();
            }
        }
        assert_eq!(out, [1, 2]);
        t.join().unwrap();
    });
}

/// A window change while the consumer reads (header module text): bytes 1, 2 go in under a
/// window of 64 at indices 62, 63; once the ring is empty the producer changes the window and
/// writes 3, 4 at indices 64, 65 — offsets 64, 65 under a window of 128, 0, 1 under 64. A
/// consumer that read them under the window it had before would get other bytes.
fn resize_mid_stream(from: u64, to: u64) {
    loom::model(move || {
        let v = ShmSlice::new_model(ring_bytes(128) as usize);
        init_ring_windowed(&v, RingKind::Stream, 128, 0, from).unwrap();
        v.u64_at(OFF_TAIL).unwrap().store(62, Relaxed);
        v.u64_at(OFF_HEAD).unwrap().store(62, Relaxed);
        let mut p = StreamProducer::attach(v.clone()).unwrap();
        let mut c = StreamConsumer::attach(v).unwrap();
        let t = thread::spawn(move || {
            assert_eq!(p.write(&[1, 2]).unwrap(), 2);
            while !p.resize(to).unwrap() {
                thread::yield_now(); // a smaller window: until the consumer has taken 1, 2
            }
            assert_eq!(p.write(&[3, 4]).unwrap(), 2);
        });
        let mut got = Vec::new();
        while got.len() < 4 {
            let mut b = [0u8; 4];
            let n = c.read(&mut b).unwrap();
            got.extend_from_slice(&b[..n]);
            if n == 0 {
                thread::yield_now();
            }
        }
        assert_eq!(got, [1, 2, 3, 4]);
        t.join().unwrap();
    });
}

#[test]
fn stream_window_grows_mid_stream() {
    resize_mid_stream(64, 128);
}

#[test]
fn stream_window_shrinks_mid_stream() {
    resize_mid_stream(128, 64);
}

/// A grow over bytes that wrap around the window's end (indices 62..66 of a window of 64:
/// offsets 62, 63, 0, 1) while the consumer reads: the producer copies the wrapped part past
/// the old end, where the new mapping finds it; a reader with either mapping reads 1..6 in
/// order, and the write after the grow (7, 8) lands on neither copy.
#[test]
fn stream_window_grows_over_wrapped_bytes() {
    loom::model(|| {
        let v = ShmSlice::new_model(ring_bytes(128) as usize);
        init_ring_windowed(&v, RingKind::Stream, 128, 0, 64).unwrap();
        v.u64_at(OFF_TAIL).unwrap().store(62, Relaxed);
        v.u64_at(OFF_HEAD).unwrap().store(62, Relaxed);
        let mut p = StreamProducer::attach(v.clone()).unwrap();
        let mut c = StreamConsumer::attach(v).unwrap();
        let t = thread::spawn(move || {
            assert_eq!(p.write(&[1, 2, 3, 4, 5, 6]).unwrap(), 6);
            assert!(p.resize(128).unwrap());
            assert_eq!(p.write(&[7, 8]).unwrap(), 2);
        });
        let mut got = Vec::new();
        while got.len() < 8 {
            let mut b = [0u8; 3];
            let n = c.read(&mut b).unwrap();
            got.extend_from_slice(&b[..n]);
            if n == 0 {
                thread::yield_now();
            }
        }
        assert_eq!(got, [1, 2, 3, 4, 5, 6, 7, 8]);
        t.join().unwrap();
    });
}

/// A reader hands back while the writer sends: every record the writer published is either
/// received by the reader or taken back by the writer afterwards — exactly once, in order.
#[test]
fn record_hand_back_loses_and_doubles_nothing() {
    loom::model(|| {
        let v = ring_at(RingKind::Record, 0, 40);
        let mut p = RecordProducer::attach(v.clone()).unwrap();
        let mut c = RecordConsumer::attach(v).unwrap();
        let t = thread::spawn(move || {
            let mut b = [0u8; 4];
            let got = c.recv(&mut b).unwrap().map(|_| b[0]);
            c.hand_back();
            got
        });
        let mut sent = Vec::new();
        for r in [1u8, 2] {
            match p.send(&[r]) {
                Ok(true) => sent.push(r),
                Err(RingError::Closed) => break,
                other => panic!("send: {other:?}"),
            }
        }
        let read = t.join().unwrap();
        let back: Vec<u8> = p.take_back().unwrap().iter().map(|r| r[0]).collect();
        let delivered: Vec<u8> = read.into_iter().chain(back).collect();
        assert_eq!(delivered, sent);
    });
}
