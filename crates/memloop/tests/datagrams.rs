//! Datagram sockets over shared memory (`memloop::datagram`): boundaries, per-peer order,
//! sender addresses, drops on a full receiver, closed and killed peers — between real
//! processes (this binary re-executed in a child role) and between sockets of one process.

mod common;
use common::TestRegion;
use memloop::datagram::{DropReason, Sent};
use memloop::{DatagramSocket, Error, Node, Region, RegionSpec};
use std::net::SocketAddr;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

const ROLE: &str = "MEMLOOP_CHILD_ROLE";

fn main() -> std::process::ExitCode {
    if let Ok(role) = std::env::var(ROLE) {
        child_entry(&role);
    }
    use memloop_testkit::test;
    memloop_testkit::run(vec![
        test!(datagrams_keep_boundaries_order_and_senders_between_processes),
        test!(a_full_receiver_drops_and_counts_and_the_sender_never_waits),
        test!(a_closed_receiver_drops_then_a_new_socket_at_the_address_gets_a_new_pair),
        test!(peek_truncation_and_next_length_behave_as_udp),
        test!(a_wildcard_sender_is_seen_at_its_route_address),
        test!(a_sleeping_receiver_is_woken_and_a_timeout_ends_its_wait),
        test!(a_killed_senders_datagrams_are_delivered_then_its_pair_goes),
        test!(datagrams_to_an_address_nobody_bound_are_refused_for_the_kernel_path),
        test!(a_retiring_receiver_hands_what_it_did_not_read_back_to_its_sender),
        test!(a_sender_in_another_process_gets_back_what_a_retiring_receiver_did_not_read),
        test!(a_closing_sender_withdraws_only_what_no_receiver_took),
        test!(the_receive_buffer_sizes_new_rings_and_bounds_the_queue),
    ])
}

fn child_entry(role: &str) -> ! {
    let region = Region::open(&RegionSpec::from_env()).expect("open region");
    let node = Node::join(region, "dgram-child").expect("join");
    let dst: SocketAddr = std::env::var("CHILD_DST").unwrap().parse().unwrap();
    let arg: u64 = std::env::var("CHILD_ARG").unwrap().parse().unwrap();
    let code = match role {
        "rr-client" => child_rr_client(&node, dst, arg),
        "blaster" => child_blaster(&node, dst),
        "hand-back-sender" => child_hand_back_sender(&node, dst, arg as u16),
        other => panic!("unknown role {other}"),
    };
    std::process::exit(code);
}

fn spawn_child(role: &str, region: &TestRegion, dst: SocketAddr, arg: u64) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .env(ROLE, role)
        .env("MEMLOOP_REGION", &region.name)
        .env("CHILD_DST", dst.to_string())
        .env("CHILD_ARG", arg.to_string())
        .spawn()
        .expect("spawn child")
}

fn wait_child(child: &mut Child, limit: Duration) -> Option<i32> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if let Some(st) = child.try_wait().unwrap() {
            return Some(st.code().unwrap_or(-1));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

/// Datagram `seq` of sender `id`: a header, then bytes that depend on both, of a length that
/// varies up to the largest UDP payload.
fn datagram(id: u64, seq: u64) -> Vec<u8> {
    let len = match seq % 7 {
        0 => 65_507,
        1 => 16,
        _ => 16 + ((seq * 7919 + id * 104_729) % 9000) as usize,
    };
    let mut v = vec![0u8; len];
    v[..8].copy_from_slice(&id.to_le_bytes());
    v[8..16].copy_from_slice(&seq.to_le_bytes());
    for (k, b) in v[16..].iter_mut().enumerate() {
        *b = (k as u64 ^ seq ^ (id << 3)) as u8;
    }
    v
}

/// Sends `count` datagrams to `dst`, each answered by an echo that must match.
fn child_rr_client(node: &Node, dst: SocketAddr, count: u64) -> i32 {
    let s = DatagramSocket::bind(node, "127.0.0.1:0".parse().unwrap()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20)));
    let id = u64::from(s.local_addr().port());
    let mut buf = vec![0u8; 65_536];
    for seq in 0..count {
        let d = datagram(id, seq);
        assert_eq!(s.send_to(&d, dst).unwrap(), Sent::Delivered);
        let (info, from) = s.recv_from(&mut buf).expect("echo");
        assert_eq!(from, dst, "the echo comes from the server's address");
        assert_eq!(&buf[..info.copied], &d[..], "echo {seq} of {id} intact");
    }
    0
}

