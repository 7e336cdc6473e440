#![cfg(not(loom))]
mod common;
use common::{bytes, ring};
use memloop_ring::{
    init_ring, ring_bytes, RingError, RingKind, StreamConsumer, StreamProducer, WaitPolicy,
};
use memloop_shm::ShmSlice;
use std::io::{IoSlice, IoSliceMut};
use std::time::Duration;

fn pair(cap: u64) -> (StreamProducer, StreamConsumer) {
    let v = ring(RingKind::Stream, cap, 0);
    (
        StreamProducer::attach(v.clone()).unwrap(),
        StreamConsumer::attach(v).unwrap(),
    )
}

#[test]
fn write_then_read_round_trips() {
    let (mut p, mut c) = pair(64);
    assert_eq!(p.write(b"hello").unwrap(), 5);
    assert_eq!(c.available().unwrap(), 5);
    let mut buf = [0u8; 16];
    assert_eq!(c.read(&mut buf).unwrap(), 5);
    assert_eq!(&buf[..5], b"hello");
    assert_eq!(c.read(&mut buf).unwrap(), 0);
    assert!(!c.is_eof().unwrap());
    assert_eq!((p.total_written(), c.total_read()), (5, 5));
}

#[test]
fn skip_all_consumes_without_copying_and_frees_the_space() {
    let (mut p, mut c) = pair(64);
    assert_eq!(p.write(&bytes(60, 1)).unwrap(), 60);
    assert_eq!(c.skip_all().unwrap(), 60);
    assert_eq!(c.skip_all().unwrap(), 0);
    assert_eq!(p.free_space().unwrap(), 64);
    assert_eq!(p.write(b"after").unwrap(), 5); // wraps
    let mut buf = [0u8; 8];
    assert_eq!(c.read(&mut buf).unwrap(), 5);
    assert_eq!(&buf[..5], b"after");
    assert_eq!(c.total_read(), 65);
}

#[test]
fn exact_fill_then_full_then_drain() {
    let (mut p, mut c) = pair(64);
    let data = bytes(64, 1);
    assert_eq!(p.write(&data).unwrap(), 64);
    assert_eq!(p.free_space().unwrap(), 0);
    assert_eq!(p.write(b"x").unwrap(), 0, "full ring accepts nothing");
    let mut out = vec![0u8; 64];
    assert_eq!(c.read(&mut out).unwrap(), 64);
    assert_eq!(out, data);
    assert_eq!(p.free_space().unwrap(), 64);
}

#[test]
fn partial_write_when_short_of_space() {
    let (mut p, _c) = pair(64);
    assert_eq!(p.write(&bytes(50, 0)).unwrap(), 50);
    assert_eq!(p.write(&bytes(50, 0)).unwrap(), 14);
}

#[test]
fn wrap_around_keeps_bytes_in_order() {
    let (mut p, mut c) = pair(64);
    let mut expect = Vec::new();
    let mut got = Vec::new();
    for round in 0..50u8 {
        let chunk = bytes(23 + round as usize % 17, round);
        let n = p.write(&chunk).unwrap();
        expect.extend_from_slice(&chunk[..n]);
        let mut buf = [0u8; 29];
        let m = c.read(&mut buf).unwrap();
        got.extend_from_slice(&buf[..m]);
    }
    let mut rest = [0u8; 64];
    let m = c.read(&mut rest).unwrap();
    got.extend_from_slice(&rest[..m]);
    assert_eq!(got, expect);
    assert!(
        p.total_written() > 64 * 10,
        "indices went around many times"
    );
}

#[test]
fn vectored_io_publishes_once_and_splits() {
    let (mut p, mut c) = pair(64);
    p.write(&[0; 60]).unwrap();
    let mut sink = [0u8; 60];
    c.read(&mut sink).unwrap();
    let n = p
        .write_vectored(&[
            IoSlice::new(b"abc"),
            IoSlice::new(b""),
            IoSlice::new(b"defgh"),
        ])
        .unwrap();
    assert_eq!(n, 8);
    let (mut a, mut b) = ([0u8; 2], [0u8; 10]);
    let m = c
        .read_vectored(&mut [IoSliceMut::new(&mut a), IoSliceMut::new(&mut b)])
        .unwrap();
    assert_eq!(m, 8);
    assert_eq!(&a, b"ab");
    assert_eq!(&b[..6], b"cdefgh");
}

#[test]
fn vectored_write_truncates_at_free_space() {
    let (mut p, mut c) = pair(64);
    let n = p
        .write_vectored(&[IoSlice::new(&[1; 40]), IoSlice::new(&[2; 40])])
        .unwrap();
    assert_eq!(n, 64);
    let mut out = [0u8; 64];
    c.read(&mut out).unwrap();
    assert!(out[..40].iter().all(|&b| b == 1) && out[40..].iter().all(|&b| b == 2));
}

#[test]
fn peek_does_not_consume() {
    let (mut p, mut c) = pair(64);
    p.write(b"peekaboo").unwrap();
    let mut buf = [0u8; 4];
    assert_eq!(c.peek(&mut buf).unwrap(), 4);
    assert_eq!(&buf, b"peek");
    let mut all = [0u8; 8];
    assert_eq!(c.read(&mut all).unwrap(), 8);
    assert_eq!(&all, b"peekaboo");
}

