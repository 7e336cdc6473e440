//! The measurements of `bench link`, each on one path: an iperf3 stream, 64-byte round trips
//! of the `tcp-peer` ends, ping, and the idle services' CPU. A link figure is kept only if the
//! link's counters show its traffic crossed the link.

use super::bed::{Bed, Counters};
use super::{
    Opts, BRIDGE, CPU_PCT, GBIT, IDLE, LINK, NOT_ROUTED, PING, RR, STREAM, US_AVG, US_MEAN,
};
use crate::bench::bgproc::wait_listening;
use crate::bench::report::Record;
use crate::bench::sys;
use crate::bench::sys::run_bounded;
use crate::bench::tcp::procs::Proc;
use crate::bench::tcp::wire::{Request, Test};
use crate::error::{fail, CliResult, Context};
use serde_json::Value;
use std::net::Ipv4Addr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Path {
    Link,
    Bridge,
}

impl Path {
    pub fn name(self) -> &'static str {
        match self {
            Path::Link => LINK,
            Path::Bridge => BRIDGE,
        }
    }

    /// Domain `d`'s address on this path.
    fn addr(self, bed: &Bed, d: u8) -> Ipv4Addr {
        match self {
            Path::Link => bed.link_addr(d),
            Path::Bridge => bed.bridge_addr(d),
        }
    }
}

