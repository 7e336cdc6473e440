//! Cross-process tests: real processes (this test binary re-executed in a child role) talking
//! through one region. Heavy volumes are scaled by `MEMLOOP_STRESS_BYTES` / `MEMLOOP_KILL_TRIALS`.

mod common;
use common::TestRegion;
use memloop::registry::Usage;
use memloop::{Error, Listener, Node, Region, RegionSpec, Stream};
use rand::{Rng, SeedableRng};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

const ROLE: &str = "MEMLOOP_CHILD_ROLE";

/// The byte at stream position `i`: position-dependent so loss, duplication or reordering shows.
fn pattern(i: u64) -> u8 {
    (i.wrapping_mul(0x9E37_79B9) >> 13) as u8 ^ (i >> 8) as u8
}

fn fill(pos: u64, buf: &mut [u8]) {
    for (k, b) in buf.iter_mut().enumerate() {
        *b = pattern(pos + k as u64);
    }
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn spawn_child(role: &str, region: &str, svc: &str, arg: u64) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .env(ROLE, role)
        .env("MEMLOOP_REGION", region)
        .env("CHILD_SVC", svc)
        .env("CHILD_ARG", arg.to_string())
        .spawn()
        .expect("spawn child")
}

fn wait_child(child: &mut Child, limit: Duration) -> Option<i32> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if let Some(st) = child.try_wait().unwrap() {
            // Killed by a signal: report it as KILLED.
            return Some(st.code().unwrap_or(KILLED));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

fn main() -> std::process::ExitCode {
    // A re-executed child plays its role instead of running the tests (no "test" that passes
    // by doing nothing).
    if let Ok(role) = std::env::var(ROLE) {
        child_entry(&role);
    }
    use memloop_testkit::test;
    memloop_testkit::run(vec![
        test!(stream_carries_checksummed_bytes_between_processes),
        test!(record_ring_carries_random_sized_records_between_processes),
        test!(sigkill_at_random_points_never_hangs_or_leaks),
        test!(a_member_holding_nothing_runs_no_thread_and_its_lock_proves_it_alive),
        test!(a_member_in_another_pid_namespace_is_judged_by_its_lock),
    ])
}

/// Entry point of child processes.
fn child_entry(role: &str) -> ! {
    let svc = std::env::var("CHILD_SVC").unwrap();
    let arg: u64 = std::env::var("CHILD_ARG").unwrap().parse().unwrap();
    let code = match role {
        "writer" => child_writer(&svc, arg),
        "echo-server" => child_echo_server(&svc),
        "echo-client" => child_echo_client(&svc, arg),
        "records" => child_records(&svc, arg),
        "idle-member" => child_idle_member(&svc),
        other => panic!("unknown role {other}"),
    };
    std::process::exit(code);
}

fn child_node() -> Node {
    let region = Region::open(&RegionSpec::from_env()).expect("open region");
    Node::join(region, "test-child").expect("join")
}

/// Joins and binds a listener (holding nothing the heartbeat looks after), says its member id,
/// then follows stdin: `connect` connects to `svc` (a channel: now it must beat), anything
/// else (or EOF) ends it.
fn child_idle_member(svc: &str) -> i32 {
    use std::io::{BufRead, Write};
    let node = child_node();
    let _own = Listener::bind(&node, &format!("{svc}-own")).expect("bind");
    let say = |line: String| {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{line}")
            .and_then(|()| out.flush())
            .expect("stdout");
    };
    say(format!("member {} {}", node.id().idx, node.id().gen));
    let mut held = None;
    for line in std::io::stdin().lock().lines() {
        match line.expect("stdin").as_str() {
            "connect" => {
                held = Some(Stream::connect(&node, svc).expect("connect"));
                say("connected".into());
            }
            _ => break,
        }
    }
    drop(held);
    0
}

/// Writes `total` pattern bytes in random-sized chunks, then shuts down.
fn child_writer(svc: &str, total: u64) -> i32 {
    let node = child_node();
    let mut s = Stream::connect(&node, svc).expect("connect");
    let mut rng = rand::rngs::StdRng::seed_from_u64(total);
    let mut buf = vec![0u8; 256 * 1024];
    let mut pos = 0u64;
    while pos < total {
        let n = rng.gen_range(1..=buf.len() as u64).min(total - pos) as usize;
        fill(pos, &mut buf[..n]);
        s.send_all(&buf[..n]).expect("send");
        pos += n as u64;
    }
    s.shutdown_write();
    // Wait for the reader's end of stream so our drop cannot race its last read.
    let _ = s.recv(&mut buf);
    0
}

/// Accepts one connection and echoes until EOF or peer death. Exit 0 on either.
fn child_echo_server(svc: &str) -> i32 {
    let node = child_node();
    let listener = Listener::bind(&node, svc).expect("bind");
    // A client killed before connecting never arrives: give up after a while.
    let mut s = match listener.accept_timeout(Some(Duration::from_millis(1500))) {
        Ok(s) => s,
        Err(Error::TimedOut) => return NEVER_CONNECTED,
        Err(e) => return report(e),
    };
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match s.recv(&mut buf) {
            Ok(0) => return 0,
            Ok(n) => {
                if let Err(e) = s.send_all(&buf[..n]) {
                    return report(e);
                }
            }
            Err(e) => return report(e),
        }
    }
}

