//! Zero-copy channels between real processes (this test binary re-executed in child roles):
//! loans that come back, read-only views the MMU enforces, forwarding through a pipeline,
//! forged descriptors, and a stage killed while it holds buffers.

mod common;
use common::TestRegion;
use memloop::ring::{Descriptor, SlotProducer};
use memloop::zerocopy::{Message, Pool, ZcListener, ZcPort};
use memloop::{Error, Node, Region, RegionSpec};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

const ROLE: &str = "MEMLOOP_ZC_ROLE";
const SEGV: i32 = 11;

/// The byte at offset `i` of message `seq`: a dropped, repeated or mixed-up buffer shows.
fn pattern(seq: u32, i: usize) -> u8 {
    (seq as usize)
        .wrapping_mul(31)
        .wrapping_add(i.wrapping_mul(7)) as u8
        ^ (i >> 8) as u8
}

fn fill(seq: u32, buf: &mut [u8]) {
    buf.iter_mut()
        .enumerate()
        .for_each(|(i, b)| *b = pattern(seq, i));
}

fn check(seq: u32, bytes: &[u8], from: usize) -> bool {
    bytes
        .iter()
        .enumerate()
        .all(|(i, &b)| b == pattern(seq, from + i))
}

/// A child process in `role`, talking over stdin/stdout lines.
struct Stage {
    child: Child,
    stdin: Option<ChildStdin>,
    out: BufReader<ChildStdout>,
}

impl Stage {
    fn spawn(role: &str, region: &str, args: &[&str]) -> Stage {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .env(ROLE, role)
            .env("MEMLOOP_REGION", region)
            .env("ZC_ARGS", args.join(" "))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn a stage");
        let stdin = child.stdin.take();
        let out = BufReader::new(child.stdout.take().unwrap());
        Stage { child, stdin, out }
    }

    /// The next line the stage says (waits for it).
    fn line(&mut self) -> String {
        let mut l = String::new();
        self.out.read_line(&mut l).expect("a stage's stdout");
        l.trim().to_string()
    }

    fn say(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        writeln!(stdin, "{line}")
            .and_then(|()| stdin.flush())
            .unwrap();
    }

