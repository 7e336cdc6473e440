#![cfg(not(loom))]
mod common;
use common::{bytes, ring};
use memloop_ring::{RecordConsumer, RecordProducer, RecvInfo, RingError, RingKind, WaitPolicy};
use std::time::Duration;

fn pair(cap: u64) -> (RecordProducer, RecordConsumer) {
    let v = ring(RingKind::Record, cap, 0);
    (
        RecordProducer::attach(v.clone()).unwrap(),
        RecordConsumer::attach(v).unwrap(),
    )
}

#[test]
fn records_keep_boundaries() {
    let (mut p, mut c) = pair(256);
    assert!(p.send(b"one").unwrap());
    assert!(p.send(b"").unwrap());
    assert!(p.send_parts(&[b"th", b"ree"]).unwrap());
    let mut buf = [0u8; 32];
    assert_eq!(c.peek_len().unwrap(), Some(3));
    assert_eq!(
        c.recv(&mut buf).unwrap(),
        Some(RecvInfo { len: 3, copied: 3 })
    );
    assert_eq!(&buf[..3], b"one");
    assert_eq!(
        c.recv(&mut buf).unwrap(),
        Some(RecvInfo { len: 0, copied: 0 })
    );
    assert_eq!(
        c.recv(&mut buf).unwrap(),
        Some(RecvInfo { len: 5, copied: 5 })
    );
    assert_eq!(&buf[..5], b"three");
    assert_eq!(c.recv(&mut buf).unwrap(), None);
}

#[test]
fn truncation_like_udp() {
    let (mut p, mut c) = pair(256);
    p.send(&bytes(40, 3)).unwrap();
    p.send(b"next").unwrap();
    let mut small = [0u8; 10];
    assert_eq!(
        c.recv(&mut small).unwrap(),
        Some(RecvInfo {
            len: 40,
            copied: 10
        })
    );
    assert_eq!(&small[..], &bytes(40, 3)[..10]);
    assert_eq!(
        c.recv(&mut small).unwrap(),
        Some(RecvInfo { len: 4, copied: 4 }),
        "rest was discarded"
    );
}