/// Sends datagrams of 1 KiB as fast as it can until killed.
fn child_blaster(node: &Node, dst: SocketAddr) -> i32 {
    let s = DatagramSocket::bind(node, "127.0.0.1:0".parse().unwrap()).unwrap();
    let mut seq = 0u64;
    loop {
        let mut d = vec![0u8; 1024];
        d[..8].copy_from_slice(&seq.to_le_bytes());
        if s.send_to(&d, dst).unwrap() == Sent::Delivered {
            seq += 1;
        }
    }
}

/// Sends `one`, `two`, `three` to `dst` (then `sent` to port `done` of its host), and
/// waits until the last two come back unread.
fn child_hand_back_sender(node: &Node, dst: SocketAddr, done: u16) -> i32 {
    let s = DatagramSocket::bind(node, "127.0.0.1:0".parse().unwrap()).unwrap();
    for d in [&b"one"[..], b"two", b"three"] {
        assert_eq!(s.send_to(d, dst).unwrap(), Sent::Delivered);
    }
    let done = SocketAddr::new(dst.ip(), done);
    assert_eq!(s.send_to(b"sent", done).unwrap(), Sent::Delivered);
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut back = Vec::new();
    while back.len() < 2 && Instant::now() < deadline {
        let _ = s.wait_readable(Some(Duration::from_millis(50)));
        back.extend(s.take_returned());
    }
    let want = [(dst, b"two".to_vec()), (dst, b"three".to_vec())];
    i32::from(back != want)
}

fn datagrams_keep_boundaries_order_and_senders_between_processes() {
    let r = TestRegion::new("dgram-rr", 64 << 20);
    let node = r.node("server");
    let srv = DatagramSocket::bind(&node, "127.0.0.1:0".parse().unwrap()).unwrap();
    srv.set_read_timeout(Some(Duration::from_secs(20)));
    let (clients, count) = (3u64, 300u64);
    let mut kids: Vec<Child> = (0..clients)
        .map(|_| spawn_child("rr-client", &r, srv.local_addr(), count))
        .collect();
    let mut next = std::collections::HashMap::new();
    let mut buf = vec![0u8; 65_536];
    for _ in 0..clients * count {
        let (info, from) = srv.recv_from(&mut buf).expect("a datagram");
        assert_eq!(info.copied as u64, info.len, "nothing truncated");
        let id = u64::from_le_bytes(buf[..8].try_into().unwrap());
        let seq = u64::from_le_bytes(buf[8..16].try_into().unwrap());
        assert_eq!(u64::from(from.port()), id, "the sender's own address");
        let want = next.entry(id).or_insert(0u64);
        assert_eq!(seq, *want, "datagrams of one sender arrive in order");
        *want += 1;
        assert_eq!(&buf[..info.copied], &datagram(id, seq)[..], "contents");
        assert_eq!(
            srv.send_to(&buf[..info.copied], from).unwrap(),
            Sent::Delivered
        );
    }
    for k in kids.iter_mut() {
        assert_eq!(wait_child(k, Duration::from_secs(30)), Some(0));
    }
    assert_eq!(next.len() as u64, clients);
    assert_eq!(srv.dropped(), 0);
}

fn a_full_receiver_drops_and_counts_and_the_sender_never_waits() {
    let r = TestRegion::new("dgram-full", 64 << 20);
    let node = r.node("one");
    let rx = DatagramSocket::bind(&node, "127.0.0.1:0".parse().unwrap()).unwrap();
    let tx = DatagramSocket::bind(&node, "127.0.0.1:0".parse().unwrap()).unwrap();
    let mut delivered = 0u64;
    for seq in 0..5_000u64 {
        let mut d = vec![0u8; 1024];
        d[..8].copy_from_slice(&seq.to_le_bytes());
        match tx.send_to(&d, rx.local_addr()).unwrap() {
            Sent::Delivered => {
                assert_eq!(seq, delivered, "no datagram is delivered after a drop");
                delivered += 1;
            }
            Sent::Dropped(why) => assert_eq!(why, DropReason::Full),
        }
    }
    assert!(delivered > 0 && delivered < 5_000, "{delivered}");
    assert_eq!(tx.dropped(), 5_000 - delivered);
    // The receiver's endpoint counts them too (`memloop status` shows it per socket), in
    // batches of 64 while the flood lasts, all of them once a datagram goes through again.
    let at_rx = node
        .region()
        .registry()
        .endpoint_dropped(rx.endpoint())
        .unwrap();
    let counted = || u64::from(at_rx.load(std::sync::atomic::Ordering::Relaxed));
    assert!((5_000 - delivered).saturating_sub(64) <= counted() && counted() <= 5_000 - delivered);
    rx.set_nonblocking(true);
    let mut buf = [0u8; 2048];
    for seq in 0..delivered {
        let (info, from) = rx.recv_from(&mut buf).unwrap();
        assert_eq!((info.len, from), (1024, tx.local_addr()));
        assert_eq!(u64::from_le_bytes(buf[..8].try_into().unwrap()), seq);
    }
    assert!(matches!(rx.recv_from(&mut buf), Err(Error::WouldBlock)));
    // Room again: the next one goes through (and the last drops are counted).
    assert_eq!(
        tx.send_to(b"again", rx.local_addr()).unwrap(),
        Sent::Delivered
    );
    assert_eq!(counted(), 5_000 - delivered);
}

