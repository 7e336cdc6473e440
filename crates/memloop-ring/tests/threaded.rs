#![cfg(not(loom))]
//! Real threads over a heap ring with blocking waits: ~100 MB, checksummed.
mod common;
use common::ring;
use memloop_ring::*;
use std::time::Duration;

const TOTAL: u64 = 100 << 20;
const LONG: Duration = Duration::from_secs(30);

fn pattern(pos: u64) -> u8 {
    (pos ^ (pos >> 8) ^ (pos >> 17)).wrapping_mul(0x9d) as u8
}

fn checksum(h: u64, pos: u64, b: &[u8]) -> u64 {
    b.iter().enumerate().fold(h, |h, (i, &x)| {
        assert_eq!(
            x,
            pattern(pos + i as u64),
            "byte {} corrupted",
            pos + i as u64
        );
        h.rotate_left(5) ^ x as u64
    })
}

#[test]
fn stream_100mb_between_threads() {
    let v = ring(RingKind::Stream, 64 << 10, 0);
    let mut p = StreamProducer::attach(v.clone()).unwrap();
    let mut c = StreamConsumer::attach(v).unwrap();
    let writer = std::thread::spawn(move || {
        let policy = WaitPolicy::default();
        let (mut pos, mut h, mut buf) = (0u64, 0u64, vec![0u8; 48_000]);
        while pos < TOTAL {
            let n = (buf.len() as u64).min(TOTAL - pos) as usize;
            buf[..n]
                .iter_mut()
                .enumerate()
                .for_each(|(i, b)| *b = pattern(pos + i as u64));
            let mut off = 0;
            while off < n {
                assert!(p.wait_writable(1, &policy, LONG).unwrap(), "writer stalled");
                off += p.write(&buf[off..n]).unwrap();
            }
            h = checksum(h, pos, &buf[..n]);
            pos += n as u64;
        }
        p.shutdown();
        h
    });
    let policy = WaitPolicy::default();
    let (mut pos, mut h, mut buf) = (0u64, 0u64, vec![0u8; 40_000]);
    loop {
        assert!(c.wait_readable(&policy, LONG).unwrap(), "reader stalled");
        let n = c.read(&mut buf).unwrap();
        if n == 0 && c.is_eof().unwrap() {
            break;
        }
        h = checksum(h, pos, &buf[..n]);
        pos += n as u64;
    }
    assert_eq!(pos, TOTAL);
    assert_eq!(h, writer.join().unwrap());
}

#[test]
fn records_between_threads_with_sleep_poll() {
    let v = ring(RingKind::Record, 4096, 0);
    let mut p = RecordProducer::attach(v.clone()).unwrap();
    let mut c = RecordConsumer::attach(v).unwrap();
    const N: u32 = 20_000;
    let writer = std::thread::spawn(move || {
        let policy = WaitPolicy::sleep_poll();
        for i in 0..N {
            let len = (i as usize * 13) % 2000;
            let rec: Vec<u8> = (0..len).map(|k| (i as usize + k) as u8).collect();
            while !p.send_parts(&[&i.to_le_bytes(), &rec]).unwrap() {
                assert!(p.wait_writable(4 + len as u64, &policy, LONG).unwrap());
            }
        }
        p.shutdown();
    });
    let policy = WaitPolicy::default();
    let mut buf = vec![0u8; 4096];
    let mut next = 0u32;
    while !c.is_eof().unwrap() {
        let Some(info) = c.recv(&mut buf).unwrap() else {
            c.wait_readable(&policy, LONG).unwrap();
            continue;
        };
        let i = u32::from_le_bytes(buf[..4].try_into().unwrap());
        assert_eq!(i, next);
        assert_eq!(info.len as usize, 4 + (i as usize * 13) % 2000);
        assert!(buf[4..info.copied]
            .iter()
            .enumerate()
            .all(|(k, &b)| b == (i as usize + k) as u8));
        next += 1;
    }
    assert_eq!(next, N);
    writer.join().unwrap();
}

#[test]
fn slots_between_threads_in_batches() {
    let v = ring(RingKind::Slots, 1024, 32);
    let mut p = SlotProducer::attach(v.clone()).unwrap();
    let mut c = SlotConsumer::attach(v).unwrap();
    const N: u64 = 200_000;
    let writer = std::thread::spawn(move || {
        let policy = WaitPolicy::default();
        let mut i = 0u64;
        while i < N {
            let batch: Vec<[u8; 32]> = (i..(i + 7).min(N))
                .map(|k| {
                    Descriptor {
                        offset: k,
                        ..Default::default()
                    }
                    .encode()
                })
                .collect();
            let refs: Vec<&[u8]> = batch.iter().map(|b| &b[..]).collect();
            let n = p.push_batch(&refs).unwrap();
            if n == 0 {
                p.wait_writable(1, &policy, LONG).unwrap();
            }
            i += n as u64;
        }
        p.shutdown();
    });
    let policy = WaitPolicy::default();
    let (mut next, mut buf) = (0u64, [0u8; 32 * 5]);
    while !c.is_eof().unwrap() {
        let n = c.pop_batch(&mut buf).unwrap();
        if n == 0 {
            c.wait_readable(&policy, LONG).unwrap();
        }
        for s in buf[..n * 32].chunks(32) {
            assert_eq!(
                Descriptor::decode(s.try_into().unwrap()).unwrap().offset,
                next
            );
            next += 1;
        }
    }
    assert_eq!(next, N);
    writer.join().unwrap();
}