/// Sends pattern bytes and checks the echo; exits 2 on corrupted data.
fn child_echo_client(svc: &str, seed: u64) -> i32 {
    let node = child_node();
    let mut s = match Stream::connect(&node, svc) {
        Ok(s) => s,
        Err(e) => return report(e),
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let (mut out, mut inp) = (vec![0u8; 64 * 1024], vec![0u8; 64 * 1024]);
    let mut pos = 0u64;
    loop {
        let n = rng.gen_range(1..=out.len());
        fill(pos, &mut out[..n]);
        if let Err(e) = s.send_all(&out[..n]) {
            return report(e);
        }
        let mut got = 0;
        while got < n {
            match s.recv(&mut inp[..n - got]) {
                Ok(0) => return 0,
                Ok(k) => {
                    if inp[..k]
                        .iter()
                        .enumerate()
                        .any(|(j, b)| *b != pattern(pos + (got + j) as u64))
                    {
                        return 2;
                    }
                    got += k;
                }
                Err(e) => return report(e),
            }
        }
        pos += n as u64;
    }
}

/// What `wait_child` reports for a child killed by a signal.
const KILLED: i32 = -9;
/// Exit code of a survivor that never had a connection (its peer died before connecting).
const NEVER_CONNECTED: i32 = 10;

fn report(e: Error) -> i32 {
    match e {
        Error::NoService(_) => NEVER_CONNECTED,
        Error::PeerDead | Error::BrokenPipe => 0,
        other => {
            eprintln!("child error: {other}");
            3
        }
    }
}

fn child_records(path: &str, count: u64) -> i32 {
    use memloop::ring::{RecordProducer, WaitPolicy};
    let mapping =
        memloop_shm::Mapping::open(path.as_ref(), memloop_shm::Backend::File, true).unwrap();
    let mut p = RecordProducer::attach(mapping.view()).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(count);
    let mut buf = vec![0u8; p.max_record() as usize];
    for seq in 0..count {
        let len = record_len(&mut rng, buf.len());
        fill(seq * 7919, &mut buf[..len]);
        while !p.send(&buf[..len]).unwrap() {
            p.wait_writable(
                len as u64,
                &WaitPolicy::default(),
                Duration::from_millis(100),
            )
            .unwrap();
        }
    }
    p.shutdown();
    0
}

fn record_len(rng: &mut impl Rng, max: usize) -> usize {
    // Mostly small datagrams, sometimes empty, sometimes the largest allowed.
    match rng.gen_range(0..20) {
        0 => 0,
        1 => max,
        2..=5 => rng.gen_range(0..=max),
        _ => rng.gen_range(1..=1500),
    }
}

fn stream_carries_checksummed_bytes_between_processes() {
    let total = env_u64("MEMLOOP_STRESS_BYTES", 64 << 20);
    let r = TestRegion::new("stream", 16 << 20);
    let node = Node::join(r.region.clone(), "reader").unwrap();
    let svc = "bulk";
    let listener = Listener::bind(&node, svc).unwrap();
    let mut child = spawn_child("writer", &r.name, svc, total);
    let mut s = listener
        .accept_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut buf = vec![0u8; 128 * 1024];
    let mut pos = 0u64;
    loop {
        let n = s.recv(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        for (k, b) in buf[..n].iter().enumerate() {
            assert_eq!(
                *b,
                pattern(pos + k as u64),
                "byte {} corrupted",
                pos + k as u64
            );
        }
        pos += n as u64;
    }
    assert_eq!(pos, total);
    drop(s);
    assert_eq!(wait_child(&mut child, Duration::from_secs(30)), Some(0));
}

fn record_ring_carries_random_sized_records_between_processes() {
    use memloop::ring::{init_ring, ring_bytes, RecordConsumer, RingKind, WaitPolicy};
    let count = env_u64("MEMLOOP_STRESS_RECORDS", 200_000);
    let path = format!("/dev/shm/memloop-test-records-{}", std::process::id());
    let _ = std::fs::remove_file(&path);
    let opts = memloop_shm::CreateOptions {
        size: ring_bytes(1 << 16),
        mode: 0o600,
        gid: None,
        locked: false,
    };
    let mapping =
        memloop_shm::Mapping::create_new(path.as_ref(), memloop_shm::Backend::File, &opts).unwrap();
    init_ring(&mapping.view(), RingKind::Record, 1 << 16, 0).unwrap();
    let mut c = RecordConsumer::attach(mapping.view()).unwrap();
    let mut child = spawn_child("records", "unused", &path, count);
    let mut rng = rand::rngs::StdRng::seed_from_u64(count);
    let max = (1u64 << 15) as usize - 8;
    let (mut got, mut want) = (vec![0u8; max], vec![0u8; max]);
    for seq in 0..count {
        let info = loop {
            if let Some(info) = c.recv(&mut got).unwrap() {
                break info;
            }
            assert!(!c.is_eof().unwrap(), "EOF after {seq} records");
            c.wait_readable(&WaitPolicy::default(), Duration::from_millis(100))
                .unwrap();
        };
        let len = record_len(&mut rng, max);
        assert_eq!(info.len, len as u64, "record {seq} length");
        fill(seq * 7919, &mut want[..len]);
        assert!(got[..len] == want[..len], "record {seq} content");
    }
    assert_eq!(wait_child(&mut child, Duration::from_secs(30)), Some(0));
    assert!(c.recv(&mut got).unwrap().is_none());
    assert!(c.is_eof().unwrap());
    std::fs::remove_file(&path).unwrap();
}

fn baseline(u: &Usage) -> (u32, u32, u32, u64) {
    (u.members, u.endpoints, u.channels, u.segments_used)
}

/// Kills one or both ends of an echo pair at random moments. The survivor must finish (EOF or
/// a peer-dead error, never corrupted data or a hang) and the region must return to baseline.
fn sigkill_at_random_points_never_hangs_or_leaks() {
    let trials = env_u64("MEMLOOP_KILL_TRIALS", 200);
    let r = TestRegion::new("kill", 8 << 20);
    let observer = Node::join(r.region.clone(), "observer").unwrap();
    let base = baseline(&r.region.registry().usage());
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed);
    let mut outcomes = std::collections::BTreeMap::new();
    for t in 0..trials {
        let svc = format!("echo-{t}");
        let mut server = spawn_child("echo-server", &r.name, &svc, 0);
        std::thread::sleep(Duration::from_millis(rng.gen_range(0..15)));
        let mut client = spawn_child("echo-client", &r.name, &svc, t);
        std::thread::sleep(Duration::from_micros(rng.gen_range(0..40_000)));
        let victim = rng.gen_range(0..3); // 0: server, 1: client, 2: both
        if victim != 1 {
            server.kill().unwrap();
        }
        if victim != 0 {
            client.kill().unwrap();
        }
        for (who, child) in [("server", &mut server), ("client", &mut client)] {
            let code = wait_child(child, Duration::from_secs(5));
            // Never a hang (None), corrupted data (2) or another error (3).
            assert!(
                code.is_some(),
                "trial {t}: {who} hung after its peer was killed"
            );
            assert!(
                matches!(code, Some(0 | NEVER_CONNECTED | KILLED)),
                "trial {t}: {who} exited {code:?}"
            );
            *outcomes.entry((who, code)).or_insert(0u32) += 1;
        }
        // A child killed mid-join leaves a claim that only expires after CLAIM_TIMEOUT.
        let deadline = Instant::now() + memloop::liveness::CLAIM_TIMEOUT * 2;
        while observer.reclaim_dead() > 0 || baseline(&r.region.registry().usage()) != base {
            let usage = r.region.registry().usage();
            assert!(
                Instant::now() < deadline,
                "trial {t}: region not back to baseline: {usage:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    eprintln!("kill outcomes (who, exit code): {outcomes:?}");
    // The trials must mostly hit established connections, or they prove little.
    let connected = outcomes.get(&("server", Some(0))).copied().unwrap_or(0)
        + outcomes.get(&("client", Some(0))).copied().unwrap_or(0);
    assert!(
        connected as u64 >= trials / 4,
        "too few kills hit a live connection: {outcomes:?}"
    );
}

/// An idle member as a child process, run through `wrap` (e.g. `unshare`), and its member id.
struct IdleMember {
    child: Child,
    lines: std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
    id: memloop::registry::MemberId,
}

impl IdleMember {
    fn start(wrap: &[&str], region: &str, svc: &str) -> IdleMember {
        use std::io::BufRead;
        use std::process::Stdio;
        let exe = std::env::current_exe().unwrap();
        let mut cmd = match wrap.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(exe);
                c
            }
            None => Command::new(exe),
        };
        let mut child = cmd
            .env(ROLE, "idle-member")
            .env("MEMLOOP_REGION", region)
            .env("CHILD_SVC", svc)
            .env("CHILD_ARG", "0")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn idle member");
        let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let first = lines.next().expect("member line").unwrap();
        let f: Vec<u32> = first
            .split_whitespace()
            .skip(1)
            .map(|x| x.parse().unwrap())
            .collect();
        let id = memloop::registry::MemberId {
            idx: f[0],
            gen: f[1],
        };
        IdleMember { child, lines, id }
    }

    fn tell(&mut self, line: &str) {
        use std::io::Write;
        let stdin = self.child.stdin.as_mut().unwrap();
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
    }

    /// Its threads, by the pid it registered.
    fn threads(&self, node: &Node) -> usize {
        let pid = node
            .region()
            .registry()
            .member(self.id)
            .unwrap()
            .identity
            .pid;
        std::fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap()
            .count()
    }
}

fn a_member_holding_nothing_runs_no_thread_and_its_lock_proves_it_alive() {
    let r = TestRegion::new("idle", 4 << 20);
    let node = Node::join(r.region.clone(), "judge").unwrap();
    let listener = Listener::bind(&node, "idle-svc").unwrap();
    let mut m = IdleMember::start(&[], &r.name, "idle-svc");
    let reg = node.region().registry();
    let info = reg.member(m.id).unwrap();
    assert!(info.locked() && info.beatless(), "{info:?}");
    assert_eq!(
        m.threads(&node),
        1,
        "a member holding nothing has no heartbeat thread"
    );
    // Past the heartbeat timeout: still alive (by /proc here).
    std::thread::sleep(memloop::liveness::HEARTBEAT_TIMEOUT + Duration::from_millis(300));
    assert!(node.peer_alive(m.id));
    // A channel: now it beats.
    m.tell("connect");
    let _s = listener
        .accept_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    assert_eq!(m.lines.next().unwrap().unwrap(), "connected");
    let info = reg.member(m.id).unwrap();
    assert!(!info.beatless() && info.locked(), "{info:?}");
    assert_eq!(
        m.threads(&node),
        2,
        "holding a channel starts the heartbeat"
    );
    let beat = info.heartbeat;
    std::thread::sleep(memloop::liveness::HEARTBEAT_PERIOD * 2);
    assert_ne!(reg.member(m.id).unwrap().heartbeat, beat, "it beats");
    m.tell("end");
    assert_eq!(wait_child(&mut m.child, Duration::from_secs(10)), Some(0));
}

fn a_member_in_another_pid_namespace_is_judged_by_its_lock() {
    let r = TestRegion::new("pidns", 4 << 20);
    let node = Node::join(r.region.clone(), "judge").unwrap();
    let mut m = IdleMember::start(
        &["unshare", "--pid", "--fork", "--kill-child"],
        &r.name,
        "pidns-svc",
    );
    let reg = node.region().registry();
    let info = reg.member(m.id).unwrap();
    assert_ne!(
        info.identity.pid_ns,
        reg.member(node.id()).unwrap().identity.pid_ns,
        "the member runs in another pid namespace"
    );
    assert!(info.locked() && info.beatless(), "{info:?}");
    // No heartbeat moves, yet it is alive well past the heartbeat timeout: by its lock.
    std::thread::sleep(memloop::liveness::HEARTBEAT_TIMEOUT + Duration::from_millis(300));
    assert!(node.peer_alive(m.id));
    // SIGKILL: its lock goes with it, and it is found dead (and reclaimed) without waiting for
    // a heartbeat. (A member without a heartbeat and without a lock would look alive forever.)
    // (Its registered pid is its pid in its own namespace: kill it through `unshare`, whose
    // `--kill-child` passes the SIGKILL on.)
    m.child.kill().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while node.peer_alive(m.id) {
        assert!(
            Instant::now() < deadline,
            "a killed member still counts as alive: {:?}",
            reg.member(m.id)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(reg.member(m.id).is_err(), "the dead member was reclaimed");
    let _ = m.child.wait();
}
