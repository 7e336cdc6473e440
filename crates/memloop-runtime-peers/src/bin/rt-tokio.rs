//! `rt-tokio`: the echo server and client of the runtime conformance suite
//! (`tests/runtimes/README.md`) on tokio's multi-thread runtime, configured as `#[tokio::main]`
//! configures it by default (one worker thread per core, the I/O driver on epoll).
//!
//! ```text
//! rt-tokio server --port-file F [--host H] [--deadline S]
//! rt-tokio client --host H --port P --test echo|rr|many [--count N] [--conns N] [--bytes N]
//! ```
//!
//! Protocol (shared by every runtime's programs): a connection's first byte is its command.
//! `E`: the server echoes every following byte until the client's EOF, then closes. `Q`: the
//! server stops listening, closes that connection, waits for its other connections to end,
//! prints `OK server …` and exits 0. The client prints `OK client <test>` and exits 0 when every
//! reply matched byte for byte; anything wrong prints `FAIL …` and exits non-zero. A watchdog
//! ends either role with exit code 3 after `--deadline` seconds (40).

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::task::JoinSet;

/// Message sizes of the `echo` test, one after the other on one connection.
const ECHO_SIZES: [usize; 12] = [
    1,
    2,
    7,
    100,
    1000,
    1460,
    4096,
    65_535,
    65_536,
    100_003,
    262_144,
    1 << 20,
];

struct Args {
    role: String,
    host: String,
    port: u16,
    port_file: Option<String>,
    test: String,
    count: usize,
    conns: usize,
    bytes: usize,
    deadline: u64,
}

fn parse() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let role = it.next().ok_or("usage: rt-tokio server|client [options]")?;
    let mut a = Args {
        role,
        host: "127.0.0.1".into(),
        port: 0,
        port_file: None,
        test: "echo".into(),
        count: 2000,
        conns: 50,
        bytes: 256 << 10,
        deadline: 40,
    };
    while let Some(flag) = it.next() {
        let v = it.next().ok_or(format!("{flag} needs a value"))?;
        let num = |v: &str| v.parse::<u64>().map_err(|e| format!("{flag} {v}: {e}"));
        match flag.as_str() {
            "--host" => a.host = v,
            "--port" => a.port = num(&v)? as u16,
            "--port-file" => a.port_file = Some(v),
            "--test" => a.test = v,
            "--count" => a.count = num(&v)? as usize,
            "--conns" => a.conns = num(&v)? as usize,
            "--bytes" => a.bytes = num(&v)? as usize,
            "--deadline" => a.deadline = num(&v)?,
            _ => return Err(format!("unknown option {flag}")),
        }
    }
    Ok(a)
}

#[tokio::main]
async fn main() {
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            println!("FAIL {e}");
            std::process::exit(2);
        }
    };
    let deadline = a.deadline;
    let role = a.role.clone();
    // A plain thread, so that a wedged runtime cannot keep it from firing.
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(deadline));
        println!("FAIL {role}: watchdog: still running after {deadline} s");
        std::process::exit(3);
    });
    let r = match a.role.as_str() {
        "server" => server(&a).await,
        "client" => client(&a).await,
        other => Err(format!("unknown role {other}")),
    };
    match r {
        Ok(msg) => {
            println!("OK {msg}");
            std::process::exit(0);
        }
        Err(e) => {
            println!("FAIL {}: {e}", a.role);
            std::process::exit(1);
        }
    }
}

// ---- server -------------------------------------------------------------------------------------

#[derive(Default)]
struct Stats {
    conns: AtomicU64,
    bytes: AtomicU64,
    errors: Mutex<Vec<String>>,
}

async fn server(a: &Args) -> Result<String, String> {
    let listener = TcpListener::bind((a.host.as_str(), 0))
        .await
        .map_err(|e| format!("bind {}: {e}", a.host))?;
    let port = listener.local_addr().map_err(|e| e.to_string())?.port();
    let file = a.port_file.as_ref().ok_or("the server needs --port-file")?;
    let tmp = format!("{file}.tmp");
    std::fs::write(&tmp, format!("{port}\n")).map_err(|e| format!("{tmp}: {e}"))?;
    std::fs::rename(&tmp, file).map_err(|e| format!("{file}: {e}"))?;

    let stats = Arc::new(Stats::default());
    let quit = Arc::new(Notify::new());
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            r = listener.accept() => {
                let (s, peer) = r.map_err(|e| format!("accept: {e}"))?;
                stats.conns.fetch_add(1, Ordering::Relaxed);
                let (stats, quit) = (stats.clone(), quit.clone());
                conns.spawn(async move {
                    if let Err(e) = serve(s, &stats, &quit).await {
                        stats.errors.lock().unwrap().push(format!("{peer}: {e}"));
                    }
                });
            }
            _ = quit.notified() => break,
        }
    }
    drop(listener);
    while let Some(r) = conns.join_next().await {
        r.map_err(|e| format!("connection task: {e}"))?;
    }
    let errors = stats.errors.lock().unwrap();
    if !errors.is_empty() {
        return Err(errors.join("; "));
    }
    Ok(format!(
        "server conns={} bytes={}",
        stats.conns.load(Ordering::Relaxed),
        stats.bytes.load(Ordering::Relaxed)
    ))
}

