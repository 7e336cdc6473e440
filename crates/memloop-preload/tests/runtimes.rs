//! Real event-loop runtimes under the preload library (issue 10): for each runtime an echo
//! server and a client written as that runtime's programs usually are (`tests/runtimes/`,
//! README there), in its usual configuration — tokio's multi-thread runtime, a libuv loop (also
//! nested in an outer `poll()` or epoll set, as toolkits embed it), a Boost.Asio io_context run
//! from four threads, asyncio (and uvloop), JDK NIO.2 with a fixed thread pool group against
//! classic NIO with a selector per worker thread, Node.js `net`. Each test runs one client test
//! (`echo`: sizes 1 B–1 MiB; `rr`: 2000 round trips; `many`: 50 concurrent streams) between a
//! server and a client, first on kernel TCP (the reference: both must say OK), then twice with
//! both under `libmemloop_preload.so`, each time in a fresh region, where both must say OK
//! again, neither may die of a signal (a SIGSEGV is named as such), and the server's debug log
//! must show every connection accepted on a ring (uvloop: see below).
//!
//! ```sh
//! tests/runtimes/build.sh          # toolchains (apt-get, pip) and programs → target/runtimes
//! cargo build --release -p memloop-preload
//! cargo test --release -p memloop-preload --test runtimes               # fast tier
//! cargo test --release -p memloop-preload --test runtimes -- --ignored  # slow tier:
//!                                  # cross pairs with tokio and libuv, larger runs, repeated runs
//! ```
//!
//! uvloop's connections stay on TCP by design (its libuv uses io_uring; see `tcp_fallback`):
//! its pairings check that everything still works, not that rings were used.
//!
//! A runtime whose program or toolchain is missing fails its tests with the reason when `CI` is
//! set, and is reported ignored with the reason by the test runner otherwise. `MEMLOOP_RUNTIMES_DIR` says where
//! the built programs are (default `target/runtimes`); `MEMLOOP_PRELOAD_LIB` which library.

mod support;

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};
use support::{
    death_signal, describe, env_prefix, find_artifact, not_started, profile_dir, signal_name,
    spawn, wait_bounded, wait_for_port, workspace, Outcome, RegionGuard, Scratch,
};

fn main() -> std::process::ExitCode {
    use memloop_testkit::test;
    let mut tests = same_runtime_tests();
    tests.extend([
        test!(cross_runtimes_with_tokio)
            .ignore("slow: 36 cross-runtime pairings, kernel and preload each")
            .needs(runnable(&ALL)),
        test!(cross_runtimes_with_libuv)
            .ignore("slow: 36 cross-runtime pairings, kernel and preload each")
            .needs(runnable(&ALL)),
        test!(larger_runs_every_runtime)
            .ignore("slow: 20 000 round trips and 100 × 1 MiB streams per runtime")
            .needs(runnable(&ALL)),
        test!(repeated_runs_every_runtime)
            .ignore("slow: 5 preload runs of each runtime's three tests")
            .needs(runnable(&ALL)),
        test!(every_runtime_is_found_or_explained).needs(runnable(&ALL)),
    ]);
    memloop_testkit::run(tests)
}

/// Seconds a program may run under `timeout` (its own watchdog fires at `DEADLINE`).
const PROCESS_TIMEOUT: u64 = 60;
const DEADLINE: u64 = 40;
/// Regions of 512 MiB: 101 channels of 2 × 1 MiB rings (the larger `many`) fit with room to
/// spare; tmpfs pages cost memory only when touched.
const REGION_SIZE: usize = 512 << 20;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Rt {
    Tokio,
    Libuv,
    /// The libuv loop nested in an outer `poll()` on its backend epoll fd.
    LibuvInPoll,
    /// The libuv loop nested in an outer epoll set.
    LibuvInEpoll,
    Asio,
    Asyncio,
    Uvloop,
    JavaNio,
    Node,
}

const ALL: [Rt; 9] = [
    Rt::Tokio,
    Rt::Libuv,
    Rt::LibuvInPoll,
    Rt::LibuvInEpoll,
    Rt::Asio,
    Rt::Asyncio,
    Rt::Uvloop,
    Rt::JavaNio,
    Rt::Node,
];

/// How to start one runtime's program: `prefix ROLE ARGS… suffix`.
#[derive(Clone)]
struct Launch {
    prefix: Vec<String>,
    suffix: Vec<String>,
}