#[test]
fn too_large_names_the_limit() {
    let (mut p, _c) = pair(128);
    assert_eq!(p.max_record(), 56);
    assert!(p.send(&[0; 56]).unwrap());
    match p.send(&[0; 57]) {
        Err(e @ RingError::TooLarge { len: 57, max: 56 }) => {
            assert!(e.to_string().contains("capacity/2 - 8"))
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn full_ring_says_no_room_then_recovers() {
    let (mut p, mut c) = pair(64);
    assert!(p.send(&[1; 24]).unwrap());
    assert!(p.send(&[2; 24]).unwrap());
    assert!(!p.send(&[3; 1]).unwrap(), "64 bytes used");
    let mut b = [0u8; 24];
    c.recv(&mut b).unwrap();
    assert!(p.send(&[3; 1]).unwrap());
}

#[test]
fn wrap_inserts_padding_and_consumer_skips_it() {
    let (mut p, mut c) = pair(128);
    let mut buf = [0u8; 64];
    for i in 0..200u32 {
        let rec = bytes(1 + (i as usize * 7) % 56, i as u8);
        assert!(
            p.send(&rec).unwrap(),
            "consumer keeps up, record {i} must fit"
        );
        let info = c.recv(&mut buf).unwrap().unwrap();
        assert_eq!(&buf[..info.copied], &rec[..], "record {i}");
    }
    assert!(c.recv(&mut buf).unwrap().is_none());
}

#[test]
fn padding_is_accounted_for_when_space_is_short() {
    let (mut p, mut c) = pair(128);
    let mut buf = [0u8; 64];
    for _ in 0..3 {
        assert!(p.send(&[0; 24]).unwrap()); // 32 bytes each
        c.recv(&mut buf).unwrap();
    }
    // head = tail = 96: 32 bytes to the end, 128 free.
    assert!(p.send(&[7; 40]).unwrap(), "needs 32 pad + 48");
    assert!(!p.send(&[0; 48]).unwrap(), "needs 56, only 48 free");
    assert!(p.send(&[8; 40]).unwrap(), "exactly 48 free");
    assert!(!p.send(&[]).unwrap(), "ring exactly full");
    assert_eq!(c.peek_len().unwrap(), Some(40));
    assert_eq!(
        c.recv(&mut buf).unwrap(),
        Some(RecvInfo {
            len: 40,
            copied: 40
        })
    );
    assert!(buf[..40].iter().all(|&b| b == 7));
    assert_eq!(
        c.recv(&mut buf).unwrap(),
        Some(RecvInfo {
            len: 40,
            copied: 40
        })
    );
    assert!(buf[..40].iter().all(|&b| b == 8));
}

#[test]
fn eof_and_close() {
    let (mut p, mut c) = pair(64);
    p.send(b"last").unwrap();
    p.shutdown();
    assert!(!c.is_eof().unwrap());
    let mut b = [0u8; 8];
    c.recv(&mut b).unwrap();
    assert!(c.is_eof().unwrap());
    c.close();
    assert!(p.reader_closed());
    assert!(matches!(p.send(b"x"), Err(RingError::Closed)));
}

#[test]
fn wait_writable_for_a_record() {
    let (mut p, mut c) = pair(64);
    let pol = WaitPolicy::default();
    p.send(&[0; 24]).unwrap();
    p.send(&[0; 24]).unwrap();
    assert!(!p.wait_writable(8, &pol, Duration::from_millis(2)).unwrap());
    assert!(matches!(
        p.wait_writable(100, &pol, Duration::ZERO),
        Err(RingError::TooLarge { .. })
    ));
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        let mut b = [0u8; 24];
        c.recv(&mut b).unwrap();
        c
    });
    assert!(p.wait_writable(8, &pol, Duration::from_secs(10)).unwrap());
    let mut c = t.join().unwrap();
    assert!(c.wait_readable(&pol, Duration::ZERO).unwrap());
}

#[test]
fn a_reader_that_hands_back_leaves_exactly_the_unread_records_to_the_writer() {
    let (mut p, mut c) = pair(256);
    for r in [&b"one"[..], b"two", b"three"] {
        assert!(p.send(r).unwrap());
    }
    let mut buf = [0u8; 8];
    assert_eq!(c.recv(&mut buf).unwrap().map(|i| i.len), Some(3));
    assert!(p.take_back().unwrap().is_empty(), "nothing while it reads");
    c.hand_back();
    assert!(matches!(p.send(b"late"), Err(RingError::Closed)));
    assert_eq!(p.take_back().unwrap(), [b"two".to_vec(), b"three".to_vec()]);
    assert!(p.take_back().unwrap().is_empty(), "taken once");
}

#[test]
fn a_plain_close_hands_nothing_back() {
    let (mut p, mut c) = pair(256);
    assert!(p.send(b"one").unwrap());
    c.close();
    assert!(p.take_back().unwrap().is_empty());
}

#[test]
fn taken_back_records_cross_the_ring_end_whole() {
    let (mut p, mut c) = pair(128);
    let mut buf = [0u8; 64];
    // Move the indices near the end so the next records pad and wrap.
    for _ in 0..3 {
        assert!(p.send(&[9u8; 24]).unwrap());
        c.recv(&mut buf).unwrap();
    }
    assert!(p.send(&[1u8; 20]).unwrap());
    assert!(p.send(&[2u8; 30]).unwrap());
    c.hand_back();
    assert_eq!(p.take_back().unwrap(), [vec![1u8; 20], vec![2u8; 30]]);
}

/// Writes `payload` through a reservation of `max` bytes, as a device read into the ring would.
fn send_in_place(p: &mut RecordProducer, max: u64, payload: &[u8]) -> bool {
    let Some(r) = p.reserve(max).unwrap() else {
        return false;
    };
    assert!(payload.len() as u64 <= r.max);
    p.data().write(r.at, payload).unwrap();
    p.commit(r, payload.len() as u64).unwrap();
    true
}

/// Reads the next record in place and releases it.
fn recv_in_place(c: &mut RecordConsumer) -> Option<Vec<u8>> {
    let (at, len) = c.peek_in_place().unwrap()?;
    let mut out = vec![0u8; len as usize];
    c.data().read(at, &mut out).unwrap();
    assert!(c.consume_peeked().unwrap());
    Some(out)
}

#[test]
fn records_written_and_read_in_place_keep_boundaries_across_the_ring_end() {
    let (mut p, mut c) = pair(1024);
    let mut want = std::collections::VecDeque::new();
    let mut got = 0;
    for i in 0..200u32 {
        // Reserve generously (400 bytes), use a varying part of it: the reader sees only that.
        let rec = bytes(1 + (i as usize * 37) % 300, i as u8);
        while !send_in_place(&mut p, 400, &rec) {
            let r = recv_in_place(&mut c).expect("a full ring has a record");
            assert_eq!(Some(r), want.pop_front());
            got += 1;
        }
        want.push_back(rec);
    }
    while let Some(r) = recv_in_place(&mut c) {
        assert_eq!(Some(r), want.pop_front());
        got += 1;
    }
    assert_eq!(got, 200);
    assert!(want.is_empty());
    assert!(!c.consume_peeked().unwrap(), "nothing left to release");
}

#[test]
fn an_uncommitted_reservation_publishes_nothing_and_commit_checks_its_length() {
    let (mut p, mut c) = pair(256);
    let r = p.reserve(100).unwrap().unwrap();
    p.data().write(r.at, &[7u8; 100]).unwrap();
    assert_eq!(
        c.peek_in_place().unwrap(),
        None,
        "not visible before commit"
    );
    drop(r);
    let r = p.reserve(10).unwrap().unwrap();
    assert!(matches!(p.commit(r, 11), Err(RingError::TooLarge { .. })));
    assert!(matches!(
        p.reserve(p.max_record() + 1),
        Err(RingError::TooLarge { .. })
    ));
    assert!(send_in_place(&mut p, 10, b"hello"));
    assert_eq!(recv_in_place(&mut c).unwrap(), b"hello");
}
