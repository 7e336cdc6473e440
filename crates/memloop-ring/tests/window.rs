#![cfg(not(loom))]
//! The stream ring's window (`header` module text): grows under pressure, shrinks when idle,
//! and a storm of resizes between two threads moves every byte in order.
mod common;
use memloop_ring::*;
use memloop_shm::ShmSlice;
use std::time::Duration;

fn windowed(cap: u64, window: u64) -> ShmSlice {
    let v = ShmSlice::new_heap(ring_bytes(cap) as usize);
    init_ring_windowed(&v, RingKind::Stream, cap, 0, window).unwrap();
    v
}

fn pattern(pos: u64) -> u8 {
    (pos ^ (pos >> 7) ^ (pos >> 13)).wrapping_mul(0xb5) as u8
}

#[test]
fn a_write_that_does_not_fit_grows_the_window_as_tcp_would_buffer_it() {
    let v = windowed(4096, 64);
    let mut p = StreamProducer::attach(v.clone()).unwrap();
    let mut c = StreamConsumer::attach(v).unwrap();
    assert_eq!((p.capacity(), p.max_capacity()), (64, 4096));
    // Nobody reads: each write that does not fit grows the window (×4) and goes on.
    let data: Vec<u8> = (0..4096u32).map(|i| pattern(i as u64)).collect();
    let mut sent = 0;
    while sent < data.len() {
        let n = p.write(&data[sent..]).unwrap();
        assert!(n > 0, "stuck at {sent} with a window of {}", p.capacity());
        sent += n;
    }
    assert_eq!((p.capacity(), p.resizes()), (4096, (3, 0, 0)));
    assert_eq!(p.write(&[1]).unwrap(), 0, "full at the capacity");
    let mut got = vec![0u8; 4096];
    assert_eq!(c.read(&mut got).unwrap(), 4096);
    assert_eq!(got, data);
    assert!(p.resize(100).is_err() && p.resize(8192).is_err());
}

/// Bytes wrapped around the old window's end when it grows: copied past it, read in order
/// by a reader that took either mapping, and nothing written over the originals meanwhile.
#[test]
fn a_grow_over_wrapped_bytes_keeps_them_in_order() {
    let v = windowed(4096, 64);
    let mut p = StreamProducer::attach(v.clone()).unwrap();
    let mut c = StreamConsumer::attach(v).unwrap();
    let mut sink = [0u8; 64];
    assert_eq!(p.write(&[0; 60]).unwrap(), 60);
    assert_eq!(c.read(&mut sink).unwrap(), 60);
    // 20 bytes from offset 60: 4 before the end, 16 wrapped to the front.
    let first: Vec<u8> = (0..20u64).map(pattern).collect();
    assert_eq!(p.write(&first).unwrap(), 20);
    // The consumer looks now (the old mapping), reads 2 bytes, keeps the rest for later.
    let mut two = [0u8; 2];
    assert_eq!(c.read(&mut two).unwrap(), 2);
    let more: Vec<u8> = (20..300u64).map(pattern).collect();
    let mut sent = 0;
    while sent < more.len() {
        let n = p.write(&more[sent..]).unwrap();
        assert!(n > 0, "stuck at {sent} (window {})", p.capacity());
        sent += n;
    }
    assert!(p.capacity() >= 256);
    let mut got = two.to_vec();
    let mut buf = [0u8; 512];
    loop {
        let n = c.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        got.extend_from_slice(&buf[..n]);
    }
    let want: Vec<u8> = (0..300u64).map(pattern).collect();
    assert_eq!(got, want);
}

#[test]
fn an_idle_producer_shrinks_after_enough_looks() {
    let v = windowed(4096, 4096);
    let mut p = StreamProducer::attach(v.clone()).unwrap();
    let mut c = StreamConsumer::attach(v).unwrap();
    assert_eq!(p.write(&[1; 10]).unwrap(), 10);
    assert!(!p.shrink_if_idle(64, 2).unwrap(), "it just wrote");
    assert!(!p.shrink_if_idle(64, 2).unwrap(), "one idle look");
    assert!(!p.shrink_if_idle(64, 2).unwrap(), "idle, but not empty");
    let mut b = [0u8; 16];
    assert_eq!(c.read(&mut b).unwrap(), 10);
    assert!(p.shrink_if_idle(64, 2).unwrap());
    assert_eq!((p.capacity(), p.resizes()), (64, (0, 1, 0)));
    assert!(!p.shrink_if_idle(64, 2).unwrap(), "already there");
}