fn runtimes_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("MEMLOOP_RUNTIMES_DIR") {
        return PathBuf::from(d);
    }
    profile_dir()
        .and_then(|p| p.parent().map(|t| t.join("runtimes")))
        .filter(|d| d.exists())
        .unwrap_or_else(|| workspace().join("target/runtimes"))
}

fn sources() -> PathBuf {
    workspace().join("tests/runtimes")
}

/// `cmd args…` ran and exited 0.
fn runs(cmd: &str, args: &[&str]) -> bool {
    Command::new(cmd)
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

fn s(v: &str) -> String {
    v.to_string()
}

impl Rt {
    fn name(self) -> &'static str {
        match self {
            Rt::Tokio => "tokio",
            Rt::Libuv => "libuv",
            Rt::LibuvInPoll => "libuv-in-poll",
            Rt::LibuvInEpoll => "libuv-in-epoll",
            Rt::Asio => "asio",
            Rt::Asyncio => "asyncio",
            Rt::Uvloop => "uvloop",
            Rt::JavaNio => "java-nio",
            Rt::Node => "node",
        }
    }

    /// The fallback this runtime's connections take by design, as the library logs it: uvloop's
    /// own libuv (1.52 in uvloop 0.23) registers fds in its epoll set through io_uring
    /// (`IORING_OP_EPOLL_CTL`), which no hook sees, so the library keeps the connections of a
    /// process that set up io_uring on TCP. Such a pairing must still work, over TCP.
    fn tcp_fallback(self) -> Option<&'static str> {
        match self {
            Rt::Uvloop => Some("io_uring in use"),
            _ => None,
        }
    }

    /// A variant of another runtime's program (its loop nested in an outer one).
    fn nested(self) -> bool {
        matches!(self, Rt::LibuvInPoll | Rt::LibuvInEpoll)
    }

    /// Where the program is and how to start it, or why it cannot be.
    fn locate(self) -> Result<Launch, String> {
        let build = "run tests/runtimes/build.sh";
        let dir = runtimes_dir();
        let file = |p: PathBuf| -> Result<String, String> {
            if p.exists() {
                Ok(p.display().to_string())
            } else {
                Err(format!("{} is missing ({build})", p.display()))
            }
        };
        let tool = |t: &str, args: &[&str]| -> Result<(), String> {
            if runs(t, args) {
                Ok(())
            } else {
                Err(format!("`{t}` is not installed ({build})"))
            }
        };
        let plain = |prefix: Vec<String>| Launch {
            prefix,
            suffix: vec![],
        };
        Ok(match self {
            Rt::Tokio => {
                let p = find_artifact("MEMLOOP_RT_TOKIO", "rt-tokio").ok_or(format!(
                    "rt-tokio is missing (cargo build --release -p memloop-runtime-peers, or {build})"
                ))?;
                plain(vec![p.display().to_string()])
            }
            Rt::Libuv => plain(vec![file(dir.join("uv_echo"))?]),
            Rt::LibuvInPoll | Rt::LibuvInEpoll => Launch {
                prefix: vec![file(dir.join("uv_echo"))?],
                suffix: vec![
                    s("--embed"),
                    s(if self == Rt::LibuvInPoll {
                        "poll"
                    } else {
                        "epoll"
                    }),
                ],
            },
            Rt::Asio => plain(vec![file(dir.join("asio_echo"))?]),
            Rt::Asyncio | Rt::Uvloop => {
                tool("python3", &["--version"])?;
                let script = file(sources().join("python/aio_echo.py"))?;
                let loop_ = if self == Rt::Uvloop {
                    if !runs("python3", &["-c", "import uvloop"]) {
                        return Err(format!("python3 cannot import uvloop ({build})"));
                    }
                    "uvloop"
                } else {
                    "asyncio"
                };
                Launch {
                    prefix: vec![s("python3"), script],
                    suffix: vec![s("--loop"), s(loop_)],
                }
            }
            Rt::JavaNio => {
                tool("java", &["-version"])?;
                file(dir.join("java/NioEcho.class"))?;
                plain(vec![
                    s("java"),
                    // A quick start: the programs are small and short-lived.
                    s("-XX:+UseSerialGC"),
                    s("-XX:TieredStopAtLevel=1"),
                    s("-cp"),
                    dir.join("java").display().to_string(),
                    s("NioEcho"),
                ])
            }
            Rt::Node => {
                tool("node", &["--version"])?;
                plain(vec![s("node"), file(sources().join("node/echo.js"))?])
            }
        })
    }
}