fn a_closed_receiver_drops_then_a_new_socket_at_the_address_gets_a_new_pair() {
    let r = TestRegion::new("dgram-closed", 64 << 20);
    let node = r.node("one");
    let tx = DatagramSocket::bind(&node, "127.0.0.1:0".parse().unwrap()).unwrap();
    let rx = DatagramSocket::bind(&node, "127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = rx.local_addr();
    assert_eq!(tx.send_to(b"one", addr).unwrap(), Sent::Delivered);
    drop(rx);
    assert_eq!(
        tx.send_to(b"two", addr).unwrap(),
        Sent::Dropped(DropReason::Closed)
    );
    assert_eq!(tx.pairs(), 0, "the dead pair is released");
    assert!(matches!(
        tx.send_to(b"three", addr),
        Err(Error::NoService(_))
    ));
    let rx = DatagramSocket::bind(&node, addr).unwrap();
    assert_eq!(tx.send_to(b"four", addr).unwrap(), Sent::Delivered);
    let mut buf = [0u8; 16];
    rx.set_nonblocking(true);
    let (info, _) = rx.recv_from(&mut buf).unwrap();
    assert_eq!(&buf[..info.copied], b"four", "nothing of the old socket's");
}

fn peek_truncation_and_next_length_behave_as_udp() {
    let r = TestRegion::new("dgram-peek", 64 << 20);
    let node = r.node("one");
    let rx = DatagramSocket::bind(&node, "127.0.0.1:0".parse().unwrap()).unwrap();
    let tx = DatagramSocket::bind(&node, "127.0.0.1:0".parse().unwrap()).unwrap();
    assert_eq!(rx.next_len().unwrap(), None);
    tx.send_to(b"hello world", rx.local_addr()).unwrap();
    tx.send_to(b"", rx.local_addr()).unwrap();
    assert_eq!(rx.next_len().unwrap(), Some(11));
    let mut small = [0u8; 5];
    let (info, from) = rx.try_recv(&mut small, true).unwrap().unwrap();
    assert_eq!((info.len, info.copied, from), (11, 5, tx.local_addr()));
    let (info, _) = rx.try_recv(&mut small, false).unwrap().unwrap();
    assert_eq!((info.len, info.copied, &small), (11, 5, b"hello"));
    // The rest of a truncated datagram is gone; an empty datagram is a datagram.
    let (info, _) = rx.try_recv(&mut small, false).unwrap().unwrap();
    assert_eq!((info.len, info.copied), (0, 0));
    assert!(rx.try_recv(&mut small, false).unwrap().is_none());
}

fn a_wildcard_sender_is_seen_at_its_route_address() {
    let r = TestRegion::new("dgram-wild", 64 << 20);
    let node = r.node("one");
    let rx = DatagramSocket::bind(&node, "0.0.0.0:0".parse().unwrap()).unwrap();
    let tx = DatagramSocket::bind(&node, "0.0.0.0:0".parse().unwrap()).unwrap();
    let dst: SocketAddr = format!("127.0.0.1:{}", rx.local_addr().port())
        .parse()
        .unwrap();
    assert_eq!(tx.send_to(b"x", dst).unwrap(), Sent::Delivered);
    let mut buf = [0u8; 4];
    let (_, from) = rx.try_recv(&mut buf, false).unwrap().unwrap();
    let want: SocketAddr = format!("127.0.0.1:{}", tx.local_addr().port())
        .parse()
        .unwrap();
    assert_eq!(from, want);
    // The reply finds the wildcard-bound sender on the same pair.
    assert_eq!(rx.send_to(b"y", from).unwrap(), Sent::Delivered);
    assert!(tx.try_recv(&mut buf, false).unwrap().is_some());
    assert_eq!((rx.pairs(), tx.pairs()), (1, 1));
}

fn a_sleeping_receiver_is_woken_and_a_timeout_ends_its_wait() {
    let r = TestRegion::new("dgram-sleep", 64 << 20);
    let node = r.node("one");
    let rx = DatagramSocket::bind(&node, "127.0.0.1:0".parse().unwrap()).unwrap();
    let tx = DatagramSocket::bind(&node, "127.0.0.1:0".parse().unwrap()).unwrap();
    rx.set_read_timeout(Some(Duration::from_millis(50)));
    let mut buf = [0u8; 8];
    assert!(matches!(rx.recv_from(&mut buf), Err(Error::TimedOut)));
    rx.set_read_timeout(None);
    let dst = rx.local_addr();
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(300));
            tx.send_to(b"wake", dst).unwrap();
        });
        let t = Instant::now();
        let (info, _) = rx.recv_from(&mut buf).unwrap();
        assert_eq!(&buf[..info.copied], b"wake");
        assert!(t.elapsed() >= Duration::from_millis(250));
    });
}