#[test]
fn eof_only_after_drain() {
    let (mut p, mut c) = pair(64);
    p.write(b"bye").unwrap();
    p.shutdown();
    assert!(!c.is_eof().unwrap(), "data still pending");
    assert!(c
        .wait_readable(&WaitPolicy::default(), Duration::ZERO)
        .unwrap());
    let mut buf = [0u8; 8];
    assert_eq!(c.read(&mut buf).unwrap(), 3);
    assert!(c.is_eof().unwrap());
    assert!(
        c.wait_readable(&WaitPolicy::default(), Duration::from_secs(5))
            .unwrap(),
        "EOF is readable"
    );
}

#[test]
fn reader_close_gives_closed() {
    let (mut p, mut c) = pair(64);
    assert!(!p.reader_closed());
    c.close();
    assert!(p.reader_closed());
    assert!(matches!(p.write(b"x"), Err(RingError::Closed)));
    assert!(p
        .wait_writable(1, &WaitPolicy::default(), Duration::from_secs(5))
        .unwrap());
}

#[test]
fn waits_time_out_when_nothing_happens() {
    let (mut p, mut c) = pair(64);
    p.write(&[0; 64]).unwrap();
    let pol = WaitPolicy::default();
    assert!(!p.wait_writable(1, &pol, Duration::from_millis(5)).unwrap());
    let mut buf = [0u8; 64];
    c.read(&mut buf).unwrap();
    assert!(!c.wait_readable(&pol, Duration::from_millis(5)).unwrap());
    assert!(!c
        .wait_readable(&WaitPolicy::sleep_poll(), Duration::from_millis(5))
        .unwrap());
    assert!(
        p.wait_writable(1000, &pol, Duration::ZERO).unwrap(),
        "min clamps to capacity"
    );
}

#[test]
fn blocked_reader_is_woken_by_a_write() {
    for policy in [WaitPolicy::default(), WaitPolicy::sleep_poll()] {
        let (mut p, mut c) = pair(64);
        let t = std::thread::spawn(move || {
            let ok = c.wait_readable(&policy, Duration::from_secs(10)).unwrap();
            let mut b = [0u8; 1];
            (ok, c.read(&mut b).unwrap())
        });
        std::thread::sleep(Duration::from_millis(20));
        p.write(b"!").unwrap();
        assert_eq!(t.join().unwrap(), (true, 1));
    }
}

#[test]
fn init_and_attach_validate_geometry() {
    let v = ShmSlice::new_heap(ring_bytes(128) as usize);
    assert!(matches!(
        init_ring(&v, RingKind::Stream, 100, 0),
        Err(RingError::Config(_))
    ));
    assert!(matches!(
        init_ring(&v, RingKind::Stream, 32, 0),
        Err(RingError::Config(_))
    ));
    assert!(matches!(
        init_ring(&v, RingKind::Stream, 256, 0),
        Err(RingError::Config(_))
    ));
    assert!(matches!(
        init_ring(&v, RingKind::Stream, 64, 8),
        Err(RingError::Config(_))
    ));
    assert!(matches!(
        init_ring(&v, RingKind::Slots, 64, 24),
        Err(RingError::Config(_))
    ));
    assert!(
        matches!(
            StreamConsumer::attach(v.clone()),
            Err(RingError::BadHeader { .. })
        ),
        "uninitialised"
    );
    init_ring(&v, RingKind::Record, 128, 0).unwrap();
    assert!(
        matches!(
            StreamProducer::attach(v.clone()),
            Err(RingError::BadHeader { .. })
        ),
        "wrong kind"
    );
    init_ring(&v, RingKind::Stream, 128, 0).unwrap();
    assert!(matches!(
        StreamProducer::attach(v.slice(0, 300).unwrap()),
        Err(RingError::BadHeader { .. })
    ));
    assert_eq!(StreamProducer::attach(v).unwrap().capacity(), 128);
}

#[test]
fn probe_reports_levels_and_flags() {
    let view = ring(RingKind::Stream, 256, 0);
    let mut p = StreamProducer::attach(view.clone()).unwrap();
    let mut c = StreamConsumer::attach(view.clone()).unwrap();
    let pr = memloop_ring::header::probe(&view).unwrap();
    assert_eq!(
        (pr.used, pr.free(), pr.writer_shut, pr.reader_closed),
        (0, 256, false, false)
    );
    p.write(&[7; 100]).unwrap();
    assert_eq!(memloop_ring::header::probe(&view).unwrap().used, 100);
    p.shutdown();
    c.close();
    let pr = memloop_ring::header::probe(&view).unwrap();
    assert!(pr.writer_shut && pr.reader_closed);
    // A capacity word changed after attach (a buggy peer) is corruption for a reader that
    // attached with the validated one.
    let cap = memloop_ring::header::probe_attached(&view, 256)
        .unwrap()
        .capacity;
    assert_eq!(cap, 256);
    let cap_word = view.u64_at(memloop_ring::header::OFF_CAP).unwrap();
    cap_word.store(1 << 20, std::sync::atomic::Ordering::Relaxed);
    assert!(memloop_ring::header::probe_attached(&view, 256).is_none());
    cap_word.store(256, std::sync::atomic::Ordering::Relaxed);
    // A tail beyond head + capacity is corruption: no probe.
    view.u64_at(0)
        .unwrap()
        .store(10_000, std::sync::atomic::Ordering::Relaxed);
    assert!(memloop_ring::header::probe(&view).is_none());
}