/// Where each runtime's program is, or why it cannot run here (looked up once).
fn located(rt: Rt) -> Result<Launch, String> {
    static CACHE: OnceLock<Vec<(Rt, Result<Launch, String>)>> = OnceLock::new();
    let all = CACHE.get_or_init(|| ALL.iter().map(|&r| (r, r.locate())).collect());
    let found = all.iter().find(|(r, _)| *r == rt).map(|(_, l)| l.clone());
    found.expect("every runtime is listed")
}

/// What a test of these runtimes needs: every one of them runnable here (all reasons if not).
fn runnable(rts: &[Rt]) -> memloop_testkit::Need {
    let missing: Vec<String> = rts
        .iter()
        .filter_map(|&rt| {
            located(rt)
                .err()
                .map(|why| format!("runtime {}: {why}", rt.name()))
        })
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(missing.join("; "))
    }
}

/// The runtime's program; its test declared it with [`runnable`], so it is there.
fn launch(rt: Rt) -> Launch {
    located(rt).unwrap_or_else(|why| panic!("runtime {} cannot run: {why}", rt.name()))
}

// ---- one run ----------------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Kernel,
    Preload,
}

/// A client test with its options.
#[derive(Clone, Copy)]
struct Test {
    name: &'static str,
    /// Connections the test opens (besides the final quit connection).
    conns: usize,
    /// Extra client options (larger variants).
    extra: &'static [&'static str],
}

const ECHO: Test = Test {
    name: "echo",
    conns: 1,
    extra: &[],
};
const RR: Test = Test {
    name: "rr",
    conns: 1,
    extra: &[],
};
const MANY: Test = Test {
    name: "many",
    conns: 50,
    extra: &[],
};

fn role_cmd(
    l: &Launch,
    mode: Mode,
    region: Option<&str>,
    role: &str,
    args: Vec<String>,
) -> Vec<String> {
    let preload = (mode == Mode::Preload).then(|| region.expect("region"));
    let mut v = env_prefix(PROCESS_TIMEOUT, preload);
    v.extend(l.prefix.iter().cloned());
    v.push(s(role));
    v.extend(args);
    v.extend(["--deadline".into(), DEADLINE.to_string()]);
    v.extend(l.suffix.iter().cloned());
    v
}

/// The server, then (once it published its port) the client.
fn run_pair(
    server: &Launch,
    client: &Launch,
    t: &Test,
    mode: Mode,
    region: Option<&str>,
) -> Outcome {
    let scratch = Scratch::new("runtimes", t.name);
    let dir = &scratch.0;
    let port_file = dir.join("port");
    let scmd = role_cmd(
        server,
        mode,
        region,
        "server",
        vec![
            s("--host"),
            s("127.0.0.1"),
            s("--port-file"),
            port_file.display().to_string(),
        ],
    );
    let mut srv = spawn(&scmd, &dir.join("s.out"), &dir.join("s.err"));
    let port = wait_for_port(&mut srv, &port_file, Duration::from_secs(30));
    let client_status = match port {
        Some(port) => {
            let mut args = vec![
                s("--host"),
                s("127.0.0.1"),
                s("--port"),
                port.to_string(),
                s("--test"),
                s(t.name),
            ];
            args.extend(t.extra.iter().map(|e| e.to_string()));
            let ccmd = role_cmd(client, mode, region, "client", args);
            let mut c = spawn(&ccmd, &dir.join("c.out"), &dir.join("c.err"));
            wait_bounded(&mut c, Duration::from_secs(PROCESS_TIMEOUT + 10))
        }
        None => not_started(),
    };
    // Once the client is done the server has little left to do: do not wait out its watchdog.
    let server_status = wait_bounded(&mut srv, Duration::from_secs(15));
    let read = |n: &str| std::fs::read_to_string(dir.join(n)).unwrap_or_default();
    Outcome {
        server: server_status,
        client: client_status,
        server_out: read("s.out"),
        server_err: read("s.err"),
        client_out: read("c.out"),
        client_err: read("c.err"),
    }
}