/// Whether `tool` is on the PATH.
pub fn have(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// iperf3's default write size for TCP: the size of the stream's records.
const IPERF_LEN: u64 = 128 << 10;
/// ping's default payload.
const PING_PAYLOAD: u64 = 56;
const RR_SIZE: usize = 64;

/// The counters after a measurement, once `routed` holds of their growth (the services count
/// a batch after moving it: give them a moment), or the last look if it never does.
fn after(
    bed: &Bed,
    before: &super::bed::Snap,
    routed: impl Fn(&[Counters; 2]) -> bool,
) -> CliResult<([Counters; 2], bool)> {
    let mut grew = [Counters::default(); 2];
    for _ in 0..10 {
        grew = bed.snapshot()?.since(before);
        if routed(&grew) {
            return Ok((grew, true));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok((grew, false))
}

fn not_routed(test: &'static str, size: u64, why: String) -> Record {
    let mut r = Record::new(test, LINK, size, NOT_ROUTED, 0.0);
    r.note = Some(why);
    r
}

fn unique() -> u32 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// A server in the background, killed if still running when dropped.
struct Bg {
    child: Child,
    what: String,
    log: std::path::PathBuf,
}

impl Bg {
    fn spawn(what: &str, argv: &[String]) -> CliResult<Bg> {
        let log = std::env::temp_dir().join(format!(
            "memloop-bench-link-{}-{}.log",
            std::process::id(),
            unique()
        ));
        let err = std::fs::File::create(&log).context(format!("creating {}", log.display()))?;
        let child = Command::new(&argv[0])
            .args(&argv[1..])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(err)
            .spawn()
            .context(format!("starting {what}"))?;
        Ok(Bg {
            child,
            what: what.into(),
            log,
        })
    }

    fn tail(&self) -> String {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .trim()
            .lines()
            .last()
            .unwrap_or_default()
            .to_string()
    }

    /// Until the process (in its domain) listens on TCP `port`.
    fn wait_listen(&mut self, port: u16) -> CliResult<()> {
        let (pid, what) = (self.child.id(), self.what.clone());
        wait_listening(pid, port, &what, || match self.child.try_wait()? {
            Some(st) => Err(fail(format!(
                "{} exited ({st}) before listening: {}",
                self.what,
                self.tail()
            ))),
            None => Ok(()),
        })
    }

    /// Waits (bounded) for the process to exit by itself.
    fn finish(&mut self, within: Duration) -> CliResult<()> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(st) = self.child.try_wait()? {
                return match st.success() {
                    true => Ok(()),
                    false => Err(fail(format!(
                        "{} failed ({st}): {}",
                        self.what,
                        self.tail()
                    ))),
                };
            }
            if Instant::now() >= deadline {
                return Err(fail(format!("{} did not exit", self.what)));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Bg {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// Figure 1: one TCP flow, iperf3 from domain 0 to a one-off server in domain 1.
pub fn stream(bed: &mut Bed, p: Path, o: &Opts, seq: u16) -> CliResult<Vec<Record>> {
    bed.check()?;
    let addr = p.addr(bed, 1).to_string();
    let port = 5400 + seq % 1000;
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<String>>();
    let server = bed.in_domain(
        1,
        &s(&["iperf3", "-s", "-1", "-B", &addr, "-p", &port.to_string()]),
    );
    let mut srv = Bg::spawn("the iperf3 server", &server)?;
    srv.wait_listen(port)?;
    let mut client = s(&["iperf3", "-c", &addr, "-p", &port.to_string(), "-J"]);
    client.extend(["-t".into(), o.stream_secs.to_string()]);
    if o.omit_secs > 0 {
        client.extend(["-O".into(), o.omit_secs.to_string()]);
    }
    let before = bed.snapshot()?;
    let timeout = Duration::from_secs(o.stream_secs + o.omit_secs + 30);
    let ran = run_bounded(&bed.in_domain(0, &client), timeout)?;
    let v: Value = serde_json::from_str(&ran.stdout).map_err(|e| {
        fail(format!(
            "iperf3 over {}: no JSON ({e}; exit {}): {}",
            p.name(),
            ran.status,
            ran.stderr.trim()
        ))
    })?;
    if let Some(e) = v["error"].as_str() {
        return Err(fail(format!("iperf3 over {}: {e}", p.name())));
    }
    if !ran.status.success() {
        return Err(fail(format!(
            "iperf3 over {}: exit {}",
            p.name(),
            ran.status
        )));
    }
    srv.finish(Duration::from_secs(10))?;
    let end = &v["end"];
    let recvd = end["sum_received"]["bytes"].as_u64().unwrap_or(0);
    let bps = end["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap_or(0.0);
    let secs = end["sum_received"]["seconds"].as_f64().unwrap_or(0.0);
    if recvd == 0 || bps <= 0.0 {
        return Err(fail(format!(
            "iperf3 over {}: nothing received ({})",
            p.name(),
            end["sum_received"]
        )));
    }
    let retrans = end["sum_sent"]["retransmits"]
        .as_u64()
        .map_or("?".into(), |r| r.to_string());
    let mut note = format!(
        "iperf3 -t {}{} (its default 128 KiB writes): {} received in {secs:.2} s, {retrans} \
         retransmits",
        o.stream_secs,
        if o.omit_secs > 0 {
            format!(" -O {}", o.omit_secs)
        } else {
            String::new()
        },
        fmt_bytes(recvd)
    );
    if p == Path::Link {
        let (g, ok) = after(bed, &before, |g| {
            g[0].tx_bytes >= recvd && g[1].rx_bytes >= recvd
        })?;
        let seen = format!(
            "the link's counters grew by {} sent (domain 0) and {} received (domain 1) for \
             the {} iperf3 received",
            fmt_bytes(g[0].tx_bytes),
            fmt_bytes(g[1].rx_bytes),
            fmt_bytes(recvd)
        );
        if !ok {
            return Ok(vec![not_routed(STREAM, IPERF_LEN, seen)]);
        }
        note.push_str(&format!("; {seen}"));
    }
    let mut r = Record::new(STREAM, p.name(), IPERF_LEN, GBIT, bps / 1e9);
    r.note = Some(note);
    Ok(vec![r])
}

/// Bytes as MiB or GiB with two decimals.
fn fmt_bytes(n: u64) -> String {
    let mib = n as f64 / (1u64 << 20) as f64;
    if mib >= 1024.0 {
        format!("{:.2} GiB", mib / 1024.0)
    } else {
        format!("{mib:.1} MiB")
    }
}

/// Figure 2: back-to-back 64-byte round trips on one connection between the ordinary socket
/// ends of `bench tcp` (server in domain 1, client in domain 0, no preload).
pub fn rr(bed: &mut Bed, p: Path, o: &Opts) -> CliResult<Vec<Record>> {
    bed.check()?;
    let listen = format!("{}:0", p.addr(bed, 1));
    let args = ["--role", "server", "--addr", &listen].map(String::from);
    let mut server = Proc::spawn(
        format!("the {} server", p.name()),
        &bed.ours_in_domain("tcp-peer", 1, &args),
    )?;
    let ready = server.ready()?;
    let addr = ready["addr"]
        .as_str()
        .ok_or_else(|| fail(format!("{}: no address in {ready}", server.what())))?
        .to_owned();
    let args = ["--role", "client", "--addr", &addr].map(String::from);
    let mut client = Proc::spawn(
        format!("the {} client", p.name()),
        &bed.ours_in_domain("tcp-peer", 0, &args),
    )?;
    client.ready()?;
    let req = Request {
        test: Test::Rr,
        size: RR_SIZE,
        warmup_s: o.rr_warmup.as_secs_f64(),
        dur_s: o.rr_dur.as_secs_f64(),
        sleep_us: 0,
        conns: 0,
    };
    let before = bed.snapshot()?;
    let reply = client.ask(&req, o.rr_dur + o.rr_warmup + Duration::from_secs(20))?;
    if reply.count == 0 || reply.elapsed_s <= 0.0 {
        return Err(fail(format!(
            "round trips over {}: empty measurement {reply:?}",
            p.name()
        )));
    }
    drop(client);
    drop(server);
    let mean = reply.elapsed_s / reply.count as f64 * 1e6;
    let mut note = format!(
        "tcp-peer (plain sockets, TCP_NODELAY): {} round trips in {:.2} s; p50 {:.1} µs",
        reply.count,
        reply.elapsed_s,
        reply.p50_ns / 1e3
    );
    if p == Path::Link {
        let least = reply.count * RR_SIZE as u64;
        let (g, ok) = after(bed, &before, |g| {
            g[0].tx_bytes >= least
                && g[1].rx_bytes >= least
                && g[1].tx_bytes >= least
                && g[0].rx_bytes >= least
        })?;
        let seen = format!(
            "the link's counters grew by {} B domain 0 → 1 and {} B back for {} round trips \
             of {RR_SIZE} B",
            g[1].rx_bytes, g[0].rx_bytes, reply.count
        );
        if !ok {
            return Ok(vec![not_routed(RR, RR_SIZE as u64, seen)]);
        }
        note.push_str(&format!("; {seen}"));
    }
    let mut r = Record::new(RR, p.name(), RR_SIZE as u64, US_MEAN, mean);
    r.p99 = Some(reply.p99_ns / 1e3);
    r.note = Some(note);
    Ok(vec![r])
}

/// Figure 3: `ping -c N -i 0.01 -q` from domain 0 to domain 1.
pub fn ping(bed: &mut Bed, p: Path, o: &Opts) -> CliResult<Vec<Record>> {
    bed.check()?;
    let addr = p.addr(bed, 1).to_string();
    let n = o.ping_count.to_string();
    let cmd = ["ping", "-4", "-c", &n, "-i", "0.01", "-q", "-W", "2", &addr].map(String::from);
    let before = bed.snapshot()?;
    let timeout = Duration::from_secs_f64(f64::from(o.ping_count) * 0.01 + 30.0);
    let ran = run_bounded(&bed.in_domain(0, &cmd), timeout)?;
    let (sent, got, rtt) = parse_ping(&ran.stdout).ok_or_else(|| {
        fail(format!(
            "ping over {}: no summary (exit {}): {} {}",
            p.name(),
            ran.status,
            ran.stdout.trim(),
            ran.stderr.trim()
        ))
    })?;
    if got == 0 {
        return Err(fail(format!(
            "ping over {}: no reply to {sent} requests",
            p.name()
        )));
    }
    let [min, avg, max, mdev] = rtt;
    let mut note = format!(
        "{got}/{sent} replies; rtt min {min:.3} / avg {avg:.3} / max {max:.3} / mdev {mdev:.3} ms"
    );
    if p == Path::Link {
        let (g, ok) = after(bed, &before, |g| {
            g[0].tx_packets >= got && g[1].rx_packets >= got && g[1].tx_packets >= got
        })?;
        let seen = format!(
            "the link's counters grew by {} packets domain 0 → 1 and {} back for {got} replies",
            g[1].rx_packets, g[0].rx_packets
        );
        if !ok {
            return Ok(vec![not_routed(PING, PING_PAYLOAD, seen)]);
        }
        note.push_str(&format!("; {seen}"));
    }
    let mut r = Record::new(PING, p.name(), PING_PAYLOAD, US_AVG, avg * 1e3);
    r.note = Some(note);
    Ok(vec![r])
}

/// (transmitted, received, [min, avg, max, mdev] ms) from ping's summary.
fn parse_ping(out: &str) -> Option<(u64, u64, [f64; 4])> {
    let stats = out.lines().find(|l| l.contains("packets transmitted"))?;
    let num = |s: &str| s.split_whitespace().next()?.parse::<u64>().ok();
    let mut parts = stats.split(',');
    let sent = num(parts.next()?)?;
    let got = num(parts.next()?)?;
    if got == 0 {
        return Some((sent, 0, [0.0; 4]));
    }
    let rtt = out
        .lines()
        .find(|l| l.starts_with("rtt") || l.starts_with("round-trip"))?;
    let vals: Vec<f64> = rtt
        .split('=')
        .nth(1)?
        .split_whitespace()
        .next()?
        .split('/')
        .filter_map(|x| x.parse().ok())
        .collect();
    (vals.len() == 4).then(|| (sent, got, [vals[0], vals[1], vals[2], vals[3]]))
}

/// Figure 4: both services' CPU time over a window in which nothing is sent.
pub fn idle(bed: &mut Bed, o: &Opts) -> CliResult<Record> {
    bed.check()?;
    let pids = bed.pids();
    // Let the last exchanges of the round settle (TIME_WAIT, delayed ACKs).
    std::thread::sleep(Duration::from_millis(200));
    let before = bed.snapshot()?;
    let c0 = [sys::cpu_time(pids[0])?, sys::cpu_time(pids[1])?];
    let t0 = Instant::now();
    std::thread::sleep(o.idle_for);
    let c1 = [sys::cpu_time(pids[0])?, sys::cpu_time(pids[1])?];
    let wall = t0.elapsed().as_secs_f64();
    let g = bed.snapshot()?.since(&before);
    let pct = |i: usize| c1[i].saturating_sub(c0[i]).as_secs_f64() / wall * 100.0;
    let mut r = Record::new(IDLE, LINK, 2, CPU_PCT, pct(0) + pct(1));
    r.note = Some(format!(
        "both link services over {wall:.2} s with nothing sent (CPU time of all their threads, \
         schedstat): domain 0's {:.3}%, domain 1's {:.3}%; packets meanwhile: {} and {} sent",
        pct(0),
        pct(1),
        g[0].tx_packets,
        g[1].tx_packets
    ));
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_pings_summary() {
        let out = "PING 10.99.1.2 (10.99.1.2) 56(84) bytes of data.\n\n--- 10.99.1.2 ping \
                   statistics ---\n200 packets transmitted, 199 received, 0.5% packet loss, \
                   time 2189ms\nrtt min/avg/max/mdev = 0.021/0.043/0.200/0.015 ms\n";
        let (sent, got, rtt) = parse_ping(out).unwrap();
        assert_eq!((sent, got), (200, 199));
        assert_eq!(rtt, [0.021, 0.043, 0.2, 0.015]);
        let none = "3 packets transmitted, 0 received, +3 errors, 100% packet loss, time 2ms\n";
        assert_eq!(parse_ping(none).map(|x| x.1), Some(0));
        assert!(parse_ping("ping: connect: Network is unreachable").is_none());
    }
}
