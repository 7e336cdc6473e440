//! The pipe service in-process with real descriptors: files, TCP and Unix sockets, pipes,
//! character devices. Each test starts its own service on its own socket.

use memloop_pipe::client::Client;
use memloop_pipe::service::{Config, Service};
use memloop_pipe::transfer::Primitive;
use memloop_pipe::PipeError;
use std::io::{Read, Seek, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::time::{Duration, Instant};

fn service(tag: &str, f: impl FnOnce(&mut Config)) -> (Service, PathBuf) {
    let path = std::env::temp_dir().join(format!("memloop-pipe-test-{tag}-{}", std::process::id()));
    let mut cfg = Config::new(path.clone());
    f(&mut cfg);
    (Service::start(cfg).expect("service"), path)
}

fn data(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn temp_file(tag: &str, bytes: &[u8]) -> std::fs::File {
    let p = std::env::temp_dir().join(format!("memloop-pipe-{tag}-{}", std::process::id()));
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&p)
        .unwrap();
    std::fs::remove_file(&p).unwrap();
    f.write_all(bytes).unwrap();
    f.rewind().unwrap();
    f
}

fn stats(c: &mut Client) -> serde_json::Value {
    serde_json::from_str(&c.stats().unwrap()).unwrap()
}

#[test]
fn a_file_reaches_a_tcp_socket_whole_and_the_file_offset_moves() {
    let (_svc, path) = service("file-tcp", |_| {});
    let want = data(8 << 20, 1);
    let src = temp_file("file-tcp", &want);
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let out = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (mut inp, _) = l.accept().unwrap();
    let reader = std::thread::spawn(move || {
        let mut got = Vec::new();
        inp.read_to_end(&mut got).unwrap();
        got
    });
    let mut c = Client::connect(&path, Some("t"), 1).unwrap();
    let moved = c.pipe(src.as_fd(), out.as_fd(), None).unwrap();
    drop(out);
    assert_eq!(moved, want.len() as u64);
    assert!(reader.join().unwrap() == want, "the bytes arrive intact");
    let mut f = src;
    assert_eq!(f.stream_position().unwrap(), want.len() as u64, "offset");
}

/// `submit_at`: the service reads the file from the offset given, the client's file position
/// stays where it was, and an offset on a pipe is refused with `EBADF`.
#[test]
fn submit_at_reads_from_the_offset_and_leaves_the_file_position() {
    let (_svc, path) = service("submit-at", |_| {});
    let want = data(5 << 20, 7);
    let mut src = temp_file("submit-at", &want);
    src.seek(std::io::SeekFrom::Start(77)).unwrap();
    let (out, mut inp) = std::os::unix::net::UnixStream::pair().unwrap();
    let reader = std::thread::spawn(move || {
        let mut got = Vec::new();
        inp.read_to_end(&mut got).unwrap();
        got
    });
    let mut c = Client::connect(&path, Some("at"), 1).unwrap();
    let off = 1_000_003u64;
    let id = c
        .submit_at(src.as_fd(), out.as_fd(), Some(3 << 20), Some(off))
        .unwrap();
    let done = c.wait_for(id).unwrap();
    done.result.unwrap();
    assert_eq!(done.moved, 3 << 20);
    assert_eq!(done.primitive, Some(Primitive::Sendfile));
    drop(out);
    let got = reader.join().unwrap();
    assert!(
        got == want[off as usize..off as usize + (3 << 20)],
        "the bytes from the offset on"
    );
    assert_eq!(
        src.stream_position().unwrap(),
        77,
        "file position untouched"
    );
    let (r, w) = rustix::pipe::pipe().unwrap();
    let id = c.submit_at(r.as_fd(), w.as_fd(), None, Some(0)).unwrap();
    match c.wait_for(id).unwrap().result {
        Err(PipeError::Io(e)) => assert_eq!(
            e.raw_os_error(),
            Some(rustix::io::Errno::BADF.raw_os_error()),
            "{e}"
        ),
        r => panic!("an offset on a pipe: {r:?}"),
    }
}

#[test]
fn a_socket_relay_moves_everything_and_reports_splice() {
    let (_svc, path) = service("relay", |_| {});
    let want = data(16 << 20, 2);
    let (mut feed, from) = std::os::unix::net::UnixStream::pair().unwrap();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let to = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (mut drain, _) = l.accept().unwrap();
    let w = want.clone();
    let feeder = std::thread::spawn(move || {
        for c in w.chunks(100_000) {
            feed.write_all(c).unwrap();
        }
    });
    let reader = std::thread::spawn(move || {
        let mut got = Vec::new();
        drain.read_to_end(&mut got).unwrap();
        got
    });
    let mut c = Client::connect(&path, Some("relay"), 1).unwrap();
    let id = c.submit(from.as_fd(), to.as_fd(), None).unwrap();
    feeder.join().unwrap();
    let done = c.wait_for(id).unwrap();
    done.result.unwrap();
    drop(to);
    assert_eq!(done.moved, want.len() as u64);
    assert_eq!(done.primitive, Some(Primitive::SpliceViaPipe));
    assert!(reader.join().unwrap() == want, "relayed bytes intact");
}

#[test]
fn bad_descriptors_and_lengths_get_clear_errors() {
    let (_svc, path) = service("bad", |_| {});
    let mut c = Client::connect(&path, Some("bad"), 1).unwrap();
    let dir = std::fs::File::open("/").unwrap();
    let null = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/null")
        .unwrap();
    let err = c.pipe(dir.as_fd(), null.as_fd(), None).unwrap_err();
    assert_eq!(
        err.errno(),
        libc_errno::EBADF,
        "a directory as source: {err}"
    );
    let wo = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/null")
        .unwrap();
    let err = c.pipe(wo.as_fd(), null.as_fd(), None).unwrap_err();
    assert_eq!(err.errno(), libc_errno::EBADF, "a write-only source: {err}");
    assert!(matches!(
        c.pipe(null.as_fd(), null.as_fd(), Some(0)),
        Err(PipeError::BadLength(0))
    ));
    // The connection is still good after refusals.
    let src = temp_file("bad", b"fine");
    assert_eq!(c.pipe(src.as_fd(), null.as_fd(), None).unwrap(), 4);
}

mod libc_errno {
    pub const EBADF: i32 = 9;
}

#[test]
fn a_client_that_goes_away_has_its_transfers_cancelled_and_descriptors_closed() {
    let (_svc, path) = service("gone", |_| {});
    // A relay whose source never sends: the transfer waits (parked) until its client goes.
    let (_quiet, from) = std::os::unix::net::UnixStream::pair().unwrap();
    let (to, mut far) = std::os::unix::net::UnixStream::pair().unwrap();
    let mut c = Client::connect(&path, Some("gone"), 1).unwrap();
    c.submit(from.as_fd(), to.as_fd(), None).unwrap();
    drop((from, to)); // only the service holds them now
    let mut watcher = Client::connect(&path, Some("watcher"), 1).unwrap();
    wait_until("the transfer parked", || stats(&mut watcher)["parked"] == 1);
    drop(c);
    far.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut b = [0u8; 1];
    assert_eq!(
        far.read(&mut b).unwrap(),
        0,
        "the sink is closed: EOF, not a hang"
    );
    let s = stats(&mut watcher);
    assert_eq!(s["transfers"], 0);
    assert_eq!(s["totals"]["cancelled"], 1);
}

#[test]
fn a_cancelled_transfer_says_so_and_others_go_on() {
    let (_svc, path) = service("cancel", |_| {});
    let (_quiet, from) = std::os::unix::net::UnixStream::pair().unwrap();
    let null = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/null")
        .unwrap();
    let mut c = Client::connect(&path, Some("cancel"), 1).unwrap();
    let stuck = c.submit(from.as_fd(), null.as_fd(), None).unwrap();
    let src = temp_file("cancel", &data(1 << 20, 3));
    let ok = c.submit(src.as_fd(), null.as_fd(), None).unwrap();
    assert_eq!(c.wait_for(ok).unwrap().moved, 1 << 20);
    c.cancel(stuck).unwrap();
    let d = c.wait_for(stuck).unwrap();
    assert!(
        matches!(d.result, Err(PipeError::Cancelled)),
        "{:?}",
        d.result
    );
}

#[test]
fn a_client_at_its_limit_is_pushed_back_not_queued() {
    let (_svc, path) = service("push", |c| c.max_inflight = 2);
    let null = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/null")
        .unwrap();
    let mut feeds = Vec::new();
    let mut c = Client::connect(&path, Some("push"), 1).unwrap();
    for _ in 0..6 {
        let (feed, from) = std::os::unix::net::UnixStream::pair().unwrap();
        c.submit(from.as_fd(), null.as_fd(), None).unwrap();
        feeds.push(feed);
    }
    let mut watcher = Client::connect(&path, Some("watcher"), 1).unwrap();
    wait_until("two transfers taken", || {
        stats(&mut watcher)["transfers"] == 2
    });
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        stats(&mut watcher)["transfers"],
        2,
        "never more than the limit"
    );
    drop(feeds); // every source ends: each transfer completes, the next ones are read
    for _ in 0..6 {
        let d = c.completion(true).unwrap().unwrap();
        d.result.unwrap();
    }
}