/// What went wrong in one run, as one line each; empty when both ends said OK (and, under the
/// preload, every connection went over a ring).
///
/// `fallback`: a reason for staying on TCP that one of the runtimes has by design; when a log
/// gives it, the connections may stay on TCP (the programs must still say OK).
fn problems(o: &Outcome, t: &Test, mode: Mode, fallback: Option<&str>) -> Vec<String> {
    let mut p = Vec::new();
    for (who, st, out) in [
        ("server", &o.server, &o.server_out),
        ("client", &o.client, &o.client_out),
    ] {
        if let Some(sig) = death_signal(st) {
            p.push(format!(
                "the {who} died of {} (signal {sig}){}",
                signal_name(sig),
                if sig == libc::SIGSEGV {
                    ": a crash"
                } else {
                    ""
                }
            ));
        } else if !st.success() {
            let said = out
                .lines()
                .find(|l| l.starts_with("FAIL"))
                .unwrap_or("no FAIL line");
            p.push(format!("the {who} ended with {}: {said}", describe(st)));
        }
    }
    if o.client.success() && !o.client_out.contains(&format!("OK client {}", t.name)) {
        p.push(format!("the client did not print \"OK client {}\"", t.name));
    }
    if o.server.success() && !o.server_out.contains("OK server") {
        p.push("the server did not print \"OK server\"".into());
    }
    let fell_back = fallback.is_some_and(|r| o.server_err.contains(r) || o.client_err.contains(r));
    if mode == Mode::Preload && !fell_back {
        let want = t.conns + 1;
        let accepted = o.server_err.matches("accepted on a ring").count();
        if accepted < want {
            p.push(format!(
                "the server accepted {accepted} connection(s) on rings, want {want} \
                 ({} for the test and the quit connection)",
                t.conns
            ));
        }
        for (who, log) in [("server", &o.server_err), ("client", &o.client_err)] {
            for bad in ["stays on TCP", "no ring offered"] {
                if log.contains(bad) {
                    p.push(format!("the {who}'s log says {bad:?}"));
                }
            }
        }
    }
    if mode == Mode::Preload {
        for (who, log) in [("server", &o.server_err), ("client", &o.client_err)] {
            for bad in ["panicked", "ring error"] {
                if log.contains(bad) {
                    p.push(format!("the {who}'s log says {bad:?}"));
                }
            }
        }
    }
    p
}

/// `client` against `server` on kernel TCP (must pass: the reference), then under the preload
/// `runs` times, each in a fresh region. Returns the failures (empty: all passed).
fn pair(server: Rt, client: Rt, t: &Test, runs: usize) -> Vec<String> {
    let (sl, cl) = (launch(server), launch(client));
    let label = format!(
        "{} client → {} server, test {}{}",
        client.name(),
        server.name(),
        t.name,
        if t.extra.is_empty() {
            String::new()
        } else {
            format!(" {}", t.extra.join(" "))
        }
    );
    let fallback = server.tcp_fallback().or(client.tcp_fallback());
    let t0 = Instant::now();
    let kernel = run_pair(&sl, &cl, t, Mode::Kernel, None);
    let p = problems(&kernel, t, Mode::Kernel, None);
    if !p.is_empty() {
        return vec![kernel.report(&format!(
            "{label} on kernel TCP (the reference) failed: {}",
            p.join("; ")
        ))];
    }
    let t1 = Instant::now();
    let mut failures = Vec::new();
    for i in 0..runs {
        let region = RegionGuard::new("rt", t.name, REGION_SIZE);
        let o = run_pair(&sl, &cl, t, Mode::Preload, Some(&region.0));
        let p = problems(&o, t, Mode::Preload, fallback);
        if !p.is_empty() {
            failures.push(o.report(&format!(
                "{label} under the preload (run {} of {runs}) failed: {}",
                i + 1,
                p.join("; ")
            )));
            break;
        }
    }
    eprintln!(
        "{label}: kernel {:.2} s, preload {:.2} s{}{}",
        (t1 - t0).as_secs_f64(),
        t1.elapsed().as_secs_f64(),
        fallback.map_or(String::new(), |r| format!(" (TCP allowed: {r})")),
        if failures.is_empty() { "" } else { " FAILED" }
    );
    failures
}

/// The pairs, each checked; fails with every failure's report.
fn check_pairs(pairs: &[(Rt, Rt, Test)], runs: usize) {
    let mut failures = Vec::new();
    let mut summary = Vec::new();
    for (server, client, t) in pairs {
        let f = pair(*server, *client, t, runs);
        summary.push(format!(
            "{:>8} client → {:<8} server {:<5} {}",
            client.name(),
            server.name(),
            t.name,
            if f.is_empty() { "ok" } else { "FAILED" }
        ));
        failures.extend(f);
    }
    assert!(
        failures.is_empty(),
        "{} of {} pairing(s) failed:\n{}\n\n{}",
        failures.len(),
        pairs.len(),
        summary.join("\n"),
        failures.join("\n\n======\n\n")
    );
}

/// Preload runs of each fast test: the bugs this suite has caught so far were races that showed
/// in a third to two thirds of the runs; a second run costs a few seconds.
const FAST_RUNS: usize = 2;

