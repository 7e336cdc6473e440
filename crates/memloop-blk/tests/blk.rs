//! The block service between members of a region: round trips against a model, many
//! requests in flight completed out of order, FUA/flush/discard, a read-only export, bad
//! requests sent raw, and a server or a client SIGKILLed (child processes: this test binary
//! re-executed in a role).

// The region helper of memloop's own cross-process tests (one copy for both crates).
#[path = "../../memloop/tests/common/mod.rs"]
mod common;
use common::TestRegion;
use memloop::ring::{Descriptor, SlotProducer};
use memloop::zerocopy::{Message, Pool, ZcListener};
use memloop::{Node, Region, RegionSpec};
use memloop_blk::client::{open_channels, Channels};
use memloop_blk::proto::{
    self, errno, CompletionHeader, ExportInfo, Hello, Op, Ready, RequestHeader, HEADER_LEN,
};
use memloop_blk::{BlkClient, BlkError, BlkServer, ClientOptions, ExportOptions};
use rand::{Rng, RngCore, SeedableRng};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

const ROLE: &str = "MEMLOOP_BLK_ROLE";

fn main() -> std::process::ExitCode {
    if let Ok(role) = std::env::var(ROLE) {
        child_entry(&role);
    }
    use memloop_testkit::test;
    memloop_testkit::run(vec![
        test!(random_io_round_trips_match_a_model),
        test!(sixty_four_requests_in_flight_complete_out_of_order),
        test!(fua_and_flush_complete_and_reach_the_file),
        test!(only_storage_with_a_volatile_cache_asks_for_flushes),
        test!(discarded_blocks_read_back_as_zeros),
        test!(a_read_only_export_refuses_writes_with_erofs),
        test!(a_4096_byte_block_export_refuses_512_byte_alignment),
        test!(bad_requests_are_refused_with_einval_and_counted),
        test!(a_server_killed_mid_io_fails_requests_within_2s_and_a_new_export_serves),
        test!(a_killed_client_is_reclaimed_while_others_keep_going),
    ])
}

// ---------------------------------------------------------------------------------------------
// Helpers.

/// A backing file of `size` bytes (zeros), removed at the end.
struct Backing {
    path: PathBuf,
}

impl Backing {
    fn new(tag: &str, size: u64) -> Backing {
        let path = std::env::temp_dir().join(format!("memloop-blk-{tag}-{}", std::process::id()));
        let f = std::fs::File::create(&path).unwrap();
        f.set_len(size).unwrap();
        Backing { path }
    }

    fn bytes(&self) -> Vec<u8> {
        std::fs::read(&self.path).unwrap()
    }
}

impl Drop for Backing {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The byte at `off` of data written with `seed`.
fn pattern(seed: u64, off: u64) -> u8 {
    (seed.wrapping_mul(0x9e37_79b9) ^ off.wrapping_mul(31) ^ (off >> 9)) as u8
}

fn fill(seed: u64, at: u64, buf: &mut [u8]) {
    buf.iter_mut()
        .enumerate()
        .for_each(|(i, b)| *b = pattern(seed, at + i as u64));
}

fn filled(seed: u64, at: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0; len];
    fill(seed, at, &mut v);
    v
}