/// Both ends on their own threads; the producer asks for a random window before every write
/// (a larger one at once, copying wrapped bytes; a smaller one only when the ring is empty:
/// before a third of them it waits for that), besides the grows its writes make; the
/// consumer reads random amounts.
#[test]
fn a_resize_storm_loses_duplicates_and_reorders_nothing() {
    const TOTAL: u64 = 64 << 20;
    let v = windowed(64 << 10, 64);
    let mut p = StreamProducer::attach(v.clone()).unwrap();
    let mut c = StreamConsumer::attach(v).unwrap();
    let writer = std::thread::spawn(move || {
        let policy = WaitPolicy::default();
        let (mut pos, mut resizes, mut seed) = (0u64, 0u64, 0x9e37_79b9_7f4a_7c15u64);
        let mut buf = vec![0u8; 20_000];
        while pos < TOTAL {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            if seed % 3 == 0 {
                // Until the consumer has taken everything: a smaller window needs an empty ring.
                let all = p.capacity();
                assert!(p
                    .wait_writable(all, &policy, Duration::from_secs(30))
                    .unwrap());
            }
            resizes += p.resize(64 << (seed % 11)).unwrap() as u64;
            let n = ((seed >> 20) % buf.len() as u64 + 1).min(TOTAL - pos) as usize;
            for (i, b) in buf[..n].iter_mut().enumerate() {
                *b = pattern(pos + i as u64);
            }
            let mut off = 0;
            while off < n {
                let w = Duration::from_secs(30);
                assert!(p.wait_writable(1, &policy, w).unwrap(), "writer stalled");
                off += p.write(&buf[off..n]).unwrap();
            }
            pos += n as u64;
        }
        p.shutdown();
        (resizes, p)
    });
    let policy = WaitPolicy::default();
    let (mut pos, mut buf, mut k) = (0u64, vec![0u8; 30_000], 1u64);
    loop {
        assert!(c.wait_readable(&policy, Duration::from_secs(30)).unwrap());
        k = k
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let want = (k >> 40) as usize % buf.len() + 1;
        let n = c.read(&mut buf[..want]).unwrap();
        if n == 0 && c.is_eof().unwrap() {
            break;
        }
        for (i, &b) in buf[..n].iter().enumerate() {
            assert_eq!(b, pattern(pos + i as u64), "byte {}", pos + i as u64);
        }
        pos += n as u64;
    }
    let (asked, p) = writer.join().unwrap();
    let resizes = asked + p.resizes().0;
    assert_eq!(pos, TOTAL);
    assert!(
        resizes >= 1000,
        "only {resizes} resizes: the storm did not storm"
    );
    eprintln!("{resizes} window changes over {TOTAL} bytes");
}

/// The reader's quick look agrees with the full probe: bytes there and no shutdown only.
#[test]
fn has_unread_is_the_probe_while_bytes_wait_and_defers_to_it_otherwise() {
    let v = windowed(4096, 64);
    let mut p = StreamProducer::attach(v.clone()).unwrap();
    let mut c = StreamConsumer::attach(v.clone()).unwrap();
    let quick = || header::has_unread(&v, 4096);
    assert_eq!(quick(), None, "empty: the full probe decides");
    assert_eq!(p.write(&[7; 10]).unwrap(), 10);
    assert_eq!(quick(), Some(true));
    assert_eq!(header::probe_attached(&v, 4096).unwrap().used, 10);
    assert_eq!(
        header::has_unread(&v, 8),
        None,
        "more unread than a capacity: a full look"
    );
    let mut b = [0u8; 4];
    assert_eq!(c.read(&mut b).unwrap(), 4);
    assert_eq!(quick(), Some(true));
    p.shutdown();
    assert_eq!(quick(), None, "a shutdown: the full probe decides (FIN)");
}
