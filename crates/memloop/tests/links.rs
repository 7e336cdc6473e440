//! Link sessions (`memloop::link`) without a TUN device: each side's "device" is one end of a
//! SOCK_SEQPACKET pair, which keeps frame boundaries as a TUN device does. Frames cross in
//! order and intact; malformed ones are dropped and counted; a full ring drops; a killed side
//! ends the session and a new one takes its place — also when the dead side held the name.

mod common;
use common::TestRegion;
use memloop::link::{LinkRx, LinkTx, Linker, Pumped, MAX_FRAME, VNET_HDR_LEN};
use memloop::{Error, Node, Region, RegionSpec};
use rustix::net::{socketpair, AddressFamily, SocketFlags, SocketType};
use std::os::fd::{AsFd, OwnedFd};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

const ROLE: &str = "MEMLOOP_CHILD_ROLE";

fn main() -> std::process::ExitCode {
    if let Ok(role) = std::env::var(ROLE) {
        child_entry(&role);
    }
    use memloop_testkit::test;
    memloop_testkit::run(vec![
        test!(frames_cross_both_ways_in_order_and_intact),
        test!(malformed_frames_are_dropped_and_counted_and_the_rest_delivered),
        test!(a_full_ring_drops_after_a_grace_and_says_so),
        test!(a_killed_listening_side_is_replaced_and_the_survivor_takes_the_name),
        test!(a_killed_offering_side_is_replaced_by_a_new_process),
    ])
}

/// A device end (non-blocking, as the service's TUN device) and the program's end.
fn device() -> (OwnedFd, OwnedFd) {
    let (dev, app) = socketpair(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )
    .unwrap();
    rustix::io::ioctl_fionbio(&dev, true).unwrap();
    for fd in [&dev, &app] {
        rustix::net::sockopt::set_socket_send_buffer_size(fd, 4 << 20).unwrap();
        rustix::net::sockopt::set_socket_recv_buffer_size(fd, 4 << 20).unwrap();
    }
    (dev, app)
}

/// A valid frame: a zero virtio-net header and an IPv4 packet of `ip_len` bytes whose
/// payload is `seq`-derived.
fn frame(seq: u32, ip_len: usize) -> Vec<u8> {
    let mut f = vec![0u8; VNET_HDR_LEN + ip_len];
    f[VNET_HDR_LEN] = 0x45;
    f[VNET_HDR_LEN + 2..VNET_HDR_LEN + 4].copy_from_slice(&(ip_len as u16).to_be_bytes());
    for (i, b) in f[VNET_HDR_LEN + 20..].iter_mut().enumerate() {
        *b = (seq as usize).wrapping_mul(31).wrapping_add(i) as u8;
    }
    f[VNET_HDR_LEN + 20..VNET_HDR_LEN + 24].copy_from_slice(&seq.to_le_bytes());
    f
}

fn send_frame(app: &OwnedFd, f: &[u8]) {
    assert_eq!(rustix::io::write(app, f).unwrap(), f.len());
}

fn recv_frame(app: &OwnedFd, deadline: Instant) -> Vec<u8> {
    let mut buf = vec![0u8; MAX_FRAME + 16];
    loop {
        let n = rustix::net::recv(app, &mut buf[..], rustix::net::RecvFlags::DONTWAIT);
        match n {
            Ok((n, _)) => {
                buf.truncate(n);
                return buf;
            }
            Err(rustix::io::Errno::AGAIN) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_micros(200))
            }
            Err(e) => panic!("no frame came: {e}"),
        }
    }
}

/// Both sides of a link between two members of one region, established concurrently.
fn pair(a: &Node, b: &Node, link: &str, ring: u64) -> ((LinkTx, LinkRx), (LinkTx, LinkRx)) {
    std::thread::scope(|s| {
        let ja = s.spawn(|| establish(a, link, ring));
        let jb = s.spawn(|| establish(b, link, ring));
        (ja.join().unwrap(), jb.join().unwrap())
    })
}

fn establish(n: &Node, link: &str, ring: u64) -> (LinkTx, LinkRx) {
    let mut l = Linker::new(n, link, ring);
    l.establish(Duration::from_secs(10))
        .unwrap()
        .expect("the other side came")
}