#[test]
fn tenants_share_a_saturated_service_by_weight_and_a_leaver_frees_its_share() {
    let (_svc, path) = service("fair", |c| c.workers = 1);
    let weights = [1u16, 2, 4];
    let mut clients: Vec<Client> = weights
        .iter()
        .map(|&w| Client::connect(&path, Some(&format!("w{w}")), w).unwrap())
        .collect();
    let zero = std::fs::File::open("/dev/zero").unwrap();
    let null = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/null")
        .unwrap();
    let ids: Vec<u64> = clients
        .iter_mut()
        .map(|c| c.submit(zero.as_fd(), null.as_fd(), Some(1 << 50)).unwrap())
        .collect();
    let mut watcher = Client::connect(&path, Some("watcher"), 1).unwrap();
    let bytes = |w: &mut Client| -> Vec<f64> {
        let s = stats(w);
        ["w1", "w2", "w4"]
            .iter()
            .map(|n| {
                let t = s["tenants"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|t| t["name"] == *n);
                t.map_or(0.0, |t| t["bytes"].as_f64().unwrap())
            })
            .collect()
    };
    std::thread::sleep(Duration::from_millis(200));
    let a = bytes(&mut watcher);
    std::thread::sleep(Duration::from_secs(1));
    let b = bytes(&mut watcher);
    let d: Vec<f64> = a.iter().zip(&b).map(|(a, b)| b - a).collect();
    let total: f64 = d.iter().sum();
    for (i, w) in weights.iter().enumerate() {
        let share = d[i] / total;
        let want = *w as f64 / 7.0;
        assert!(
            (share - want).abs() <= 0.1 * want,
            "tenant w{w}: share {share:.3}, want {want:.3} ({d:?})"
        );
    }
    // w4 leaves: w1 and w2 split the service 1:2.
    clients[2].cancel(ids[2]).unwrap();
    assert!(matches!(
        clients[2].wait_for(ids[2]).unwrap().result,
        Err(PipeError::Cancelled)
    ));
    let a = bytes(&mut watcher);
    std::thread::sleep(Duration::from_millis(700));
    let b = bytes(&mut watcher);
    let (x, y) = (b[0] - a[0], b[1] - a[1]);
    let share = x / (x + y);
    assert!(
        (share - 1.0 / 3.0).abs() <= 0.1 / 3.0,
        "after the leave: w1 {share:.3} of the two"
    );
}

