//! Experiment 14: the network link over the region (MMNet, `memloop link`) — the figures of
//! `memloop bench link` (one TCP flow, 64 B round trips, ping, the idle link's CPU), one round
//! of them per study round, as study records. The link's two domains are its own (prefix
//! `mlk<pid>`), beside the study's.

use super::exps::bars;
use super::lab::Lab;
use super::plot::Figure;
use super::Rec;
use crate::bench::link::{self, Opts};
use crate::error::{fail, CliResult};
use crate::units::fmt_size;
use indicatif::ProgressBar;
use std::time::Duration;

pub const ID: u32 = 14;

fn opts(l: &Lab) -> Opts {
    let mut o = Opts::new(l.quick);
    // The study's own rounds repeat the experiment.
    o.repeat = 1;
    if l.quick {
        // The whole quick study must stay within its 2 minutes.
        o.set_duration(0.3);
        o.ping_count = 50;
        o.idle_for = Duration::from_secs(1);
    }
    o
}

pub fn steps(l: &Lab) -> u64 {
    opts(l).steps()
}

pub fn exp14(l: &mut Lab, bar: &ProgressBar, out: &mut Vec<Rec>) -> CliResult<()> {
    if !std::path::Path::new("/dev/net/tun").exists() {
        return Err(fail(
            "unavailable: no /dev/net/tun here (the link's sides are TUN devices)",
        ));
    }
    let o = opts(l);
    let mut started = false;
    let r = link::figures(&o, &mut |m| {
        if started {
            bar.inc(1);
        }
        started = true;
        bar.set_message(format!("{ID}. {m}"));
    })?;
    if started {
        bar.inc(1);
    }
    let mut zero = Vec::new();
    for x in r.records {
        if x.unit == link::NOT_ROUTED {
            continue; // said in the status
        }
        if !(x.value.is_finite() && x.value > 0.0) {
            // Drops of zero are the expected case: one note says so.
            zero.push(format!("{} {}", x.unit, x.value));
            continue;
        }
        let mut rec = Rec::new(ID, x.test, x.path, x.size, x.unit, x.value);
        rec.note = x.note;
        out.push(rec);
        if let Some(p99) = x.p99 {
            out.push(Rec::new(ID, x.test, x.path, x.size, "us p99", p99));
        }
    }
    if !zero.is_empty() {
        l.notes.push((
            "link",
            format!(
                "experiment {ID}: {} (left out of the figures)",
                zero.join(", ")
            ),
        ));
    }
    for n in r.notes {
        l.notes.push(("link", format!("experiment {ID}: {n}")));
    }
    if r.not_routed.is_empty() {
        Ok(())
    } else {
        Err(fail(format!(
            "traffic meant for the link did not cross it: {}",
            r.not_routed.join("; ")
        )))
    }
}

/// The series a path belongs to in the figures.
fn series(r: &Rec) -> String {
    match r.path.as_str() {
        link::LINK => "MMNet link (memloop link)",
        link::BRIDGE => "veth+bridge",
        p => p,
    }
    .into()
}

fn category(r: &Rec) -> String {
    let what = match (r.test.as_str(), r.unit.as_str()) {
        (link::RR, "us p99") => "TCP round trip p99",
        (link::RR, _) => "TCP round trip mean",
        (link::PING, _) => "ping avg",
        (link::STREAM, _) => "TCP stream, one flow",
        (t, _) => t,
    };
    format!("{what} ({})", fmt_size(r.size))
}

pub fn fig14(r: &[Rec]) -> Vec<Figure> {
    let paths = |x: &Rec| x.path == link::LINK || x.path == link::BRIDGE;
    let mut v = vec![
        bars(
            "14. MMNet link vs veth+bridge: one TCP flow (iperf3)",
            "Gbit/s",
            r,
            |x| paths(x) && x.unit == link::GBIT,
            category,
            series,
        ),
        bars(
            "14. Latency: TCP 64 B round trip (mean, p99) and ping (average RTT)",
            "µs",
            r,
            |x| paths(x) && x.unit.starts_with("us"),
            category,
            series,
        ),
        bars(
            "14. The link relative to veth+bridge (targets: stream ≥ 2×, round trip ≤ 0.7×)",
            "link / veth+bridge",
            r,
            |x| x.path == link::RATIO_PATH,
            |x| format!("{} {}", x.test, x.unit),
            |_| "link / veth+bridge".into(),
        ),
    ];
    if r.iter().any(|x| x.test == link::IDLE) {
        v.push(bars(
            "14. Idle link: CPU of both link services, nothing sent (target < 1%)",
            "% of one CPU",
            r,
            |x| x.test == link::IDLE,
            |_| "both services".into(),
            |_| "idle link".into(),
        ));
    }
    v
}