/// Pumps everything the device `dev` holds into the ring.
fn pump_all(tx: &mut LinkTx, dev: &OwnedFd) -> (u64, u64) {
    let mut scratch = vec![0u8; MAX_FRAME];
    let (mut sent, mut dropped) = (0, 0);
    loop {
        match tx.pump_from_fd(dev.as_fd(), &mut scratch).unwrap() {
            Pumped::Sent(_) => sent += 1,
            Pumped::Dropped(_) => dropped += 1,
            Pumped::Idle => return (sent, dropped),
        }
    }
}

fn frames_cross_both_ways_in_order_and_intact() {
    let r = TestRegion::new("link-order", 64 << 20);
    let (a, b) = (r.node("a"), r.node("b"));
    let ((mut atx, mut arx), (mut btx, mut brx)) = pair(&a, &b, "order", 1 << 20);
    let (adev, aapp) = device();
    let (bdev, bapp) = device();
    let sizes = [24usize, 25, 1500, 9000, 65535, 40, 4096];
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut seq = 0u32;
    for round in 0..40 {
        let batch: Vec<Vec<u8>> = (0..7)
            .map(|i| {
                seq += 1;
                frame(seq, sizes[(i + round) % sizes.len()])
            })
            .collect();
        // a → b, then b → a
        for (tx, dev, app, rx, rdev, rapp) in [
            (&mut atx, &adev, &aapp, &mut brx, &bdev, &bapp),
            (&mut btx, &bdev, &bapp, &mut arx, &adev, &aapp),
        ] {
            for f in &batch {
                send_frame(app, f);
            }
            let (sent, dropped) = pump_all(tx, dev);
            assert_eq!((sent, dropped), (batch.len() as u64, 0));
            let mut got = 0;
            while got < batch.len() as u64 {
                assert!(rx.wait(Duration::from_secs(5)).unwrap(), "frames wait");
                let d = rx.drain_to_fd(rdev.as_fd()).unwrap();
                assert_eq!(d.bad, 0);
                got += d.packets;
            }
            for f in &batch {
                assert!(
                    recv_frame(rapp, deadline) == *f,
                    "frame altered or reordered"
                );
            }
        }
    }
}

fn malformed_frames_are_dropped_and_counted_and_the_rest_delivered() {
    let r = TestRegion::new("link-bad", 64 << 20);
    let (a, b) = (r.node("a"), r.node("b"));
    let ((mut atx, _arx), (_btx, mut brx)) = pair(&a, &b, "bad", 1 << 20);
    let (adev, aapp) = device();
    let (bdev, bapp) = device();
    let mut bad_flags = frame(2, 100);
    bad_flags[0] = 0x40;
    let mut bad_len = frame(3, 100);
    bad_len[VNET_HDR_LEN + 2..VNET_HDR_LEN + 4].copy_from_slice(&5000u16.to_be_bytes());
    let frames = [
        frame(1, 100),
        bad_flags,
        vec![0xffu8; 7],
        bad_len,
        vec![0x60u8; 30],
        frame(4, 200),
    ];
    for f in &frames {
        send_frame(&aapp, f);
    }
    assert_eq!(pump_all(&mut atx, &adev), (frames.len() as u64, 0));
    let (mut good, mut bad) = (0, 0);
    while good + bad < frames.len() as u64 {
        assert!(brx.wait(Duration::from_secs(5)).unwrap());
        let d = brx.drain_to_fd(bdev.as_fd()).unwrap();
        good += d.packets;
        bad += d.bad;
    }
    assert_eq!((good, bad), (2, 4));
    let deadline = Instant::now() + Duration::from_secs(5);
    assert!(recv_frame(&bapp, deadline) == frames[0]);
    assert!(recv_frame(&bapp, deadline) == frames[5]);
}

