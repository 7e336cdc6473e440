//! Experiment 15: the block device over the region (MMBlk, `memloop blk`) — the figures of
//! `memloop bench blk` (fio 4 KiB random and 1 MiB sequential read and write on a loop device
//! in domain 1, and PostgreSQL on an ext4 on it: memloop vs NBD over TCP vs a local file),
//! one round of them per study round,
//! as study records. Its two domains are its own (prefix `mbk<pid>`), beside the study's.

use super::exps::bars;
use super::lab::Lab;
use super::plot::Figure;
use super::Rec;
use crate::bench::blk::{self, Opts};
use crate::error::{fail, CliResult};
use crate::units::fmt_size;
use indicatif::ProgressBar;

pub const ID: u32 = 15;

fn opts(l: &Lab) -> Opts {
    let mut o = Opts::new(l.quick);
    // The study's own rounds repeat the experiment.
    o.repeat = 1;
    if l.quick {
        // The whole quick study must stay within its 2 minutes: one random and one
        // sequential run, 1 s each, on every path.
        o.tests = vec!["randread", "write"];
    }
    if blk::pg::missing().is_some() {
        o.tests.retain(|t| *t != blk::pg::TEST);
    }
    o
}

pub fn steps(l: &Lab) -> u64 {
    opts(l).steps()
}

pub fn exp15(l: &mut Lab, bar: &ProgressBar, out: &mut Vec<Rec>) -> CliResult<()> {
    if !std::path::Path::new("/dev/fuse").exists() {
        return Err(fail(
            "unavailable: no /dev/fuse here (both client paths are FUSE files)",
        ));
    }
    for tool in ["fio", "nbdkit", "nbdfuse"] {
        let ok = std::process::Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .is_ok_and(|o| o.status.success());
        if !ok {
            return Err(fail(format!(
                "unavailable: `{tool}` is not installed (apt-get install fio nbdkit nbdfuse)"
            )));
        }
    }
    let o = opts(l);
    if let Some(why) = (!l.quick).then(blk::pg::missing).flatten() {
        // The fio figures still stand; the database one is said missing, not dropped silently.
        l.notes.push((
            "blk",
            format!("experiment {ID}: no PostgreSQL figure: {why}"),
        ));
    }
    let mut started = false;
    let r = blk::figures(&o, &mut |m| {
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
        if x.unit == blk::NOT_ROUTED || !(x.value.is_finite() && x.value > 0.0) {
            continue; // said in the status
        }
        let mut rec = Rec::new(ID, x.test, x.path, x.size, x.unit, x.value);
        rec.note = x.note;
        out.push(rec);
    }
    for n in r.notes {
        l.notes.push(("blk", format!("experiment {ID}: {n}")));
    }
    if r.not_routed.is_empty() {
        Ok(())
    } else {
        Err(fail(format!(
            "I/O meant for the block device did not cross the export: {}",
            r.not_routed.join("; ")
        )))
    }
}

/// The series a path belongs to in the figures.
fn series(r: &Rec) -> String {
    match r.path.as_str() {
        blk::MEMLOOP => "MMBlk (memloop blk)",
        blk::NBD => "NBD over TCP (nbdkit, nbdfuse)",
        blk::LOCAL => "loop on a local file",
        p => p,
    }
    .into()
}

fn category(r: &Rec) -> String {
    match r.test.as_str() {
        blk::pg::TEST => format!("pgbench -c {}", r.size),
        t => format!("{t} ({})", fmt_size(r.size)),
    }
}

pub fn fig15(r: &[Rec]) -> Vec<Figure> {
    let paths = |x: &Rec| blk::PATHS.contains(&x.path.as_str());
    vec![
        bars(
            "15. MMBlk vs NBD over TCP vs a local file: fio 4 KiB random, queue depth 32",
            "IOPS",
            r,
            |x| paths(x) && x.unit == blk::IOPS,
            category,
            series,
        ),
        bars(
            "15. fio 1 MiB sequential, queue depth 8",
            "MiB/s",
            r,
            |x| paths(x) && x.unit == blk::MIBS,
            category,
            series,
        ),
        bars(
            "15. PostgreSQL on ext4 on each device: pgbench (fsync on)",
            "transactions/s",
            r,
            |x| paths(x) && x.unit == blk::pg::TPS,
            category,
            series,
        ),
        bars(
            "15. MMBlk relative to NBD over TCP (target ≥ 2×) and to the local file (≥ 0.5×; \
             PostgreSQL ≥ 0.9×)",
            "ratio",
            r,
            |x| x.path == blk::RATIO_NBD || x.path == blk::RATIO_LOCAL,
            category,
            |x| x.path.clone(),
        ),
    ]
}