fn wait_for(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !ok() {
        assert!(Instant::now() < deadline, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn opts(max_io: u32, queue_depth: u32) -> ExportOptions {
    ExportOptions {
        max_io,
        queue_depth,
        ..ExportOptions::default()
    }
}

/// Every completion of `n` requests in flight, in the order they came.
fn complete_all(c: &mut BlkClient, n: usize) -> Vec<memloop_blk::Completion> {
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while out.len() < n {
        assert!(
            Instant::now() < deadline,
            "{} of {n} completions",
            out.len()
        );
        out.extend(c.complete(Some(Duration::from_secs(1))).unwrap());
    }
    out
}

/// A child process in `role`, talking over stdin/stdout lines.
struct Proc {
    child: Child,
    stdin: Option<ChildStdin>,
    out: BufReader<ChildStdout>,
}

impl Proc {
    fn spawn(role: &str, region: &str, args: &[&str]) -> Proc {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .env(ROLE, role)
            .env("MEMLOOP_REGION", region)
            .env("BLK_ARGS", args.join(" "))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn a child");
        let stdin = child.stdin.take();
        let out = BufReader::new(child.stdout.take().unwrap());
        Proc { child, stdin, out }
    }

    fn line(&mut self) -> String {
        let mut l = String::new();
        self.out.read_line(&mut l).expect("a child's stdout");
        l.trim().to_string()
    }

    fn kill(&mut self) {
        let _ = Command::new("kill")
            .args(["-KILL", &self.child.id().to_string()])
            .status();
    }

    /// Exit code, or minus the signal that ended it.
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
        panic!("child did not end within {limit:?}");
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------------------------------------
// Children.

fn child_entry(role: &str) -> ! {
    let args: Vec<String> = std::env::var("BLK_ARGS")
        .unwrap_or_default()
        .split_whitespace()
        .map(String::from)
        .collect();
    let region = Region::open(&RegionSpec::from_env()).expect("open region");
    let node = Node::join(region, role).expect("join");
    let code = match role {
        "server" => child_server(&node, &args),
        "client" => child_client(&node, &args),
        other => panic!("unknown role {other}"),
    };
    std::process::exit(code);
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}").and_then(|()| out.flush()).unwrap();
}

/// `server NAME PATH`: exports until stdin closes (or it is killed).
fn child_server(node: &Node, args: &[String]) -> i32 {
    let srv = BlkServer::export_with(node, &args[0], Path::new(&args[1]), opts(128 << 10, 64))
        .expect("export");
    say("ready");
    let mut l = String::new();
    while std::io::stdin().lock().read_line(&mut l).unwrap_or(0) > 0 {
        l.clear();
    }
    drop(srv);
    0
}

/// `client NAME`: writes and reads at random, 16 in flight, holding the last 8 reads'
/// data, until killed (or 60 s); says `running` once it has done 100 requests.
fn child_client(node: &Node, args: &[String]) -> i32 {
    let mut c = BlkClient::connect_with(
        node,
        &args[0],
        ClientOptions {
            queue_depth: 16,
            max_io: 64 << 10,
            ..ClientOptions::default()
        },
    )
    .expect("connect");
    let blocks = c.info().size / 4096;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut held = std::collections::VecDeque::new();
    let (mut tag, mut done) = (0u64, 0u64);
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(60) {
        while c.outstanding() < 16 {
            tag += 1;
            // The upper half of the device: the other client uses the lower.
            let off = (blocks / 2 + rng.gen_range(0..blocks / 2)) * 4096;
            if rng.gen_bool(0.5) {
                c.submit_read(tag, off, 4096).expect("read");
            } else {
                let mut b = c.write_buf().expect("buffer");
                fill(tag, 0, b.payload_mut(4096).unwrap());
                c.submit_write(tag, off, b, false).expect("write");
            }
        }
        for mut comp in c.complete(None).expect("complete") {
            assert!(comp.is_ok());
            done += 1;
            if let Some(d) = comp.take_data() {
                held.push_back(d);
                if held.len() > 8 {
                    held.pop_front();
                }
            }
            if done == 100 {
                say("running");
            }
        }
    }
    0
}

// ---------------------------------------------------------------------------------------------
// Tests.

/// Rounds of up to 16 non-overlapping requests in flight (reads, writes — some FUA, some
/// with the payload placed after 0..80 bytes of headroom —, discards, flushes) against a
/// model of the device; then the whole device, read back and read from the file, is the
/// model. The zero-copy path copies nothing in user space; the helpers count their copies.
fn random_io_round_trips_match_a_model() {
    let r = TestRegion::new("blk-model", 256 << 20);
    let size = 4u64 << 20;
    let file = Backing::new("model", size);
    let srv = BlkServer::export_with(&r.node("server"), "model", &file.path, opts(128 << 10, 16))
        .unwrap();
    let node = r.node("client");
    let copts = ClientOptions {
        headroom: 80,
        ..ClientOptions::default()
    };
    let mut c = BlkClient::connect_with(&node, "model", copts).unwrap();
    let info = *c.info();
    assert_eq!((info.size, info.block_size), (size, 512));
    assert_eq!((info.max_io, info.queue_depth), (128 << 10, 16));
    let mut model = vec![0u8; size as usize];
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let (mut tag, mut written, mut read) = (0u64, 0u64, 0u64);
    for _round in 0..300 {
        let k = rng.gen_range(1..=16);
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        let mut expect: HashMap<u64, (Op, u64, Vec<u8>)> = HashMap::new();
        for _ in 0..k {
            let len = rng.gen_range(1..=256u64) * 512;
            let off = rng.gen_range(0..=(size - len) / 512) * 512;
            if ranges.iter().any(|&(a, b)| off < b && a < off + len) {
                continue;
            }
            ranges.push((off, off + len));
            tag += 1;
            let (o, l) = (off as usize, len as usize);
            match rng.gen_range(0..20) {
                0..=8 if len <= 128 << 10 => {
                    let mut b = c.write_buf().unwrap();
                    let at = rng.gen_range(0..=80);
                    b.set_payload(at, l).unwrap();
                    rng.fill_bytes(&mut b.area_mut()[at..at + l]);
                    let data = b.payload().to_vec();
                    c.submit_write(tag, off, b, rng.gen_bool(0.1)).unwrap();
                    written += len;
                    expect.insert(tag, (Op::Write, off, data));
                }
                9..=16 if len <= 128 << 10 => {
                    c.submit_read(tag, off, len as u32).unwrap();
                    read += len;
                    expect.insert(tag, (Op::Read, off, model[o..o + l].to_vec()));
                }
                17 => {
                    c.submit_flush(tag).unwrap();
                    expect.insert(tag, (Op::Flush, 0, Vec::new()));
                }
                _ => {
                    c.submit_discard(tag, off, len as u32).unwrap();
                    expect.insert(tag, (Op::Discard, off, vec![0; l]));
                }
            }
        }
        for comp in complete_all(&mut c, expect.len()) {
            let (op, off, data) = expect.remove(&comp.tag()).expect("a tag in flight");
            assert!(comp.is_ok(), "{comp:?}");
            assert_eq!(comp.op(), op);
            match op {
                Op::Read => assert!(comp.data() == &data[..], "read {off}: wrong bytes"),
                Op::Write | Op::Discard => {
                    let o = off as usize;
                    model[o..o + data.len()].copy_from_slice(&data);
                }
                Op::Flush => {}
            }
        }
    }
    let cs = c.stats();
    assert_eq!(cs.copied_bytes, 0, "the zero-copy path copies nothing");
    assert_eq!((cs.errors, cs.bogus), (0, 0));
    let ss = srv.stats();
    assert_eq!((ss.bytes_written, ss.bytes_read), (written, read));
    assert_eq!((ss.errors, ss.refused), (0, 0));
    // The device, read back through the helper (which copies, and says so), and the file.
    let mut all = vec![0u8; size as usize];
    c.read_at(0, &mut all).unwrap();
    assert!(all == model, "the device differs from the model");
    assert_eq!(c.stats().copied_bytes, size);
    assert!(file.bytes() == model, "the file differs from the model");
    let data = filled(9, 0, 300 << 10);
    c.write_at(1 << 20, &data, false).unwrap();
    c.read_at(1 << 20, &mut all[..300 << 10]).unwrap();
    assert!(all[..300 << 10] == data[..]);
    assert_eq!(c.stats().copied_bytes, size + 2 * (300 << 10));
}

/// A scripted server answers 64 reads in reverse order: the client matches them by tag.
/// Then the real server, with 4 workers per session, takes 64 writes and 64 reads in flight
/// (completed in whatever order the workers finish), and a 65th is refused.
fn sixty_four_requests_in_flight_complete_out_of_order() {
    let r = TestRegion::new("blk-qd", 512 << 20);
    let snode = r.node("scripted");
    let l = ZcListener::bind(&snode, "blk/scripted").unwrap();
    let script = std::thread::spawn(move || scripted_reverse_server(&snode, l, 64));
    let node = r.node("client");
    let mut c = BlkClient::connect(&node, "scripted").unwrap();
    assert_eq!(c.info().queue_depth, 64);
    for t in 0..64u64 {
        c.submit_read(t, t * 4096, 4096).unwrap();
    }
    let got = complete_all(&mut c, 64);
    let order: Vec<u64> = got.iter().map(|c| c.tag()).collect();
    assert_eq!(order, (0..64).rev().collect::<Vec<_>>(), "reverse order");
    for comp in &got {
        let want = filled(0, comp.tag() * 4096, 4096);
        assert!(comp.data() == &want[..], "tag {}: wrong data", comp.tag());
    }
    drop(got);
    script.join().unwrap();

    let file = Backing::new("qd", 64 << 20);
    let o = ExportOptions {
        workers: 4,
        ..opts(1 << 20, 64)
    };
    let _srv = BlkServer::export_with(&r.node("server"), "qd", &file.path, o).unwrap();
    let mut c = BlkClient::connect(&node, "qd").unwrap();
    for t in 0..64u64 {
        let mut b = c.write_buf().unwrap();
        fill(t, 0, b.payload_mut(64 << 10).unwrap());
        c.submit_write(t, t << 20, b, false).unwrap();
    }
    assert!(matches!(c.submit_flush(99), Err(BlkError::QueueFull(64))));
    let got = complete_all(&mut c, 64);
    assert!(got.iter().all(|c| c.is_ok()));
    for t in 0..64u64 {
        c.submit_read(1000 + t, t << 20, 64 << 10).unwrap();
    }
    assert_eq!(c.in_flight(), 64);
    let got = complete_all(&mut c, 64);
    assert_eq!(c.outstanding(), 64, "64 reads' buffers held");
    assert!(matches!(c.submit_flush(99), Err(BlkError::QueueFull(64))));
    let mut moved = 0;
    for (i, comp) in got.iter().enumerate() {
        let t = comp.tag() - 1000;
        moved += usize::from(t != i as u64);
        assert!(comp.data() == &filled(t, 0, 64 << 10)[..], "read {t}");
    }
    println!("    ({moved} of 64 reads completed out of submission order with 4 workers)");
    drop(got);
    assert_eq!((c.in_flight(), c.outstanding()), (0, 0));
}

/// The server side of the handshake by hand, then `n` reads answered last first (data:
/// `pattern(0, offset)`).
fn scripted_reverse_server(node: &Node, l: ZcListener, n: usize) {
    let small = Pool::create(node, 64, 8).unwrap();
    let data = Pool::create(node, 64 + 4096, n as u32).unwrap();
    let send = |p: &mut memloop::zerocopy::ZcPort, h: [u8; HEADER_LEN]| {
        let mut b = small.loan().unwrap();
        b[..HEADER_LEN].copy_from_slice(&h);
        b.truncate(HEADER_LEN);
        p.send(b).unwrap();
    };
    let mut req = l.accept().unwrap();
    let h = Hello::decode(req.recv().unwrap().unwrap().bytes()).unwrap();
    assert_eq!(h.role, proto::Role::Requests);
    let info = ExportInfo {
        token: 42,
        size: 1 << 20,
        block_size: 512,
        max_io: 4096,
        queue_depth: n as u32,
        flags: proto::INFO_FLUSH,
    };
    send(&mut req, info.encode());
    let mut comp = l.accept().unwrap();
    let h = Hello::decode(comp.recv().unwrap().unwrap().bytes()).unwrap();
    assert_eq!((h.role, h.token), (proto::Role::Completions, 42));
    send(&mut comp, Ready { token: 42 }.encode());
    let mut reqs = Vec::new();
    while reqs.len() < n {
        let m = req.recv().unwrap().unwrap();
        reqs.push(proto::parse_request(m.bytes(), m.len() as u64, &info).unwrap());
    }
    for r in reqs.iter().rev() {
        let mut b = data.loan().unwrap();
        let h = CompletionHeader {
            tag: r.tag,
            status: 0,
            len: r.len,
            data_off: 64,
        };
        b[..HEADER_LEN].copy_from_slice(&h.encode());
        fill(0, r.offset, &mut b[64..64 + r.len as usize]);
        b.truncate(64 + r.len as usize);
        comp.send(b).unwrap();
    }
    // Until the client has let go of every buffer.
    let deadline = Instant::now() + Duration::from_secs(10);
    while data.free_buffers().unwrap() < n && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn fua_and_flush_complete_and_reach_the_file() {
    let r = TestRegion::new("blk-fua", 128 << 20);
    let file = Backing::new("fua", 1 << 20);
    let srv =
        BlkServer::export_with(&r.node("server"), "fua", &file.path, opts(64 << 10, 8)).unwrap();
    let mut c = BlkClient::connect(&r.node("client"), "fua").unwrap();
    let data = filled(3, 0, 200 << 10);
    c.write_at(4096, &data, true).unwrap();
    let s = srv.stats();
    assert_eq!(s.writes, 4, "200 KiB in 64 KiB requests");
    assert_eq!(s.syncs, 4, "each FUA write synced");
    c.write_at(0, &filled(4, 0, 4096), false).unwrap();
    assert_eq!(srv.stats().syncs, 4, "a plain write is not synced");
    c.flush().unwrap();
    let s = srv.stats();
    assert_eq!((s.flushes, s.syncs), (1, 5));
    let f = file.bytes();
    assert!(f[4096..4096 + data.len()] == data[..]);
    assert!(f[..4096] == filled(4, 0, 4096)[..]);
    // The export stops (not a crash): the client's next request fails with EIO, no hang.
    let t = Instant::now();
    drop(srv);
    let e = c.flush().unwrap_err();
    assert_eq!(e.errno(), errno::EIO, "{e}");
    assert!(t.elapsed() < Duration::from_secs(2));
}

/// A file in memory (/dev/shm) has no volatile cache: its export says flushes are not
/// needed. A file on a disk (this build's target directory) says they are.
fn only_storage_with_a_volatile_cache_asks_for_flushes() {
    let r = TestRegion::new("blk-wc", 128 << 20);
    let shm = PathBuf::from(format!("/dev/shm/memloop-blk-wc-{}", std::process::id()));
    let disk =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("blk-wc-{}", std::process::id()));
    let fs_type = |p: &Path| {
        let out = Command::new("stat")
            .args(["-f", "-c", "%T"])
            .arg(p)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    for (path, needs) in [(&shm, false), (&disk, true)] {
        std::fs::File::create(path)
            .unwrap()
            .set_len(1 << 20)
            .unwrap();
        let fs = fs_type(path);
        if needs && (fs == "tmpfs" || fs == "ramfs") {
            std::fs::remove_file(path).unwrap();
            panic!("the target directory is on {fs}: no disk to check the other case on");
        }
        let name = if needs { "wc-disk" } else { "wc-shm" };
        let srv = BlkServer::export_with(&r.node("server"), name, path, opts(64 << 10, 8)).unwrap();
        let mut c = BlkClient::connect(&r.node("client"), name).unwrap();
        assert_eq!(c.info().needs_flush(), needs, "{} on {fs}", path.display());
        // A flush is still served either way.
        c.flush().unwrap();
        assert_eq!(srv.stats().flushes, 1);
        drop((c, srv));
        std::fs::remove_file(path).unwrap();
    }
}

fn discarded_blocks_read_back_as_zeros() {
    let r = TestRegion::new("blk-discard", 128 << 20);
    let file = Backing::new("discard", 2 << 20);
    let _srv =
        BlkServer::export_with(&r.node("server"), "discard", &file.path, opts(1 << 20, 8)).unwrap();
    let mut c = BlkClient::connect(&r.node("client"), "discard").unwrap();
    assert!(c.info().can_discard());
    let data = filled(5, 0, 1 << 20);
    c.write_at(0, &data, false).unwrap();
    c.discard(256 << 10, 512 << 10).unwrap();
    let mut back = vec![0xffu8; 1 << 20];
    c.read_at(0, &mut back).unwrap();
    assert!(back[..256 << 10] == data[..256 << 10]);
    assert!(back[256 << 10..768 << 10].iter().all(|&b| b == 0), "zeros");
    assert!(back[768 << 10..] == data[768 << 10..]);
    assert!(file.bytes()[..1 << 20] == back[..]);
    // Sizes are the export's: a misaligned or out-of-range discard never leaves the client.
    assert!(matches!(c.discard(100, 512), Err(BlkError::Invalid(_))));
    assert!(matches!(
        c.discard(2 << 20, 512),
        Err(BlkError::Invalid(proto::Invalid::OutOfRange { .. }))
    ));
}

fn a_read_only_export_refuses_writes_with_erofs() {
    let r = TestRegion::new("blk-ro", 128 << 20);
    let file = Backing::new("ro", 1 << 20);
    std::fs::write(&file.path, filled(6, 0, 1 << 20)).unwrap();
    let srv = BlkServer::export(&r.node("server"), "ro", &file.path, true).unwrap();
    let copts = ClientOptions {
        max_io: 128 << 10,
        queue_depth: 8,
        ..ClientOptions::default()
    };
    let mut c = BlkClient::connect_with(&r.node("client"), "ro", copts).unwrap();
    assert!(c.info().read_only());
    assert!(!c.info().can_discard());
    let e = c.write_at(0, &[1u8; 4096], false).unwrap_err();
    assert!(matches!(e, BlkError::Status(errno::EROFS)), "{e}");
    assert_eq!(e.errno(), 30);
    let e = c.discard(0, 4096).unwrap_err();
    assert_eq!(e.errno(), errno::EROFS);
    let mut back = vec![0u8; 256 << 10];
    c.read_at(0, &mut back).unwrap();
    assert!(back[..] == filled(6, 0, 256 << 10)[..]);
    c.flush().unwrap();
    let s = srv.stats();
    assert_eq!(
        (s.errors, s.refused, s.writes, s.bytes_written),
        (2, 0, 0, 0)
    );
    assert!(file.bytes() == filled(6, 0, 1 << 20), "unchanged");
}

fn a_4096_byte_block_export_refuses_512_byte_alignment() {
    let r = TestRegion::new("blk-4k", 64 << 20);
    let file = Backing::new("4k", (1 << 20) + 1000);
    let o = ExportOptions {
        block_size: 4096,
        max_io: 64 << 10,
        queue_depth: 4,
        ..ExportOptions::default()
    };
    let _srv = BlkServer::export_with(&r.node("server"), "4k", &file.path, o).unwrap();
    let mut c = BlkClient::connect(&r.node("client"), "4k").unwrap();
    assert_eq!(
        (c.info().block_size, c.info().size),
        (4096, 1 << 20),
        "tail cut"
    );
    let mut b = vec![0u8; 4096];
    assert!(matches!(
        c.read_at(512, &mut b),
        Err(BlkError::Invalid(proto::Invalid::Misaligned { .. }))
    ));
    assert!(c.read_at(4096, &mut b).is_ok());
    assert!(c.read_at(4096, &mut b[..512]).is_err());
}

/// Bad requests written raw into the request channel: each gets an `EINVAL` completion with
/// its tag (tag 0 when it named none) and counts as refused; a forged descriptor is counted
/// without an answer (it has no tag to answer). Good requests still work after them,
/// including a write whose payload is a second segment.
fn bad_requests_are_refused_with_einval_and_counted() {
    let r = TestRegion::new("blk-bad", 128 << 20);
    let file = Backing::new("bad", 1 << 20);
    let srv =
        BlkServer::export_with(&r.node("server"), "bad", &file.path, opts(64 << 10, 16)).unwrap();
    let node = r.node("raw");
    let small = Pool::create(&node, 64, 32).unwrap();
    let data = Pool::create(&node, 64 + (128 << 10), 4).unwrap();
    let Channels {
        mut requests,
        mut completions,
        info,
    } = open_channels(&node, "bad", &small, 0, 0, Duration::from_secs(5)).unwrap();
    completions.set_timeout(Some(Duration::from_secs(5)));
    let size = info.size;
    let good = RequestHeader {
        op: Op::Read,
        fua: false,
        tag: 0,
        offset: 0,
        len: 4096,
        data_off: 0,
    };
    let w = |tag, offset, len| RequestHeader {
        op: Op::Write,
        tag,
        offset,
        len,
        data_off: 64,
        ..good
    };
    let rd = |tag, offset, len| RequestHeader {
        tag,
        offset,
        len,
        ..good
    };
    let edit = |h: RequestHeader, at: usize, v: u8| {
        let mut b = h.encode().to_vec();
        b[at] = v;
        b
    };
    // (name, header bytes, message length, the tag the refusal should carry)
    let cases: Vec<(&str, Vec<u8>, usize, u64)> = vec![
        ("out of range", rd(1, size, 4096).encode().to_vec(), 64, 1),
        (
            "straddles the end",
            rd(2, size - 512, 1024).encode().to_vec(),
            64,
            2,
        ),
        (
            "misaligned offset",
            rd(3, 100, 4096).encode().to_vec(),
            64,
            3,
        ),
        ("misaligned length", rd(4, 0, 1000).encode().to_vec(), 64, 4),
        (
            "oversized",
            rd(5, 0, (64 << 10) + 512).encode().to_vec(),
            64,
            5,
        ),
        ("zero length", rd(6, 0, 0).encode().to_vec(), 64, 6),
        (
            "overflow",
            rd(7, u64::MAX - 511, 1024).encode().to_vec(),
            64,
            7,
        ),
        ("unknown op", edit(rd(8, 0, 512), 6, 9), 64, 8),
        ("FUA on a read", edit(rd(9, 0, 512), 7, 1), 64, 9),
        ("unknown flag", edit(w(10, 0, 512), 7, 0x80), 64 + 512, 10),
        ("reserved byte", edit(rd(11, 0, 512), 40, 1), 64, 11),
        ("short data", w(12, 0, 4096).encode().to_vec(), 64 + 512, 12),
        (
            "payload in the header",
            RequestHeader {
                data_off: 8,
                ..w(13, 0, 512)
            }
            .encode()
            .to_vec(),
            64 + 512,
            13,
        ),
        (
            "flush with a length",
            RequestHeader {
                op: Op::Flush,
                ..rd(14, 0, 512)
            }
            .encode()
            .to_vec(),
            64,
            14,
        ),
        ("bad magic", edit(rd(15, 0, 512), 0, b'X'), 64, 0),
        ("another version", edit(rd(16, 0, 512), 4, 9), 64, 0),
        ("another kind", edit(rd(17, 0, 512), 5, 4), 64, 0),
        (
            "short header",
            rd(18, 0, 512).encode()[..40].to_vec(),
            40,
            0,
        ),
    ];
    for (i, (what, hdr, len, tag)) in cases.iter().enumerate() {
        let mut b = data.loan().unwrap();
        b[..hdr.len()].copy_from_slice(hdr);
        b[hdr.len()..*len.max(&hdr.len())].fill(0);
        b.truncate(*len.max(&hdr.len()));
        requests.send(b).unwrap();
        let m = completions.recv().unwrap().expect("a completion");
        let c = CompletionHeader::decode(m.bytes()).unwrap();
        assert_eq!(c.status as i32, errno::EINVAL, "{what}");
        assert_eq!(c.tag, *tag, "{what}");
        assert_eq!((c.len, c.data_off), (0, 0), "{what}");
        assert_eq!(srv.stats().refused, i as u64 + 1, "{what} counted");
    }
    let refused = srv.stats().refused;
    // A write whose payload is a segment of its own, then a read of it.
    let mut h = small.loan().unwrap();
    h[..64].copy_from_slice(&w(100, 8192, 4096).encode());
    h.truncate(64);
    let mut p = data.loan().unwrap();
    fill(8, 0, &mut p[..4096]);
    p.truncate(4096);
    requests
        .send(Message::new().loan(h).loan(p).user(1))
        .unwrap();
    let m = completions.recv().unwrap().unwrap();
    assert_eq!(
        CompletionHeader::decode(m.bytes()).unwrap(),
        CompletionHeader::status(100, 0)
    );
    let mut h = small.loan().unwrap();
    h[..64].copy_from_slice(&rd(101, 8192, 4096).encode());
    h.truncate(64);
    requests.send(h).unwrap();
    let m = completions.recv().unwrap().unwrap();
    let c = CompletionHeader::decode(m.bytes()).unwrap();
    assert_eq!((c.tag, c.status, c.len, c.data_off), (101, 0, 4096, 64));
    assert!(m.bytes()[64..64 + 4096] == filled(8, 0, 4096)[..]);
    let s = srv.stats();
    assert_eq!((s.refused, s.errors, s.writes, s.reads), (refused, 0, 1, 1));
    assert_eq!(s.requests, refused + 2, "every request counted");
    // A descriptor naming no pool (pushed raw, so last: the port's producer would not know
    // of it): refused by the zero-copy layer, counted, no answer.
    let reg = r.region.registry();
    let rings = reg
        .rings_of(
            requests.channel(),
            memloop::registry::ChannelKind::DescriptorPair,
        )
        .unwrap();
    let mut raw = SlotProducer::attach(rings.c2s).unwrap();
    let forged = Descriptor {
        pool: 999,
        len: 64,
        ..Descriptor::default()
    };
    assert!(raw.push_desc(&forged).unwrap());
    wait_for(
        "the forged descriptor counted",
        Duration::from_secs(5),
        || srv.stats().refused == refused + 1,
    );
    assert_eq!(srv.stats().errors, 0);
}

/// A server process is SIGKILLed with 32 writes in flight: every request in flight
/// completes with `EIO` within 2 s, new ones fail at once; a new server process exports the
/// same file under the same name, and a new client finds every acknowledged write there.
fn a_server_killed_mid_io_fails_requests_within_2s_and_a_new_export_serves() {
    let r = TestRegion::new("blk-kill-srv", 256 << 20);
    let file = Backing::new("kill-srv", 32 << 20);
    let path = file.path.to_str().unwrap();
    let mut srv = Proc::spawn("server", &r.name, &["ks", path]);
    assert_eq!(srv.line(), "ready");
    let node = r.node("client");
    let mut c = BlkClient::connect(&node, "ks").unwrap();
    let first = filled(1, 0, 1 << 20);
    c.write_at(0, &first, false).unwrap();
    // 64 KiB FUA writes (each synced: the server is busy in them) at block i (16..512),
    // each once: 32 in flight; the kill after 100 acknowledgements.
    let chunk = 64u64 << 10;
    let (mut next, mut acked, mut failed) = (16u64, Vec::new(), 0usize);
    let mut killed: Option<Instant> = None;
    loop {
        // (The client goes on submitting after the kill, as a kernel would: what it sends
        // to the dead server must fail too.)
        while c.in_flight() < 32 && next < 512 {
            let mut b = match c.write_buf() {
                Ok(b) => b,
                Err(BlkError::Disconnected) if killed.is_some() => break,
                Err(e) => panic!("{e}"),
            };
            fill(next, 0, b.payload_mut(chunk as usize).unwrap());
            match c.submit_write(next, next * chunk, b, true) {
                Ok(()) => next += 1,
                Err(BlkError::Disconnected) if killed.is_some() => break,
                Err(e) => panic!("{e}"),
            }
        }
        if killed.is_none() && acked.len() >= 100 {
            assert!(c.in_flight() > 0, "the kill must come mid-I/O");
            srv.kill();
            killed = Some(Instant::now());
        }
        match c.complete(Some(Duration::from_secs(5))) {
            Ok(got) => {
                assert!(!got.is_empty(), "no completion and no error within 5 s");
                for comp in got {
                    match comp.status() {
                        0 => acked.push(comp.tag()),
                        e => {
                            assert_eq!(e, errno::EIO);
                            assert!(killed.is_some(), "an error before the kill");
                            failed += 1;
                        }
                    }
                }
            }
            Err(BlkError::Disconnected) => break,
            Err(e) => panic!("{e}"),
        }
    }
    let took = killed.expect("killed").elapsed();
    assert!(took < Duration::from_secs(2), "errors after {took:?}");
    assert!(failed > 0, "some requests were in flight at the kill");
    assert_eq!(c.in_flight(), 0);
    assert!(matches!(c.submit_flush(1), Err(BlkError::Disconnected)));
    let e = c.read_at(0, &mut [0u8; 4096]).unwrap_err();
    assert_eq!(e.errno(), errno::EIO);
    assert_eq!(srv.wait(Duration::from_secs(5)), -9);
    println!(
        "    ({} acknowledged, {failed} failed with EIO {took:?} after the kill)",
        acked.len()
    );

    // A new export of the same file under the same name; a new client goes on.
    let mut srv2 = Proc::spawn("server", &r.name, &["ks", path]);
    assert_eq!(srv2.line(), "ready");
    let mut c2 = BlkClient::connect(&node, "ks").unwrap();
    let mut back = vec![0u8; 1 << 20];
    c2.read_at(0, &mut back).unwrap();
    assert!(back == first);
    let mut b = vec![0u8; chunk as usize];
    for &t in &acked {
        c2.read_at(t * chunk, &mut b).unwrap();
        assert!(b == filled(t, 0, chunk as usize), "acknowledged write {t}");
    }
    c2.write_at(0, &filled(2, 0, 4096), true).unwrap();
    drop(c2);
    drop(srv2);
}

/// A client process doing I/O (holding some reads' buffers) is SIGKILLed: the server drops
/// its session, another client's I/O goes on throughout, and the region gets back every
/// pool, channel and ring segment the dead client's attachment took.
fn a_killed_client_is_reclaimed_while_others_keep_going() {
    let r = TestRegion::new("blk-kill-cli", 256 << 20);
    let file = Backing::new("kill-cli", 8 << 20);
    let snode = r.node("server");
    let srv = BlkServer::export_with(&snode, "kc", &file.path, opts(128 << 10, 32)).unwrap();
    let node = r.node("survivor");
    let mut c = BlkClient::connect(&node, "kc").unwrap();
    c.write_at(0, &filled(1, 0, 1 << 20), false).unwrap();
    let reg = r.region.registry();
    let base = reg.usage();
    let mut child = Proc::spawn("client", &r.name, &["kc"]);
    assert_eq!(child.line(), "running");
    assert_eq!(srv.stats().sessions_active, 2);
    let grown = reg.usage();
    assert!(grown.pools > base.pools && grown.channels > base.channels);
    child.kill();
    // Our own I/O goes on while the server finds the dead one.
    let mut b = vec![0u8; 1 << 20];
    let mut seed = 10;
    wait_for(
        "the dead client's session gone",
        Duration::from_secs(5),
        || {
            seed += 1;
            c.write_at(2 << 20, &filled(seed, 0, 64 << 10), false)
                .unwrap();
            c.read_at(0, &mut b).unwrap();
            assert!(b == filled(1, 0, 1 << 20));
            srv.stats().sessions_active == 1
        },
    );
    assert_eq!(child.wait(Duration::from_secs(5)), -9);
    wait_for(
        "the region back to its baseline",
        Duration::from_secs(10),
        || {
            snode.reclaim_dead();
            reg.sweep_leftovers();
            let u = reg.usage();
            (u.pools, u.channels, u.segments_used)
                == (base.pools, base.channels, base.segments_used)
        },
    );
    c.write_at(0, &filled(2, 0, 4096), false).unwrap();
    c.read_at(0, &mut b[..4096]).unwrap();
    assert!(b[..4096] == filled(2, 0, 4096)[..]);
    let s = srv.stats();
    assert_eq!((s.sessions_opened, s.errors, s.refused), (2, 0, 0));
}