async fn serve(mut s: TcpStream, stats: &Stats, quit: &Notify) -> Result<(), String> {
    s.set_nodelay(true).map_err(|e| e.to_string())?;
    let mut cmd = [0u8; 1];
    s.read_exact(&mut cmd)
        .await
        .map_err(|e| format!("reading the command byte: {e}"))?;
    match cmd[0] {
        b'E' => {
            let (mut r, mut w) = s.split();
            let n = tokio::io::copy(&mut r, &mut w)
                .await
                .map_err(|e| format!("echo: {e}"))?;
            stats.bytes.fetch_add(n, Ordering::Relaxed);
            w.shutdown().await.map_err(|e| format!("shutdown: {e}"))?;
            Ok(())
        }
        b'Q' => {
            quit.notify_one();
            Ok(())
        }
        c => Err(format!("unknown command byte {c:#04x}")),
    }
}

// ---- client -------------------------------------------------------------------------------------

/// Deterministic bytes of message `k` on connection `c` (xorshift64).
fn pattern(c: usize, k: usize, n: usize) -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ ((c as u64) << 32) ^ (k as u64 + 1);
    let mut v = Vec::with_capacity(n + 8);
    while v.len() < n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(n);
    v
}

async fn client(a: &Args) -> Result<String, String> {
    let addr: SocketAddr = format!("{}:{}", a.host, a.port)
        .parse()
        .map_err(|e| format!("address {}:{}: {e}", a.host, a.port))?;
    let plan: Vec<Vec<usize>> = match a.test.as_str() {
        "echo" => vec![ECHO_SIZES.to_vec()],
        "rr" => vec![(0..a.count).map(|i| 1 + (i * 7) % 64).collect()],
        "many" => vec![vec![a.bytes]; a.conns],
        t => return Err(format!("unknown test {t}")),
    };
    let mut set = JoinSet::new();
    for (c, sizes) in plan.into_iter().enumerate() {
        set.spawn(async move { (c, exchange(addr, c, &sizes).await) });
    }
    let mut errors = Vec::new();
    let mut done = 0;
    while let Some(r) = set.join_next().await {
        match r {
            Ok((_, Ok(()))) => done += 1,
            Ok((c, Err(e))) => errors.push(format!("connection {c}: {e}")),
            Err(e) => errors.push(format!("task: {e}")),
        }
    }
    let q = quit(addr).await;
    if !errors.is_empty() {
        return Err(format!("{} ({done} connection(s) fine)", errors.join("; ")));
    }
    q.map_err(|e| format!("quit: {e}"))?;
    Ok(format!("client {}", a.test))
}

/// One echo connection: each message is written while its reply is read, the reply must equal
/// it; then a half-close, and the server's EOF must follow with nothing before it.
async fn exchange(addr: SocketAddr, c: usize, sizes: &[usize]) -> Result<(), String> {
    let mut s = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    s.set_nodelay(true).map_err(|e| e.to_string())?;
    s.write_all(b"E").await.map_err(|e| format!("write: {e}"))?;
    let (mut r, mut w) = s.split();
    for (k, &n) in sizes.iter().enumerate() {
        let msg = pattern(c, k, n);
        let mut got = vec![0u8; n];
        let (wr, rd) = tokio::join!(w.write_all(&msg), r.read_exact(&mut got));
        wr.map_err(|e| format!("message {k} ({n} B): write: {e}"))?;
        rd.map_err(|e| format!("message {k} ({n} B): read: {e}"))?;
        if got != msg {
            let at = got.iter().zip(&msg).position(|(a, b)| a != b).unwrap_or(0);
            return Err(format!(
                "message {k} ({n} B): reply differs from byte {at} on"
            ));
        }
    }
    w.shutdown().await.map_err(|e| format!("shutdown: {e}"))?;
    let mut extra = [0u8; 64];
    match r.read(&mut extra).await {
        Ok(0) => Ok(()),
        Ok(n) => Err(format!("{n} unexpected byte(s) after the last reply")),
        Err(e) => Err(format!("waiting for EOF: {e}")),
    }
}

async fn quit(addr: SocketAddr) -> Result<(), String> {
    let go = async {
        let mut s = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        s.write_all(b"Q").await.map_err(|e| format!("write: {e}"))?;
        let mut buf = [0u8; 16];
        match s.read(&mut buf).await {
            Ok(0) => Ok(()),
            Ok(n) => Err(format!("{n} unexpected byte(s)")),
            Err(e) => Err(format!("waiting for EOF: {e}")),
        }
    };
    tokio::time::timeout(Duration::from_secs(10), go)
        .await
        .map_err(|_| "no EOF within 10 s".to_string())?
}
