#![cfg(not(loom))]
//! A buggy peer scribbles on the shared header/data: every operation must fail cleanly.
mod common;
use common::ring;
use memloop_ring::header::*;
use memloop_ring::{
    RecordConsumer, RecordProducer, RingError, RingKind, SlotConsumer, StreamConsumer,
    StreamProducer, WaitPolicy,
};
use memloop_shm::sync::Ordering::SeqCst;
use memloop_shm::ShmSlice;
use std::time::Duration;

fn set64(v: &ShmSlice, off: u64, x: u64) {
    v.u64_at(off).unwrap().store(x, SeqCst);
}
fn set32(v: &ShmSlice, off: u64, x: u32) {
    v.u32_at(off).unwrap().store(x, SeqCst);
}
fn is_corrupt<T: std::fmt::Debug>(r: Result<T, RingError>) -> bool {
    matches!(r, Err(RingError::Corrupt { .. }))
}
fn is_bad_header<T>(r: Result<T, RingError>) -> bool {
    matches!(r, Err(RingError::BadHeader { .. }))
}

#[test]
fn hostile_static_header_is_bad_header() {
    let cases: [(u64, u64, bool); 5] = [
        (OFF_MAGIC, 0xdead_beef, true),
        (OFF_CAP, 1 << 63, true),
        (OFF_CAP, 100, true),
        (OFF_CAP, 32, true),
        (OFF_CAP, 128, true),
    ];
    for (off, val, is64) in cases {
        let v = ring(RingKind::Stream, 64, 0);
        if is64 {
            set64(&v, off, val);
        }
        assert!(
            is_bad_header(StreamConsumer::attach(v.clone())),
            "{off} = {val}"
        );
        assert!(is_bad_header(StreamProducer::attach(v)), "{off} = {val}");
    }
    for (off, val) in [(OFF_KIND, 9u32), (OFF_KIND, 0), (OFF_SLOT, 8)] {
        let v = ring(RingKind::Stream, 64, 0);
        set32(&v, off, val);
        assert!(is_bad_header(StreamConsumer::attach(v)), "{off} = {val}");
    }
    let v = ring(RingKind::Slots, 64, 16);
    set32(&v, OFF_SLOT, 3);
    assert!(is_bad_header(SlotConsumer::attach(v)));
}

#[test]
fn impossible_indices_at_attach_are_corrupt() {
    let v = ring(RingKind::Stream, 64, 0);
    set64(&v, OFF_TAIL, 65);
    assert!(is_corrupt(StreamConsumer::attach(v.clone())));
    assert!(is_corrupt(StreamProducer::attach(v.clone())));
    set64(&v, OFF_HEAD, 66); // head ahead of tail: wraps to a huge span
    assert!(is_corrupt(StreamConsumer::attach(v)));
    let r = ring(RingKind::Record, 64, 0);
    set64(&r, OFF_TAIL, 4);
    assert!(
        is_corrupt(RecordConsumer::attach(r)),
        "record indices must be 8-aligned"
    );
}

#[test]
fn hostile_tail_is_corrupt_for_the_consumer() {
    for bad in [65u64, u64::MAX, 1 << 40, 3] {
        let v = ring(RingKind::Stream, 64, 0);
        let mut p = StreamProducer::attach(v.clone()).unwrap();
        let mut c = StreamConsumer::attach(v.clone()).unwrap();
        p.write(&[1; 10]).unwrap();
        assert_eq!(c.available().unwrap(), 10);
        set64(&v, OFF_TAIL, bad); // beyond capacity, or backwards (3 < 10)
        assert!(is_corrupt(c.available()), "tail {bad}");
        assert!(is_corrupt(c.read(&mut [0; 64])), "tail {bad}");
    }
    // A waiting consumer with nothing cached must notice too (and not hang).
    let v = ring(RingKind::Stream, 64, 0);
    let mut c = StreamConsumer::attach(v.clone()).unwrap();
    set64(&v, OFF_TAIL, 1000);
    assert!(is_corrupt(
        c.wait_readable(&WaitPolicy::default(), Duration::from_secs(5))
    ));
}

#[test]
fn hostile_head_is_corrupt_for_the_producer() {
    for bad in [11u64, u64::MAX, 2] {
        let v = ring(RingKind::Stream, 64, 0);
        let mut p = StreamProducer::attach(v.clone()).unwrap();
        let mut c = StreamConsumer::attach(v.clone()).unwrap();
        p.write(&[1; 10]).unwrap();
        c.read(&mut [0; 5]).unwrap();
        assert_eq!(p.free_space().unwrap(), 59, "producer has seen head 5");
        set64(&v, OFF_HEAD, bad); // past tail (10), or backwards (< 5)
        assert!(is_corrupt(p.free_space()), "head {bad}");
        assert!(is_corrupt(p.write(&[0; 64])), "head {bad}");
        assert!(
            is_corrupt(p.wait_writable(64, &WaitPolicy::default(), Duration::from_secs(5))),
            "head {bad}"
        );
    }
}