fn wait_until(what: &str, mut ok: impl FnMut() -> bool) {
    let t = Instant::now();
    while !ok() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A relay cancelled while its own pipe holds bytes taken from the source still delivers
/// them: every byte fed is either in the sink or still unread in the source — none lost.
#[test]
fn a_cancelled_relay_delivers_what_it_took_from_its_source() {
    use std::os::unix::net::UnixStream;
    let (_svc, path) = service("drain", |_| {});
    let (mut feed, from) = UnixStream::pair().unwrap();
    let (to, mut sink) = UnixStream::pair().unwrap();
    feed.set_nonblocking(true).unwrap();
    let chunk = data(64 << 10, 9);
    let mut c = Client::connect(&path, Some("drain"), 1).unwrap();
    let id = c.submit(from.as_fd(), to.as_fd(), None).unwrap();
    let mut watcher = Client::connect(&path, Some("watcher"), 1).unwrap();
    // Fill everything: the sink's buffer, the service's pipe, the source's buffer.
    let mut fed = 0usize;
    let t = Instant::now();
    loop {
        match feed.write(&chunk) {
            Ok(n) => fed += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if stats(&mut watcher)["parked"] == 1 {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("{e}"),
        }
        assert!(t.elapsed() < Duration::from_secs(10), "never parked");
    }
    c.cancel(id).unwrap();
    sink.set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let reader = std::thread::spawn(move || {
        let (mut got, mut b) = (0usize, vec![0u8; 1 << 20]);
        while let Ok(n) = sink.read(&mut b) {
            if n == 0 {
                break;
            }
            got += n;
        }
        got
    });
    let done = c.wait_for(id).unwrap();
    assert!(
        matches!(done.result, Err(PipeError::Cancelled)),
        "{:?}",
        done.result
    );
    let delivered = reader.join().unwrap();
    assert_eq!(
        delivered as u64, done.moved,
        "the completion counts what the sink got"
    );
    let mut left = 0usize;
    let mut b = vec![0u8; 1 << 20];
    from.set_nonblocking(true).unwrap();
    while let Ok(n) = (&from).read(&mut b) {
        left += n;
    }
    assert_eq!(
        delivered + left,
        fed,
        "fed {fed}: {delivered} delivered, {left} unread"
    );
}