fn a_killed_senders_datagrams_are_delivered_then_its_pair_goes() {
    let r = TestRegion::new("dgram-kill", 64 << 20);
    let node = r.node("server");
    let rx = DatagramSocket::bind(&node, "127.0.0.1:0".parse().unwrap()).unwrap();
    let mut kid = spawn_child("blaster", &r, rx.local_addr(), 0);
    let mut buf = [0u8; 2048];
    rx.set_read_timeout(Some(Duration::from_secs(20)));
    let mut expect = 0u64;
    for _ in 0..2_000 {
        rx.recv_from(&mut buf).expect("the blaster's datagrams");
        expect += 1;
    }
    kid.kill().unwrap();
    kid.wait().unwrap();
    // What it published before it died is still read; then nothing, and the pair goes.
    rx.set_nonblocking(true);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match rx.recv_from(&mut buf) {
            Ok(_) => expect += 1,
            Err(Error::WouldBlock) if rx.pairs() == 0 => break,
            Err(Error::WouldBlock) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => panic!("{e}"),
        }
        assert!(Instant::now() < deadline, "the dead sender's pair stayed");
    }
    assert!(expect >= 2_000);
}

fn datagrams_to_an_address_nobody_bound_are_refused_for_the_kernel_path() {
    let r = TestRegion::new("dgram-none", 64 << 20);
    let node = r.node("one");
    let tx = DatagramSocket::bind(&node, "127.0.0.1:0".parse().unwrap()).unwrap();
    // A kernel socket that is no member: the datagram is not ours to carry.
    let kernel = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    assert!(matches!(
        tx.send_to(b"x", kernel.local_addr().unwrap()),
        Err(Error::NoService(_))
    ));
    assert_eq!(tx.pairs(), 0);
}