#[test]
fn unknown_flag_bits_are_corrupt() {
    let v = ring(RingKind::Stream, 64, 0);
    let mut p = StreamProducer::attach(v.clone()).unwrap();
    let mut c = StreamConsumer::attach(v.clone()).unwrap();
    set32(&v, OFF_RFLAGS, 0x80);
    assert!(is_corrupt(p.write(b"x")));
    assert!(
        p.reader_closed(),
        "a reader with garbage flags counts as gone"
    );
    set32(&v, OFF_WFLAGS, 0x4);
    assert!(is_corrupt(c.is_eof()));
    assert!(is_corrupt(
        c.wait_readable(&WaitPolicy::default(), Duration::from_secs(5))
    ));
}

#[test]
fn garbage_in_wait_words_only_costs_a_wakeup() {
    let v = ring(RingKind::Stream, 64, 0);
    let mut p = StreamProducer::attach(v.clone()).unwrap();
    let mut c = StreamConsumer::attach(v.clone()).unwrap();
    for off in [OFF_PWAIT, OFF_PSEQ, OFF_CWAIT, OFF_CSEQ] {
        set32(&v, off, 0xffff_ffff);
    }
    assert_eq!(p.write(b"ok").unwrap(), 2);
    assert!(c
        .wait_readable(&WaitPolicy::default(), Duration::from_secs(5))
        .unwrap());
    assert!(!p
        .wait_writable(64, &WaitPolicy::default(), Duration::from_millis(5))
        .unwrap());
}

/// Publishes `hdr` (len, flags) at data offset `at` with the tail at `tail`.
fn record_case(
    at: u64,
    len: u32,
    flags: u32,
    head: u64,
    tail: u64,
) -> Result<Option<u64>, RingError> {
    let v = ring(RingKind::Record, 128, 0);
    set64(&v, OFF_HEAD, head);
    set64(&v, OFF_TAIL, head);
    let mut c = RecordConsumer::attach(v.clone()).unwrap();
    let mut h = len.to_le_bytes().to_vec();
    h.extend_from_slice(&flags.to_le_bytes());
    v.write(RING_HEADER_BYTES + at, &h).unwrap();
    set64(&v, OFF_TAIL, tail);
    let r = c.peek_len();
    let r2 = c.recv(&mut [0; 64]).map(|o| o.map(|i| i.len));
    assert_eq!(
        format!("{r:?}"),
        format!("{r2:?}"),
        "peek_len and recv agree"
    );
    r
}

#[test]
fn hostile_record_headers_are_corrupt() {
    assert_eq!(
        record_case(0, 8, 0, 0, 16).unwrap(),
        Some(8),
        "control: a valid record"
    );
    assert!(
        is_corrupt(record_case(0, u32::MAX, 0, 0, 64)),
        "len beyond the data"
    );
    assert!(
        is_corrupt(record_case(0, 100, 0, 0, 128)),
        "len > max_record (56)"
    );
    assert!(is_corrupt(record_case(0, 8, 0x10, 0, 16)), "unknown flags");
    assert!(
        is_corrupt(record_case(0, 8, 0, 0, 12)),
        "tail not 8-aligned"
    );
    assert!(
        is_corrupt(record_case(0, 8, 0, 0, 8)),
        "record longer than published"
    );
    assert!(
        is_corrupt(record_case(96, 8, 1, 96, 128)),
        "pad not ending at the ring end"
    );
    assert!(
        is_corrupt(record_case(0, 120, 1, 0, 128)),
        "pad at offset 0"
    );
    assert!(
        is_corrupt(record_case(112, 24, 0, 112, 160)),
        "record crossing the ring end"
    );
    assert_eq!(
        record_case(112, 8, 1, 112, 128).unwrap(),
        None,
        "control: lone valid pad then empty"
    );
}

#[test]
fn record_producer_rejects_hostile_head() {
    let v = ring(RingKind::Record, 64, 0);
    let mut p = RecordProducer::attach(v.clone()).unwrap();
    p.send(&[0; 24]).unwrap();
    p.send(&[0; 24]).unwrap();
    set64(&v, OFF_HEAD, 200);
    assert!(is_corrupt(p.send(b"x")));
}

#[test]
fn slot_tail_must_be_whole_slots() {
    let v = ring(RingKind::Slots, 64, 16);
    let mut c = SlotConsumer::attach(v.clone()).unwrap();
    set64(&v, OFF_TAIL, 8);
    assert!(is_corrupt(c.pop(&mut [0; 16])));
}
