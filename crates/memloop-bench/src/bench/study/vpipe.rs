//! Experiment 13: the pipe service (issue 20) — the figures of `memloop bench pipe` (relay,
//! fairness, static-file server), one round of them per study round, as study records.

use super::exps::bars;
use super::lab::Lab;
use super::plot::Figure;
use super::Rec;
use crate::bench::pipe::{self, Opts};
use crate::error::{fail, CliResult};
use crate::units::fmt_size;
use indicatif::ProgressBar;

pub const ID: u32 = 13;

fn opts(l: &Lab) -> Opts {
    let mut o = Opts::new(l.quick);
    // The study's own rounds repeat the experiment.
    o.repeat = 1;
    o
}

pub fn steps(l: &Lab) -> u64 {
    opts(l).steps()
}

pub fn exp13(l: &mut Lab, bar: &ProgressBar, out: &mut Vec<Rec>) -> CliResult<()> {
    let o = opts(l);
    let mut started = false;
    let r = pipe::figures(&o, &mut |m| {
        if started {
            bar.inc(1);
        }
        started = true;
        bar.set_message(format!("{ID}. {m}"));
    })?;
    if started {
        bar.inc(1);
    }
    for x in r.records {
        if x.unit == pipe::NOT_ROUTED {
            continue; // said in the notes and the status
        }
        if !(x.value.is_finite() && x.value > 0.0) {
            l.notes.push((
                "pipe",
                format!(
                    "experiment {ID}: {} {} {} {} = {} (left out)",
                    x.test,
                    x.path,
                    fmt_size(x.size),
                    x.unit,
                    x.value
                ),
            ));
            continue;
        }
        let mut rec = Rec::new(ID, x.test, x.path, x.size, x.unit, x.value);
        rec.note = x.note;
        out.push(rec);
    }
    for n in r.notes {
        l.notes.push(("pipe", format!("experiment {ID}: {n}")));
    }
    match r.not_routed {
        Some(true) => Err(fail(
            "the static-file server's sendfile was not routed to the pipe service although \
             the preload library knows MEMLOOP_PIPE_SENDFILE (see the notes)",
        )),
        Some(false) => Err(fail(
            "unavailable: the static-file server through the pipe service (the preload \
             library has no MEMLOOP_PIPE_SENDFILE routing yet); the relay, the fairness and \
             the server's own sendfile are measured",
        )),
        None => Ok(()),
    }
}

/// The series a path belongs to in the figures.
fn series(r: &Rec) -> String {
    match r.path.as_str() {
        "copy-loop" => "user-space copy loop",
        "sendfile" => "the server's own sendfile",
        "pipe-service" => "pipe service",
        "splice-loop" => "splice in the relay (no service)",
        p => p,
    }
    .into()
}

fn category(r: &Rec) -> String {
    match r.test.as_str() {
        "relay" => format!("relay {}", fmt_size(r.size)),
        t => format!("{t} {}", fmt_size(r.size)),
    }
}

pub fn fig13(r: &[Rec]) -> Vec<Figure> {
    let moved =
        |x: &Rec| matches!(x.test.as_str(), "relay" | "static-file") && x.path != pipe::RATIO_PATH;
    let mut v = vec![
        bars(
            "13. Pipe service: relay (socket → socket) and static-file server, throughput",
            "GB/s",
            r,
            |x| moved(x) && x.unit == "GB/s",
            category,
            series,
        ),
        bars(
            "13. Pipe service: CPU per byte (relay + service; the server alone)",
            "ns/B",
            r,
            |x| moved(x) && (x.unit == pipe::RELAY_CPU_TOTAL || x.unit == pipe::SERVER_CPU),
            category,
            series,
        ),
    ];
    if r.iter().any(|x| x.test.starts_with("fairness")) {
        v.push(bars(
            "13. Fairness at weights 1:2:4, then 1:2: byte shares and Jain's index",
            "share / index",
            r,
            |x| x.test.starts_with("fairness") && (x.unit == "share" || x.unit == "jain"),
            |x| match x.test.as_str() {
                "fairness" => "three tenants, 1:2:4".to_string(),
                _ => "after w4 stops, 1:2".to_string(),
            },
            |x| match x.unit.as_str() {
                "jain" => "Jain's index (weight-normalised)".to_string(),
                _ => format!("share of {}", x.path),
            },
        ));
    }
    v
}