fn a_retiring_receiver_hands_what_it_did_not_read_back_to_its_sender() {
    let r = TestRegion::new("dgram-handback", 64 << 20);
    let node = r.node("one");
    let tx = DatagramSocket::bind(&node, "127.0.0.1:0".parse().unwrap()).unwrap();
    let rx = DatagramSocket::bind(&node, "127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = rx.local_addr();
    for d in [&b"one"[..], b"two", b"three"] {
        assert_eq!(tx.send_to(d, addr).unwrap(), Sent::Delivered);
    }
    let mut buf = [0u8; 16];
    let (info, _) = rx.try_recv(&mut buf, false).unwrap().unwrap();
    assert_eq!(&buf[..info.copied], b"one");
    assert_eq!(
        rx.send_to(b"reply", tx.local_addr()).unwrap(),
        Sent::Delivered
    );
    // A datagram to a socket that has not taken the new pair yet goes with the retirement too:
    // withdrawn, for the caller to send by the kernel.
    let other = DatagramSocket::bind(&node, "127.0.0.1:0".parse().unwrap()).unwrap();
    assert_eq!(
        rx.send_to(b"untaken", other.local_addr()).unwrap(),
        Sent::Delivered
    );
    rx.retire();
    assert_eq!(
        rx.take_returned(),
        [(other.local_addr(), b"untaken".to_vec())]
    );
    assert_eq!(
        tx.take_returned(),
        [(addr, b"two".to_vec()), (addr, b"three".to_vec())],
        "exactly what it did not read, in order"
    );
    assert!(tx.take_returned().is_empty(), "once");
    // What the retired socket sent before it left is still ours to read.
    let (info, from) = tx.try_recv(&mut buf, false).unwrap().unwrap();
    assert_eq!((&buf[..info.copied], from), (&b"reply"[..], addr));
    assert!(matches!(
        tx.send_to(b"four", addr),
        Err(Error::NoService(_))
    ));
    assert!(rx.is_wake(&memloop::datagram::wake_payload(
        memloop::registry::ChannelId { idx: 1, gen: 1 }
    )));
}

fn a_sender_in_another_process_gets_back_what_a_retiring_receiver_did_not_read() {
    let r = TestRegion::new("dgram-handback-x", 64 << 20);
    let node = r.node("server");
    let rx = DatagramSocket::bind(&node, "127.0.0.1:0".parse().unwrap()).unwrap();
    let done = DatagramSocket::bind(&node, "127.0.0.1:0".parse().unwrap()).unwrap();
    rx.set_read_timeout(Some(Duration::from_secs(20)));
    done.set_read_timeout(Some(Duration::from_secs(20)));
    let port = u64::from(done.local_addr().port());
    let mut kid = spawn_child("hand-back-sender", &r, rx.local_addr(), port);
    let mut buf = [0u8; 16];
    let (info, _) = rx.recv_from(&mut buf).unwrap();
    assert_eq!(&buf[..info.copied], b"one");
    done.recv_from(&mut buf).expect("all three sent");
    rx.retire();
    assert_eq!(wait_child(&mut kid, Duration::from_secs(30)), Some(0));
}

fn a_closing_sender_withdraws_only_what_no_receiver_took() {
    let r = TestRegion::new("dgram-withdraw", 64 << 20);
    let node = r.node("one");
    let tx = DatagramSocket::bind(&node, "127.0.0.1:0".parse().unwrap()).unwrap();
    let untaken = DatagramSocket::bind(&node, "127.0.0.1:0".parse().unwrap()).unwrap();
    let taken = DatagramSocket::bind(&node, "127.0.0.1:0".parse().unwrap()).unwrap();
    let (ua, ta) = (untaken.local_addr(), taken.local_addr());
    tx.send_to(b"a", ua).unwrap();
    tx.send_to(b"b", ua).unwrap();
    tx.send_to(b"c", ta).unwrap();
    let mut buf = [0u8; 8];
    let (info, _) = taken.try_recv(&mut buf, false).unwrap().unwrap();
    assert_eq!(&buf[..info.copied], b"c");
    tx.send_to(b"d", ta).unwrap();
    assert_eq!(
        tx.withdraw_untaken(),
        [(ua, b"a".to_vec()), (ua, b"b".to_vec())]
    );
    assert!(
        untaken.try_recv(&mut buf, false).unwrap().is_none(),
        "the offer is gone"
    );
    drop(tx);
    let (info, _) = taken.try_recv(&mut buf, false).unwrap().unwrap();
    assert_eq!(
        &buf[..info.copied],
        b"d",
        "a taken pair keeps its datagrams"
    );
}

fn the_receive_buffer_sizes_new_rings_and_bounds_the_queue() {
    let r = TestRegion::new("dgram-rcvbuf", 64 << 20);
    let node = r.node("one");
    let tx = DatagramSocket::bind(&node, "127.0.0.1:0".parse().unwrap()).unwrap();
    let small = DatagramSocket::bind(&node, "127.0.0.1:0".parse().unwrap()).unwrap();
    let big = DatagramSocket::bind(&node, "127.0.0.1:0".parse().unwrap()).unwrap();
    small.set_recv_buffer(4096);
    big.set_recv_buffer(4 << 20);
    let d = [7u8; 1000];
    let sent = |to| {
        (0..3000)
            .filter(|_| tx.send_to(&d, to).unwrap() == Sent::Delivered)
            .count()
    };
    assert_eq!(
        sent(small.local_addr()),
        4,
        "1008-byte records within 4096 bytes"
    );
    assert_eq!(
        sent(big.local_addr()),
        3000,
        "a 4 MiB ring: nothing dropped"
    );
}