    /// Exit code, or minus the signal that ended it; fails after `limit`.
    fn wait(&mut self, limit: Duration) -> i32 {
        self.stdin = None;
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Some(st) = self.child.try_wait().unwrap() {
                use std::os::unix::process::ExitStatusExt;
                return st.code().unwrap_or_else(|| -st.signal().unwrap_or(0));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = self.child.kill();
        panic!("stage did not end within {limit:?}");
    }
}

impl Drop for Stage {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn main() -> std::process::ExitCode {
    if let Ok(role) = std::env::var(ROLE) {
        child_entry(&role);
    }
    use memloop_testkit::test;
    memloop_testkit::run(vec![
        test!(loans_come_back_after_the_receiver_drops_them),
        test!(a_receiver_that_writes_into_a_received_buffer_faults),
        test!(a_forwarded_buffer_returns_when_the_last_stage_releases_it),
        test!(forged_descriptors_are_refused_with_an_error),
        test!(a_stage_killed_while_holding_buffers_gives_them_all_back),
        test!(a_pool_that_does_not_fit_reclaims_the_dead_first),
        test!(sigkill_of_any_stage_at_random_moments_leaves_nothing_behind),
    ])
}

// ---------------------------------------------------------------------------------------------
// Children.

fn child_entry(role: &str) -> ! {
    let args: Vec<String> = std::env::var("ZC_ARGS")
        .unwrap_or_default()
        .split_whitespace()
        .map(String::from)
        .collect();
    let region = Region::open(&RegionSpec::from_env()).expect("open region");
    let node = Node::join(region, role).expect("join");
    let code = match role {
        "sink" => child_sink(&node, &args),
        "middle" => child_middle(&node, &args),
        "scribbler" => child_scribbler(&node, &args),
        "k-source" => child_kill_source(&node, &args),
        "k-middle" => child_kill_middle(&node, &args),
        "k-sink" => child_kill_sink(&node, &args),
        "hog" => child_hog(&node, &args),
        other => panic!("unknown role {other}"),
    };
    std::process::exit(code);
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}").and_then(|()| out.flush()).unwrap();
}

fn wait_stdin_line() -> String {
    let mut l = String::new();
    std::io::stdin().lock().read_line(&mut l).ok();
    l.trim().to_string()
}

/// `sink SVC HOLD`: accepts one port and checks every message (segment 0 may be a stage
/// header `seq:` followed by payload segments). With HOLD > 0 it keeps the last HOLD messages
/// until told `release` on stdin; says `got N` at the end of the stream.
fn child_sink(node: &Node, args: &[String]) -> i32 {
    let hold: usize = args[1].parse().unwrap();
    let l = ZcListener::bind(node, &args[0]).expect("bind");
    say("ready");
    let mut port = l.accept().expect("accept");
    let (mut n, mut held) = (0u32, Vec::new());
    while let Some(m) = port.recv().expect("recv") {
        let seq = m.user();
        let segs: Vec<&[u8]> = m.segments().collect();
        // A middle stage's header, then its payload: whole, or from `from` on.
        let (payload, from) = match segs.as_slice() {
            [h, p] if h.starts_with(b"hdr") => {
                let from: usize = std::str::from_utf8(&h[3..]).unwrap().parse().unwrap();
                (*p, from)
            }
            [p] => (*p, 0),
            _ => return 4,
        };
        if !check(seq, payload, from) {
            eprintln!("message {seq}: bad bytes");
            return 2;
        }
        n += 1;
        held.push(m);
        if held.len() > hold {
            held.remove(0);
        }
    }
    say(&format!("got {n} holding {}", held.len()));
    if hold > 0 {
        wait_stdin_line();
        drop(held);
        say("released");
    }
    wait_stdin_line();
    0
}

/// `middle IN OUT`: forwards every message from IN to OUT: odd ones whole, even ones from
/// byte 100 on, each behind a header of its own (a loan from its own pool).
fn child_middle(node: &Node, args: &[String]) -> i32 {
    let pool = Pool::create(node, 64, 8).expect("pool");
    let l = ZcListener::bind(node, &args[0]).expect("bind");
    let mut out = ZcPort::connect(node, &args[1]).expect("connect");
    say("ready");
    let mut port = l.accept().expect("accept");
    while let Some(m) = port.recv().expect("recv") {
        let from = if m.user() % 2 == 0 { 100 } else { 0 };
        let mut hdr = pool.loan().expect("loan");
        let text = format!("hdr{from}");
        hdr[..text.len()].copy_from_slice(text.as_bytes());
        hdr.truncate(text.len());
        let msg = Message::new().loan(hdr).user(m.user());
        let msg = msg
            .forward_range(&m, 0, from, m.len() - from)
            .expect("range");
        out.send(msg).expect("send");
    }
    out.shutdown_send();
    say("done");
    wait_stdin_line();
    0
}

/// `scribbler SVC`: reads one message, says so, then writes into it (and should die).
fn child_scribbler(node: &Node, args: &[String]) -> i32 {
    let l = ZcListener::bind(node, &args[0]).expect("bind");
    say("ready");
    let mut port = l.accept().expect("accept");
    let m = port.recv().expect("recv").expect("a message");
    say(&format!("read {}", m.bytes()[0]));
    // The buffer is mapped read-only: the MMU must stop this with SIGSEGV before it lands.
    memloop_shm::fault_probe::write_into(m.bytes(), 0xee).expect("a read-only view");
    say("wrote");
    0
}

/// `k-source OUT`: streams messages from a pool of 8 until its peer goes (or 100 000 were
/// sent), then waits for every buffer to come back: exit 0 if they all did within 10 s.
fn child_kill_source(node: &Node, args: &[String]) -> i32 {
    let pool = Pool::create(node, 2048, 8).expect("pool");
    let Ok(mut port) = ZcPort::connect(node, &args[0]) else {
        return 0;
    };
    say("ready");
    port.set_timeout(Some(Duration::from_secs(5)));
    for seq in 0..100_000u32 {
        let Ok(mut b) = pool.loan_timeout(Some(Duration::from_secs(5))) else {
            break;
        };
        fill(seq, &mut b);
        if port.send(Message::from(b).user(seq)).is_err() {
            break;
        }
    }
    drop(port);
    let deadline = Instant::now() + Duration::from_secs(10);
    while pool.free_buffers().unwrap_or(0) < 8 {
        if Instant::now() > deadline {
            eprintln!("k-source: {} of 8 back", pool.free_buffers().unwrap_or(0));
            return 5;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    0
}

/// `k-middle IN OUT`: forwards (whole, or behind a header of its own) until either side goes.
fn child_kill_middle(node: &Node, args: &[String]) -> i32 {
    let pool = Pool::create(node, 64, 8).expect("pool");
    let l = ZcListener::bind(node, &args[0]).expect("bind");
    let Ok(mut out) = ZcPort::connect(node, &args[1]) else {
        return 0;
    };
    say("ready");
    let Ok(mut port) = l.accept_timeout(Some(Duration::from_secs(5))) else {
        return 0;
    };
    while let Ok(Some(m)) = port.recv() {
        let msg = match m.user() % 2 {
            0 => Message::from(&m),
            _ => match pool.loan_timeout(Some(Duration::from_secs(5))) {
                Ok(h) => Message::new().loan(h).forward(&m).user(m.user()),
                Err(_) => break,
            },
        };
        if out.send(msg).is_err() {
            break;
        }
    }
    0
}

/// `k-sink IN HOLD`: receives, checking payloads, holding the last HOLD messages.
fn child_kill_sink(node: &Node, args: &[String]) -> i32 {
    let hold: usize = args[1].parse().unwrap();
    let l = ZcListener::bind(node, &args[0]).expect("bind");
    say("ready");
    let Ok(mut port) = l.accept_timeout(Some(Duration::from_secs(5))) else {
        return 0;
    };
    let mut held = std::collections::VecDeque::new();
    while let Ok(Some(m)) = port.recv() {
        let payload = m.segments().last().unwrap_or(&[]);
        if !check(m.user(), payload, 0) {
            eprintln!("k-sink: message {} bad", m.user());
            return 2;
        }
        held.push_back(m);
        if held.len() > hold {
            held.pop_front();
        }
    }
    0
}

// ---------------------------------------------------------------------------------------------
// Tests.

fn wait_for(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !ok() {
        assert!(Instant::now() < deadline, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// 300 messages from a pool of 4 buffers: every loan after the fourth is a buffer the
/// receiver released.
fn loans_come_back_after_the_receiver_drops_them() {
    let r = TestRegion::new("zc-loans", 64 << 20);
    let mut sink = Stage::spawn("sink", &r.name, &["loans", "0"]);
    assert_eq!(sink.line(), "ready");
    let node = r.node("source");
    let pool = Pool::create(&node, 64 << 10, 4).unwrap();
    let mut port = ZcPort::connect(&node, "loans").unwrap();
    for seq in 0..300u32 {
        let mut b = pool.loan_timeout(Some(Duration::from_secs(10))).unwrap();
        let len = 1 + (seq as usize * 977) % b.capacity();
        fill(seq, &mut b[..len]);
        b.truncate(len);
        port.send(Message::from(b).user(seq)).unwrap();
    }
    port.shutdown_send();
    assert_eq!(sink.line(), "got 300 holding 0");
    wait_for("all buffers back", Duration::from_secs(5), || {
        pool.free_buffers().unwrap() == 4
    });
    assert!(r.region.registry().pool(pool.id()).unwrap().loans >= 300);
    sink.say("bye");
    assert_eq!(sink.wait(Duration::from_secs(5)), 0);
}

fn a_receiver_that_writes_into_a_received_buffer_faults() {
    let r = TestRegion::new("zc-ro", 64 << 20);
    let mut st = Stage::spawn("scribbler", &r.name, &["ro"]);
    assert_eq!(st.line(), "ready");
    let node = r.node("source");
    let pool = Pool::create(&node, 4096, 2).unwrap();
    let mut port = ZcPort::connect(&node, "ro").unwrap();
    let mut b = pool.loan().unwrap();
    b[0] = 42;
    b.truncate(1);
    port.send(b).unwrap();
    assert_eq!(
        st.line(),
        "read 42",
        "the receiver reads the buffer in place"
    );
    assert_eq!(
        st.wait(Duration::from_secs(5)),
        -SEGV,
        "the write must fault"
    );
    assert_eq!(st.line(), "", "nothing after the write");
    // The buffer comes back once the dead reader is reclaimed, unchanged.
    wait_for("the buffer back", Duration::from_secs(5), || {
        pool.free_buffers().unwrap() == 2
    });
    let (x, y) = (pool.try_loan().unwrap(), pool.try_loan().unwrap());
    assert_eq!(x[0].max(y[0]), 42, "the write never landed");
}

/// source → middle → sink: the middle stage forwards without copying (with a header of its
/// own); the sink holds the last 5 messages. The source's buffers named by them stay out
/// until the sink lets go — though the source shares no channel with the sink — and the
/// source may close its pool meanwhile: the pool goes with the last release.
fn a_forwarded_buffer_returns_when_the_last_stage_releases_it() {
    let r = TestRegion::new("zc-fwd", 64 << 20);
    let mut sink = Stage::spawn("sink", &r.name, &["fwd-sink", "5"]);
    assert_eq!(sink.line(), "ready");
    let mut mid = Stage::spawn("middle", &r.name, &["fwd-mid", "fwd-sink"]);
    assert_eq!(mid.line(), "ready");
    let node = r.node("source");
    let pool = Pool::create(&node, 4096, 16).unwrap();
    let mut port = ZcPort::connect(&node, "fwd-mid").unwrap();
    for seq in 0..200u32 {
        let mut b = pool.loan_timeout(Some(Duration::from_secs(10))).unwrap();
        fill(seq, &mut b);
        port.send(Message::from(b).user(seq)).unwrap();
    }
    port.shutdown_send();
    assert_eq!(mid.line(), "done");
    assert_eq!(sink.line(), "got 200 holding 5");
    // The sink's five holds keep five of ours out; nothing else does.
    wait_for("all but the held back", Duration::from_secs(5), || {
        pool.free_buffers().unwrap() == 11
    });
    let id = pool.id();
    drop(port);
    drop(pool);
    let reg = r.region.registry();
    assert!(reg.pool(id).unwrap().closing, "closed, kept while held");
    sink.say("release");
    assert_eq!(sink.line(), "released");
    wait_for("the pool freed", Duration::from_secs(5), || {
        reg.pool(id).is_err()
    });
    mid.say("bye");
    sink.say("bye");
    assert_eq!(mid.wait(Duration::from_secs(5)), 0);
    assert_eq!(sink.wait(Duration::from_secs(5)), 0);
}

/// Descriptors a buggy or hostile peer could write, pushed raw into a port's ring: each is
/// refused with an error naming what is wrong, and a good one still works after them.
fn forged_descriptors_are_refused_with_an_error() {
    let r = TestRegion::new("zc-forged", 64 << 20);
    let a = r.node("receiver");
    let b = r.node("owner");
    let l = ZcListener::bind(&a, "forged").unwrap();
    let pool = Pool::create(&b, 256, 4).unwrap();
    let other = Pool::create(&a, 256, 4).unwrap();
    let client = ZcPort::connect(&b, "forged").unwrap();
    let mut port = l.accept().unwrap();
    let reg = r.region.registry();
    let rings = reg
        .rings_of(
            client.channel(),
            memloop::registry::ChannelKind::DescriptorPair,
        )
        .unwrap();
    let mut raw = SlotProducer::attach(rings.c2s).unwrap();
    let info = reg.pool(pool.id()).unwrap();
    let good = Descriptor {
        pool: pool.id().wire(),
        offset: 256,
        len: 10,
        owner: info.owner_tag,
        pool_gen: pool.id().gen,
        ..Descriptor::default()
    };
    let theirs = reg.pool(other.id()).unwrap().owner_tag;
    let forged = [
        Descriptor { pool: 0, ..good },
        Descriptor { pool: 999, ..good },
        Descriptor {
            pool_gen: good.pool_gen + 1,
            ..good
        },
        Descriptor {
            owner: theirs,
            ..good
        },
        Descriptor {
            offset: 1024,
            ..good
        },
        Descriptor {
            offset: 250,
            ..good
        },
        Descriptor { len: 0, ..good },
        Descriptor {
            len: u32::MAX,
            ..good
        },
    ];
    for d in forged {
        assert!(raw.push_desc(&d).unwrap());
        match port.recv() {
            Err(Error::Forged(why)) => assert!(!why.is_empty()),
            Err(e) => panic!("{d:?}: wrong error {e}"),
            Ok(_) => panic!("{d:?} accepted"),
        }
    }
    // A bad segment inside a message: the whole message goes, the next one is whole.
    let more = Descriptor {
        flags: Descriptor::FLAG_MORE,
        ..good
    };
    let tail = Descriptor { user: 7, ..good };
    for d in [more, Descriptor { len: 0, ..more }, tail] {
        assert!(raw.push_desc(&d).unwrap());
    }
    assert!(matches!(port.recv(), Err(Error::Forged(_))));
    assert!(raw.push_desc(&Descriptor { user: 9, ..good }).unwrap());
    let m = port.recv().unwrap().unwrap();
    assert_eq!((m.len(), m.segment_count(), m.user()), (10, 1, 9));
    drop(m);
    // Every forged slot was released: the ring's room is all back.
    assert_eq!(raw.free_slots().unwrap(), raw.slots());
    drop((client, pool, other));
}

/// A sink that holds every message it gets is SIGKILLed: the buffers it held come back (its
/// channel's reader is dead: its slots are read by nobody), with nothing released by hand.
fn a_stage_killed_while_holding_buffers_gives_them_all_back() {
    let r = TestRegion::new("zc-kill", 64 << 20);
    let mut sink = Stage::spawn("sink", &r.name, &["kill", "1000"]);
    assert_eq!(sink.line(), "ready");
    let node = r.node("source");
    let pool = Pool::create(&node, 1024, 8).unwrap();
    let mut port = ZcPort::connect(&node, "kill").unwrap();
    for seq in 0..8u32 {
        let mut b = pool.try_loan().unwrap();
        fill(seq, &mut b);
        port.send(Message::from(b).user(seq)).unwrap();
    }
    assert!(
        matches!(pool.try_loan(), Err(Error::WouldBlock)),
        "all 8 out"
    );
    port.shutdown_send();
    assert_eq!(sink.line(), "got 8 holding 8");
    unsafe_kill(&sink);
    assert_eq!(sink.wait(Duration::from_secs(5)), -9);
    wait_for("every buffer back", Duration::from_secs(10), || {
        pool.free_buffers().unwrap() == 8
    });
    assert!(pool.try_loan().is_ok());
}

/// `hog MIB`: creates a pool of MIB 1-MiB buffers, says `ready`, and waits to be killed.
fn child_hog(node: &Node, args: &[String]) -> i32 {
    let n: u32 = args[0].parse().unwrap();
    let _pool = Pool::create(node, 1 << 20, n).expect("the hog's pool");
    say("ready");
    wait_stdin_line();
    0
}

/// A region full of a dead process's pool: a new pool that does not fit reclaims the dead and
/// is made, instead of failing with "region full" until someone else's sweep.
fn a_pool_that_does_not_fit_reclaims_the_dead_first() {
    let r = TestRegion::new("zc-full", 64 << 20);
    let mut hog = Stage::spawn("hog", &r.name, &["40"]);
    assert_eq!(hog.line(), "ready");
    let node = r.node("late");
    unsafe_kill(&hog);
    assert_eq!(hog.wait(Duration::from_secs(5)), -9);
    let pool = Pool::create(&node, 1 << 20, 40).expect("a pool after the dead one's");
    assert_eq!(pool.free_buffers().unwrap(), 40);
}

fn unsafe_kill(s: &Stage) {
    let _ = Command::new("kill")
        .args(["-KILL", &s.child.id().to_string()])
        .status();
}

/// Source → middle → sink, all three child processes; one of them is SIGKILLed at a random
/// moment. A surviving source gets every buffer back; once the dead are reclaimed, the region
/// holds no pool, channel or ring segment more than before. Trials: `MEMLOOP_KILL_TRIALS`.
fn sigkill_of_any_stage_at_random_moments_leaves_nothing_behind() {
    use rand::{Rng, SeedableRng};
    let r = TestRegion::new("zc-killany", 64 << 20);
    let me = r.node("watcher");
    let reg = r.region.registry();
    let base = reg.usage();
    let trials = std::env::var("MEMLOOP_KILL_TRIALS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(12u64);
    let mut rng = rand::rngs::StdRng::seed_from_u64(trials);
    for t in 0..trials {
        let (a, b) = (format!("ka-mid-{t}"), format!("ka-sink-{t}"));
        let hold = rng.gen_range(0..6).to_string();
        let mut sink = Stage::spawn("k-sink", &r.name, &[&b, &hold]);
        assert_eq!(sink.line(), "ready");
        let mut mid = Stage::spawn("k-middle", &r.name, &[&a, &b]);
        assert_eq!(mid.line(), "ready");
        let mut src = Stage::spawn("k-source", &r.name, &[&a]);
        assert_eq!(src.line(), "ready");
        std::thread::sleep(Duration::from_micros(rng.gen_range(0..40_000)));
        let victim = rng.gen_range(0..3);
        let pid = [&src, &mid, &sink][victim].child.id();
        let _ = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
        // Survivors end by themselves: a dead peer is an error or the end of their stream.
        let codes: Vec<i32> = [&mut src, &mut mid, &mut sink]
            .into_iter()
            .map(|s| s.wait(Duration::from_secs(30)))
            .collect();
        for (i, &c) in codes.iter().enumerate() {
            match i == victim {
                true => assert_eq!(c, -9, "trial {t}: the victim"),
                false => assert_eq!(c, 0, "trial {t}: stage {i} (victim {victim})"),
            }
        }
        wait_for(
            "the region back to its baseline",
            Duration::from_secs(10),
            || {
                me.reclaim_dead();
                reg.sweep_leftovers();
                let u = reg.usage();
                (u.pools, u.channels, u.segments_used)
                    == (base.pools, base.channels, base.segments_used)
            },
        );
    }
}
