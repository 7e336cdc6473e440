//! Figure 2: fairness. A service with one worker; three tenants of weights 1:2:4, each with a
//! transfer that never ends (/dev/zero → /dev/null), saturate it. Each tenant's bytes over a
//! window (the service's statistics at its two ends) give its share; Jain's index of the shares
//! divided by the weights' shares is 1 when the split follows the weights. Then the heaviest
//! tenant stops, and the two left must split the service 1:2.

use super::svc::{self, Svc};
use super::Opts;
use crate::bench::report::Record;
use crate::error::{fail, CliResult, Context};
use memloop_pipe::client::Client;
use memloop_pipe::credits::{jain, weighted_shares, CostModel, TenantStats};
use memloop_pipe::PipeError;
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

pub const TEST: &str = "fairness";
/// After the heaviest tenant left.
pub const TEST_LEAVE: &str = "fairness-leave";
pub const PATH: &str = "pipe-service";
const TENANTS: [(&str, u16); 3] = [("w1", 1), ("w2", 2), ("w4", 4)];

pub fn measure(o: &Opts) -> CliResult<Vec<Record>> {
    let sock = std::env::temp_dir().join(format!(
        "memloop-bench-pipe-fair-{}-{}",
        std::process::id(),
        svc::unique()
    ));
    let mut svc = Svc::start(Some(&sock), None, Some(1))?;
    let zero = std::fs::File::open("/dev/zero").context("opening /dev/zero")?;
    let null = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/null")
        .context("opening /dev/null")?;
    let mut clients: Vec<(Client, u64)> = Vec::new();
    for (name, w) in TENANTS {
        let mut c = svc.client(name, w)?;
        if c.tenant() != (name, w) {
            return Err(fail(format!(
                "the service made tenant {name} of weight {w} into {:?}",
                c.tenant()
            )));
        }
        let id = c
            .submit(zero.as_fd(), null.as_fd(), None)
            .context(format!("tenant {name}: submitting"))?;
        clients.push((c, id));
    }
    let warm = (o.window / 4).max(Duration::from_millis(100));
    std::thread::sleep(warm);
    let mut out = window(&mut svc, o.window, &TENANTS, TEST)?;
    // The heaviest leaves: its transfer is cancelled.
    let (c, id) = &mut clients[2];
    c.cancel(*id).context("cancelling w4")?;
    match c.wait_for(*id).context("w4's completion")?.result {
        Err(PipeError::Cancelled) => {}
        r => return Err(fail(format!("w4 cancelled, but its transfer ended {r:?}"))),
    }
    // The worker finishes the chunk it had (at most one).
    std::thread::sleep(Duration::from_millis(20));
    out.extend(window(&mut svc, o.window, &TENANTS[..2], TEST_LEAVE)?);
    for (c, id) in &mut clients[..2] {
        c.cancel(*id)?;
        let _ = c.wait_for(*id);
    }
    svc.check()?;
    Ok(out)
}

/// Each tenant's bytes over `dur`: Jain's index of the weight-normalised shares, each share,
/// the service's throughput.
fn window(
    svc: &mut Svc,
    dur: Duration,
    tenants: &[(&'static str, u16)],
    test: &'static str,
) -> CliResult<Vec<Record>> {
    let a = svc.stats()?;
    let t = Instant::now();
    std::thread::sleep(dur);
    let b = svc.stats()?;
    let secs = t.elapsed().as_secs_f64();
    let (a, b) = (svc::tenants(&a), svc::tenants(&b));
    let mut stats = Vec::new();
    for (name, w) in tenants {
        let of = |v: &[(String, u32, u64, u64)]| {
            v.iter()
                .find(|t| t.0 == *name)
                .map(|t| (t.2, t.3))
                .unwrap_or_default()
        };
        let ((b0, c0), (b1, c1)) = (of(&a), of(&b));
        stats.push(TenantStats {
            name: name.to_string(),
            weight: u32::from(*w),
            bytes: b1.saturating_sub(b0),
            cpu_ns: c1.saturating_sub(c0),
            wait_ns: 0,
            run_ns: 0,
            chunks: 0,
            backlogged: true,
        });
    }
    let total: u64 = stats.iter().map(|s| s.bytes).sum();
    if total == 0 {
        return Err(fail(format!(
            "fairness: the tenants moved nothing in {secs:.2} s"
        )));
    }
    let normalised = weighted_shares(&stats, &CostModel::BYTES);
    let j = jain(&normalised);
    let wsum: f64 = tenants.iter().map(|t| f64::from(t.1)).sum();
    let fmt = |f: &dyn Fn(&TenantStats) -> f64| {
        stats
            .iter()
            .map(|s| format!("{:.3}", f(s)))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let share = |s: &TenantStats| s.bytes as f64 / total as f64;
    let ideal = |s: &TenantStats| f64::from(s.weight) / wsum;
    let weights: Vec<String> = tenants.iter().map(|t| t.1.to_string()).collect();
    let n = tenants.len() as u64;
    let mut jr = Record::new(test, PATH, n, "jain", j);
    jr.note = Some(format!(
        "weights {}, 1 worker, /dev/zero → /dev/null each; byte shares {} (by weight {}) \
         over {secs:.2} s",
        weights.join(":"),
        fmt(&share),
        fmt(&ideal)
    ));
    let mut out = vec![
        jr,
        Record::new(test, PATH, n, "GB/s", total as f64 / secs / 1e9),
    ];
    for (s, (name, _)) in stats.iter().zip(tenants) {
        let mut r = Record::new(test, name, n, "share", share(s));
        r.note = Some(format!("by weight {:.3}", ideal(s)));
        out.push(r);
    }
    Ok(out)
}