/// A runtime's client against its own server.
fn check(rt: Rt, t: Test) {
    check_pairs(&[(rt, rt, t)], FAST_RUNS);
}

// ---- fast tier: each runtime against itself ---------------------------------------------------

macro_rules! same_runtime {
    ($($name:ident: $rt:expr, $t:expr;)*) => {
        fn same_runtime_tests() -> Vec<memloop_testkit::Test> {
            vec![$(
                memloop_testkit::Test::new(stringify!($name), || check($rt, $t))
                    .needs(runnable(&[$rt])),
            )*]
        }
    };
}

same_runtime! {
    tokio_echo: Rt::Tokio, ECHO;
    tokio_rr: Rt::Tokio, RR;
    tokio_many: Rt::Tokio, MANY;
    libuv_echo: Rt::Libuv, ECHO;
    libuv_rr: Rt::Libuv, RR;
    libuv_many: Rt::Libuv, MANY;
    libuv_in_poll_echo: Rt::LibuvInPoll, ECHO;
    libuv_in_poll_rr: Rt::LibuvInPoll, RR;
    libuv_in_poll_many: Rt::LibuvInPoll, MANY;
    libuv_in_epoll_echo: Rt::LibuvInEpoll, ECHO;
    libuv_in_epoll_rr: Rt::LibuvInEpoll, RR;
    libuv_in_epoll_many: Rt::LibuvInEpoll, MANY;
    asio_echo: Rt::Asio, ECHO;
    asio_rr: Rt::Asio, RR;
    asio_many: Rt::Asio, MANY;
    asyncio_echo: Rt::Asyncio, ECHO;
    asyncio_rr: Rt::Asyncio, RR;
    asyncio_many: Rt::Asyncio, MANY;
    uvloop_echo: Rt::Uvloop, ECHO;
    uvloop_rr: Rt::Uvloop, RR;
    uvloop_many: Rt::Uvloop, MANY;
    java_nio_echo: Rt::JavaNio, ECHO;
    java_nio_rr: Rt::JavaNio, RR;
    java_nio_many: Rt::JavaNio, MANY;
    node_echo: Rt::Node, ECHO;
    node_rr: Rt::Node, RR;
    node_many: Rt::Node, MANY;
}

// ---- slow tier ----------------------------------------------------------------------------------

/// Every other runtime's client against the tokio server, and the tokio client against every
/// other runtime's server ("both as client and as server"), all three tests.
fn cross_runtimes_with_tokio() {
    let mut pairs = Vec::new();
    for rt in ALL.into_iter().filter(|&r| r != Rt::Tokio && !r.nested()) {
        for t in [ECHO, RR, MANY] {
            pairs.push((Rt::Tokio, rt, t));
            pairs.push((rt, Rt::Tokio, t));
        }
    }
    check_pairs(&pairs, 1);
}

/// Every client against the libuv server and the libuv client against every server: the same
/// pairings around a single-threaded C loop.
fn cross_runtimes_with_libuv() {
    let mut pairs = Vec::new();
    for rt in ALL.into_iter().filter(|&r| r != Rt::Libuv && !r.nested()) {
        for t in [ECHO, RR, MANY] {
            pairs.push((Rt::Libuv, rt, t));
            pairs.push((rt, Rt::Libuv, t));
        }
    }
    check_pairs(&pairs, 1);
}

/// Larger runs: 20 000 round trips, 100 connections of 1 MiB each.
fn larger_runs_every_runtime() {
    const RR_LONG: Test = Test {
        name: "rr",
        conns: 1,
        extra: &["--count", "20000"],
    };
    const MANY_BIG: Test = Test {
        name: "many",
        conns: 100,
        extra: &["--conns", "100", "--bytes", "1048576"],
    };
    let mut pairs = Vec::new();
    for rt in ALL.into_iter() {
        pairs.push((rt, rt, RR_LONG));
        pairs.push((rt, rt, MANY_BIG));
    }
    check_pairs(&pairs, 1);
}

/// Each runtime against itself, five preload runs per test: races that show up now and then.
fn repeated_runs_every_runtime() {
    let mut pairs = Vec::new();
    for rt in ALL.into_iter() {
        for t in [ECHO, RR, MANY] {
            pairs.push((rt, rt, t));
        }
    }
    check_pairs(&pairs, 5);
}

/// The suite's own plumbing: every runtime is found (else this says which are not, and why).
fn every_runtime_is_found_or_explained() {
    for rt in ALL {
        launch(rt);
    }
}