fn a_full_ring_drops_after_a_grace_and_says_so() {
    let r = TestRegion::new("link-full", 64 << 20);
    let (a, b) = (r.node("a"), r.node("b"));
    // 256 KiB per direction: room for one largest frame at a time.
    let ((mut atx, _arx), (_btx, _brx)) = pair(&a, &b, "full", 256 << 10);
    let (adev, aapp) = device();
    for i in 0..8 {
        send_frame(&aapp, &frame(i, 60000));
    }
    let started = Instant::now();
    let (sent, dropped) = pump_all(&mut atx, &adev);
    assert!(sent >= 1, "what fits is sent");
    assert_eq!(sent + dropped, 8, "nothing stays behind in the device");
    assert!(dropped >= 4, "a ring nobody reads drops ({sent} sent)");
    assert!(
        started.elapsed() >= memloop::link::FULL_RING_GRACE,
        "each drop waited for the grace first"
    );
}

fn child_entry(role: &str) -> ! {
    let region = Region::open(&RegionSpec::from_env()).expect("open region");
    let node = Node::join(region, "link-child").expect("join");
    let (mut tx, mut rx) = establish(&node, "kill", 1 << 20);
    // An echo: every frame comes back (the parent checks one round trip, then kills us).
    let (dev, app) = device();
    let mut buf = vec![0u8; MAX_FRAME];
    assert_eq!(role, "echo");
    loop {
        if rx.wait(Duration::from_millis(100)).unwrap_or(false) {
            rx.drain_to_fd(dev.as_fd()).unwrap();
        }
        while let Ok((n, _)) =
            rustix::net::recv(&app, &mut buf[..], rustix::net::RecvFlags::DONTWAIT)
        {
            send_frame(&app, &buf[..n]);
        }
        pump_all(&mut tx, &dev);
    }
}

fn spawn_echo(region: &TestRegion) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .env(ROLE, "echo")
        .env("MEMLOOP_REGION", &region.name)
        .spawn()
        .expect("spawn child")
}

/// One frame there and back through the child.
fn round_trip(tx: &mut LinkTx, rx: &mut LinkRx, seq: u32) {
    let (dev, app) = device();
    let f = frame(seq, 1000);
    send_frame(&app, &f);
    assert_eq!(pump_all(tx, &dev), (1, 0));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !rx.wait(Duration::from_millis(100)).unwrap() {
        assert!(Instant::now() < deadline, "no echo");
    }
    assert_eq!(rx.drain_to_fd(dev.as_fd()).unwrap().packets, 1);
    assert!(recv_frame(&app, deadline) == f);
}

/// Waits for the session to end because the peer died: `PeerDead` (or a closed ring).
fn wait_for_death(rx: &mut LinkRx) -> Duration {
    let started = Instant::now();
    loop {
        match rx.wait(Duration::from_millis(100)) {
            Ok(_) => assert!(
                started.elapsed() < Duration::from_secs(10),
                "peer death unnoticed"
            ),
            Err(Error::PeerDead | Error::BrokenPipe) => return started.elapsed(),
            Err(e) => panic!("unexpected: {e}"),
        }
    }
}

fn kill_and_replace(child_first: bool) {
    let r = TestRegion::new(if child_first { "link-kl" } else { "link-ko" }, 64 << 20);
    let me = r.node("parent");
    let mut linker = Linker::new(&me, "kill", 1 << 20);
    let mut child = spawn_echo(&r);
    if child_first {
        // Let the child take the name: we offer, it listens.
        std::thread::sleep(Duration::from_millis(300));
    }
    let (mut tx, mut rx) = linker
        .establish(Duration::from_secs(10))
        .unwrap()
        .expect("child came");
    assert_eq!(linker.listening(), !child_first);
    round_trip(&mut tx, &mut rx, 1);
    child.kill().unwrap();
    child.wait().unwrap();
    let noticed = wait_for_death(&mut rx);
    assert!(
        noticed < Duration::from_secs(3),
        "noticed after {noticed:?}"
    );
    drop((tx, rx));
    let mut child = spawn_echo(&r);
    let (mut tx, mut rx) = linker
        .establish(Duration::from_secs(10))
        .unwrap()
        .expect("the new child came");
    assert!(linker.listening(), "the survivor holds the name now");
    round_trip(&mut tx, &mut rx, 2);
    child.kill().unwrap();
    child.wait().unwrap();
}

fn a_killed_listening_side_is_replaced_and_the_survivor_takes_the_name() {
    kill_and_replace(true);
}

fn a_killed_offering_side_is_replaced_by_a_new_process() {
    kill_and_replace(false);
}
