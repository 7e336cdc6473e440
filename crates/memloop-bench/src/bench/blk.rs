//! `memloop bench blk`: the block device over the region (MMBlk, `memloop blk export` /
//! `attach`) against NBD over TCP between the same two domains and against a loop device on a
//! local file (the ceiling), in one run, the paths side by side. Storage in domain 0, the
//! client (fio) in domain 1; every path is a loop device with direct I/O in domain 1:
//!
//! 1. **memloop**: `memloop blk export` of a /dev/shm file in domain 0, `memloop blk attach`
//!    in domain 1: a loop device on the attach service's FUSE file, the data crossing the
//!    region through memloop's channels.
//! 2. **NBD over TCP**: `nbdkit file` on the /dev/shm file in domain 0, listening on its
//!    bridge address; in domain 1 `nbdfuse` (the export as a FUSE file) and a loop device on
//!    it (the kernel's NBD client is not used: the same shape as memloop's frontend, a loop
//!    device on a FUSE file, only the transport differs).
//! 3. **local file**: a loop device in domain 1 directly on a /dev/shm file.
//!
//! fio in domain 1 on each device (`--ioengine=libaio --direct=1 --time_based`): 4 KiB random
//! read and write at queue depth 32 (IOPS), 1 MiB sequential read and write at queue depth 8
//! (MiB/s). Ratios memloop / NBD (target ≥ 2×) and memloop / local (target ≥ 0.5×). Then
//! PostgreSQL on an ext4 on each device (`pg.rs`): initdb, pgbench at 1 and 4 clients (TPS,
//! memloop / local target ≥ 0.9×). A memloop
//! figure counts only if the export's counters (its stats file, as `memloop status --json`'s
//! "blk" shows it) grew by at least the bytes fio moved, else "not routed" and no figure. Every
//! figure is the median of its rounds; the paths rotate within a round. Processes not pinned.

mod bed;
mod figs;
pub mod pg;

use super::report::{self, Record};
use crate::error::{fail, CliResult};
use crate::units::{fmt_size, parse_size};
use std::path::PathBuf;

/// Set for a blk service the benchmark starts: the service stops (SIGTERM to itself, its
/// clean way down: the attach detaches its loop device and unmounts) when its stdin closes,
/// so it never outlives the benchmark.
pub const STOP_ON_EOF: &str = "MEMLOOP_BENCH_STOP_ON_EOF";

/// The hidden `blk-service` command: `memloop blk`, stopping on end of stdin if asked.
pub fn service(cmd: memloop_cli::blk_cmd::BlkCmd) -> CliResult<()> {
    if std::env::var_os(STOP_ON_EOF).is_some() {
        std::thread::spawn(|| {
            let mut sink = Vec::new();
            let _ = std::io::Read::read_to_end(&mut std::io::stdin().lock(), &mut sink);
            let _ = rustix::process::kill_process(
                rustix::process::getpid(),
                rustix::process::Signal::TERM,
            );
        });
    }
    memloop_cli::blk_cmd::run(cmd)
}

#[derive(clap::Args)]
pub struct BlkArgs {
    /// Short runs (1 s per fio run, 128 MiB backing files, one round): a quick look or CI.
    #[arg(long)]
    quick: bool,
    /// Also write the results as JSON to FILE ({test, path, size, unit, value} records).
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Seconds of each fio run (whole seconds, rounded up; default 5, or 1 with --quick).
    #[arg(long, value_name = "SECS")]
    duration: Option<f64>,
    /// Rounds, the paths rotating in each; every figure is the median of its rounds (default
    /// 3, 1 with --quick).
    #[arg(long)]
    repeat: Option<usize>,
    /// Only these runs (comma separated): randread, randwrite, read, write, pgbench.
    #[arg(long, value_delimiter = ',', value_name = "TEST")]
    only: Option<Vec<String>>,
    /// Size of each backing file (default 256M, or 128M with --quick; PostgreSQL needs 128M).
    #[arg(long, value_name = "SIZE")]
    size: Option<String>,
    /// Where the backing files live (default /dev/shm: memory speed, the transport's worst
    /// case; a directory on a disk measures what a database on that disk sees).
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
}

/// The paths, in the order of the table's columns.
pub const MEMLOOP: &str = "memloop";
pub const NBD: &str = "nbd-tcp";
pub const LOCAL: &str = "local-file";
pub const PATHS: [&str; 3] = [MEMLOOP, NBD, LOCAL];
/// Ratio records: memloop's figure over NBD's, and over the local file's.
pub const RATIO_NBD: &str = "memloop / nbd-tcp";
pub const RATIO_LOCAL: &str = "memloop / local-file";
/// The marker of a memloop figure whose I/O did not cross the export (value 0, a note).
pub const NOT_ROUTED: &str = "not routed";

pub const IOPS: &str = "IOPS";
pub const MIBS: &str = "MiB/s";
pub const RATIO: &str = "ratio";
/// The bytes the export copied (pread into / pwrite from its pool) per byte fio moved.
pub const COPIED: &str = "copied B/B";

/// One fio run.
pub struct Fio {
    pub test: &'static str,
    pub rw: &'static str,
    pub bs: u64,
    pub qd: u32,
    pub unit: &'static str,
}

pub const TESTS: [Fio; 4] = [
    Fio {
        test: "randread",
        rw: "randread",
        bs: 4096,
        qd: 32,
        unit: IOPS,
    },
    Fio {
        test: "randwrite",
        rw: "randwrite",
        bs: 4096,
        qd: 32,
        unit: IOPS,
    },
    Fio {
        test: "read",
        rw: "read",
        bs: 1 << 20,
        qd: 8,
        unit: MIBS,
    },
    Fio {
        test: "write",
        rw: "write",
        bs: 1 << 20,
        qd: 8,
        unit: MIBS,
    },
];

/// The targets on the ratios: over NBD, over the local file.
const TARGET_NBD: f64 = 2.0;
const TARGET_LOCAL: f64 = 0.5;
/// The target on PostgreSQL's TPS over the local file's.
const TARGET_PG: f64 = 0.9;

/// The figures a run measures, and how.
#[derive(Clone, Debug)]
pub struct Opts {
    pub quick: bool,
    pub repeat: usize,
    /// fio --runtime (whole seconds).
    pub secs: u64,
    /// Each backing file's size.
    pub size: u64,
    /// The runs (names of [`TESTS`], and [`pg::TEST`]).
    pub tests: Vec<&'static str>,
    /// The backing files' directory.
    pub dir: PathBuf,
}

impl Opts {
    /// What `bench blk [--quick]` runs by default.
    pub fn new(quick: bool) -> Opts {
        Opts {
            quick,
            repeat: if quick { 1 } else { 3 },
            secs: if quick { 1 } else { 5 },
            size: if quick { 128 << 20 } else { 256 << 20 },
            tests: TESTS.iter().map(|t| t.test).chain([pg::TEST]).collect(),
            dir: PathBuf::from("/dev/shm"),
        }
    }

    fn from_args(a: &BlkArgs) -> CliResult<Opts> {
        let mut o = Opts::new(a.quick);
        if let Some(d) = a.duration {
            if !(d > 0.0 && d <= 3600.0) {
                return Err(fail(format!("--duration {d}: seconds in (0, 3600]")));
            }
            o.secs = (d.ceil() as u64).max(1);
        }
        if let Some(r) = a.repeat {
            o.repeat = r.clamp(1, 100);
        }
        if let Some(only) = &a.only {
            o.tests.clear();
            for f in only {
                match TESTS
                    .iter()
                    .map(|t| t.test)
                    .chain([pg::TEST])
                    .find(|t| t == f)
                {
                    Some(t) => o.tests.push(t),
                    None => {
                        return Err(fail(format!(
                            "--only {f}: the tests are randread, randwrite, read, write and \
                             pgbench"
                        )))
                    }
                }
            }
        }
        if let Some(s) = &a.size {
            let n = parse_size(s)?;
            if !(4 << 20..=16 << 30).contains(&n) || n % (1 << 20) != 0 {
                return Err(fail("--size: whole MiB from 4M to 16G"));
            }
            o.size = n;
        }
        if let Some(d) = &a.dir {
            if !d.is_dir() {
                return Err(fail(format!("--dir {}: not a directory", d.display())));
            }
            o.dir = d.clone();
        }
        Ok(o)
    }

    /// Progress steps of one round (one per path of each fio run).
    pub fn steps(&self) -> u64 {
        (self.tests.len() * PATHS.len()) as u64
    }
}

/// What a run found besides its records.
#[derive(Default, Debug)]
pub struct Outcome {
    pub records: Vec<Record>,
    /// Lines a reader must see (the setup, a device without direct I/O).
    pub notes: Vec<String>,
    /// memloop figures whose I/O did not cross the export: a failure of the block device.
    pub not_routed: Vec<String>,
}

/// Runs the figures `o` asks for: `progress` is told the start of each step.
pub fn figures(o: &Opts, progress: &mut dyn FnMut(&str)) -> CliResult<Outcome> {
    let mut out = Outcome::default();
    for tool in ["fio", "losetup", "nbdkit", "nbdfuse", "fusermount3"] {
        if !have(tool) {
            return Err(fail(format!(
                "`{tool}` is not installed (apt-get install fio mount nbdkit nbdfuse fuse3)"
            )));
        }
    }
    if !std::path::Path::new("/dev/fuse").exists() {
        return Err(fail("no /dev/fuse here (both client paths are FUSE files)"));
    }
    if let Some(why) = o.tests.contains(&pg::TEST).then(pg::missing).flatten() {
        return Err(fail(format!("pgbench: {why}")));
    }
    let mut bed = bed::Bed::up(o)?;
    out.notes.push(bed.describe());
    for (i, p) in PATHS.iter().enumerate() {
        if bed.dio(i) != "on" {
            out.notes.push(format!(
                "{p}: the loop device {} does NOT do direct I/O (dio {}): its figures go \
                 through the page cache",
                bed.devs[i],
                bed.dio(i)
            ));
        }
    }
    let mut raw = Vec::new();
    for round in 1..=o.repeat {
        let tag = match o.repeat {
            1 => String::new(),
            n => format!("round {round}/{n}: "),
        };
        // Which path goes first rotates from round to round.
        let order: Vec<usize> = (0..PATHS.len())
            .map(|i| (i + round - 1) % PATHS.len())
            .collect();
        for t in TESTS.iter().filter(|t| o.tests.contains(&t.test)) {
            for &p in &order {
                progress(&format!(
                    "{tag}fio {} {} qd {} for {} s on {} ({})",
                    t.rw,
                    fmt_size(t.bs),
                    t.qd,
                    o.secs,
                    PATHS[p],
                    bed.devs[p]
                ));
                let r = figs::fio(&mut bed, p, t, o);
                raw.extend(bed.explain(r)?);
            }
        }
        if o.tests.contains(&pg::TEST) {
            for &p in &order {
                progress(&format!(
                    "{tag}PostgreSQL on ext4 on {} ({}): initdb, pgbench -c 1 and -c 4 for {} s",
                    PATHS[p], bed.devs[p], o.secs
                ));
                let r = pg::figures(&mut bed, p, o);
                raw.extend(bed.explain(r)?);
            }
        }
    }
    // A memloop figure with a round that did not cross the export is no figure at all.
    let unrouted: Vec<&'static str> = raw
        .iter()
        .filter(|r| r.unit == NOT_ROUTED)
        .map(|r| r.test)
        .collect();
    raw.retain(|r| !(r.path == MEMLOOP && unrouted.contains(&r.test) && r.unit != NOT_ROUTED));
    for r in raw.iter().filter(|r| r.unit == NOT_ROUTED) {
        out.not_routed
            .push(format!("{}: {}", r.test, r.note.as_deref().unwrap_or("")));
    }
    let total = bed.stats()?;
    out.notes.push(format!(
        "the export's counters at the end (its stats file, as `memloop status --json` shows \
         them): {} requests ({} reads, {} writes), {} B read, {} B written, {} errors",
        total.requests,
        total.reads,
        total.writes,
        total.bytes_read,
        total.bytes_written,
        total.errors
    ));
    drop(bed);
    let mut records = report::median_of_rounds(raw);
    ratios(&mut records);
    pg::ratios(&mut records);
    out.records = records;
    Ok(out)
}

/// Whether `tool` is on the PATH.
fn have(tool: &str) -> bool {
    std::process::Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

pub fn run(a: &BlkArgs) -> CliResult<()> {
    let o = Opts::from_args(a)?;
    let total = o.steps() * o.repeat as u64;
    let mut step = 0;
    let out = figures(&o, &mut |m| {
        step += 1;
        eprintln!("[{step}/{total}] {m}");
    })?;
    print(&out, &o);
    if let Some(f) = &a.json {
        report::write_json(&out.records, f)?;
        println!("results written to {}", f.display());
    }
    if out.not_routed.is_empty() {
        Ok(())
    } else {
        Err(fail(format!(
            "NOT ROUTED: I/O meant for the block device did not cross the export ({})",
            out.not_routed.join("; ")
        )))
    }
}

fn find<'a>(r: &'a [Record], test: &str, path: &str, unit: &str) -> Option<&'a Record> {
    r.iter()
        .find(|x| x.test == test && x.path == path && x.unit == unit)
}

/// Ratio records (memloop over NBD, memloop over the local file) for each test measured.
fn ratios(records: &mut Vec<Record>) {
    let mut add = Vec::new();
    for t in &TESTS {
        let Some(m) = find(records, t.test, MEMLOOP, t.unit) else {
            continue;
        };
        for (other, path) in [(NBD, RATIO_NBD), (LOCAL, RATIO_LOCAL)] {
            if let Some(x) = find(records, t.test, other, t.unit) {
                if m.value > 0.0 && x.value > 0.0 {
                    add.push(Record::new(t.test, path, t.bs, RATIO, m.value / x.value));
                }
            }
        }
    }
    records.extend(add);
}

/// The side-by-side table (rows: the fio runs; columns: the paths, the ratios, the targets).
pub fn table(r: &[Record]) -> String {
    let head = [
        "test",
        "block",
        "qd",
        "metric",
        MEMLOOP,
        NBD,
        LOCAL,
        "memloop / nbd",
        "target",
        "memloop / local",
        "target",
        "export copied B/B",
    ];
    let mut lines: Vec<Vec<String>> = vec![head.iter().map(|s| s.to_string()).collect()];
    let v = |x: Option<&Record>| x.map_or("-".to_string(), |x| report::fmt_num(x.value));
    let ratio = |test: &str, path: &str| {
        find(r, test, path, RATIO).map_or("-".to_string(), |x| format!("{:.2}×", x.value))
    };
    for t in &TESTS {
        let m = find(r, t.test, MEMLOOP, t.unit);
        let nr = find(r, t.test, MEMLOOP, NOT_ROUTED);
        let (n, l) = (find(r, t.test, NBD, t.unit), find(r, t.test, LOCAL, t.unit));
        if m.or(nr).or(n).or(l).is_none() {
            continue;
        }
        let copied =
            find(r, t.test, MEMLOOP, COPIED).map_or("-".to_string(), |x| format!("{:.2}", x.value));
        lines.push(vec![
            t.test.into(),
            fmt_size(t.bs),
            t.qd.to_string(),
            t.unit.into(),
            if nr.is_some() {
                "NOT ROUTED".into()
            } else {
                v(m)
            },
            v(n),
            v(l),
            ratio(t.test, RATIO_NBD),
            format!("≥ {TARGET_NBD}×"),
            ratio(t.test, RATIO_LOCAL),
            format!("≥ {TARGET_LOCAL}×"),
            copied,
        ]);
    }
    report::align(&lines)
}

/// The targets of the issue, from the ratio records, each said met or not.
pub fn targets(r: &[Record]) -> Vec<String> {
    let met = |ok: bool| if ok { "met" } else { "NOT met" };
    let mut out = Vec::new();
    for t in &TESTS {
        let what = format!("fio {} {} qd {}", t.rw, fmt_size(t.bs), t.qd);
        if find(r, t.test, MEMLOOP, NOT_ROUTED).is_some() {
            out.push(format!(
                "{what}: memloop NOT ROUTED, no figure (targets: ≥ {TARGET_NBD}× NBD, ≥ \
                 {TARGET_LOCAL}× local)"
            ));
            continue;
        }
        if let Some(x) = find(r, t.test, RATIO_NBD, RATIO) {
            out.push(format!(
                "{what}: memloop {:.2}× NBD over TCP in {} (target: ≥ {TARGET_NBD}×): {}",
                x.value,
                t.unit,
                met(x.value >= TARGET_NBD)
            ));
        }
        if let Some(x) = find(r, t.test, RATIO_LOCAL, RATIO) {
            out.push(format!(
                "{what}: memloop {:.2}× the local file in {} (target: ≥ {TARGET_LOCAL}×): {}",
                x.value,
                t.unit,
                met(x.value >= TARGET_LOCAL)
            ));
        }
    }
    out
}

fn print(out: &Outcome, o: &Opts) {
    println!(
        "memloop bench blk: MMBlk (`memloop blk export` / `attach`, a loop device on its FUSE \
         file) vs NBD over TCP (nbdkit / nbdfuse, a loop device on its FUSE file) between the \
         same two domains vs a loop device on a local file; fio --ioengine=libaio --direct=1 \
         --time_based --runtime={} in domain 1 (4 KiB random at qd 32, 1 MiB sequential at qd \
         8), then PostgreSQL on ext4 on each (initdb, pgbench over its Unix socket, fsync on); \
         backing files of {} in {}; {} round(s) (medians), the paths rotating; processes not \
         pinned{}",
        o.secs,
        fmt_size(o.size),
        o.dir.display(),
        o.repeat,
        if o.quick {
            " (--quick: a smoke run, not figures to quote)"
        } else {
            ""
        }
    );
    println!();
    if o.tests.iter().any(|t| *t != pg::TEST) {
        print!("{}", table(&out.records));
    }
    if let Some(t) = pg::table(&out.records) {
        println!();
        print!("{t}");
    }
    println!();
    println!("targets:");
    for t in targets(&out.records)
        .into_iter()
        .chain(pg::targets(&out.records))
    {
        println!("- {t}");
    }
    println!();
    for x in out.records.iter().filter(|x| x.note.is_some()) {
        println!(
            "- {} {} {}: {}",
            x.test,
            x.path,
            fmt_size(x.size),
            x.note.as_deref().unwrap_or("")
        );
    }
    for n in &out.notes {
        println!("- {n}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(test: &'static str, path: &'static str, unit: &'static str, v: f64) -> Record {
        Record::new(test, path, 4096, unit, v)
    }

    #[test]
    fn ratios_and_targets_follow_the_issue() {
        let mut r = vec![
            rec("randread", MEMLOOP, IOPS, 300.0),
            rec("randread", NBD, IOPS, 100.0),
            rec("randread", LOCAL, IOPS, 1000.0),
            rec("randread", MEMLOOP, COPIED, 1.0),
            rec("write", MEMLOOP, MIBS, 100.0),
            rec("write", NBD, MIBS, 80.0),
            rec("write", LOCAL, MIBS, 150.0),
        ];
        ratios(&mut r);
        let get = |t, p| find(&r, t, p, RATIO).map(|x| x.value);
        assert_eq!(get("randread", RATIO_NBD), Some(3.0));
        assert_eq!(get("randread", RATIO_LOCAL), Some(0.3));
        assert_eq!(get("write", RATIO_NBD), Some(1.25));
        let t = targets(&r);
        assert_eq!(t.len(), 4, "{t:?}");
        assert!(t[0].contains("3.00×") && t[0].ends_with(": met"), "{t:?}");
        assert!(t[1].ends_with("NOT met"), "{t:?}");
        assert!(t[2].ends_with("NOT met"), "{t:?}");
        assert!(t[3].ends_with(": met"), "{t:?}");
        let table = table(&r);
        assert_eq!(table.lines().count(), 3, "{table}");
        assert!(table.contains("3.00×") && table.contains("≥ 2×"), "{table}");
    }

    #[test]
    fn a_memloop_figure_not_routed_has_no_value_and_no_ratio() {
        let mut nr = rec("randread", MEMLOOP, NOT_ROUTED, 0.0);
        nr.note = Some("the export's counters grew by 0 requests".into());
        let mut r = vec![nr, rec("randread", NBD, IOPS, 10.0)];
        ratios(&mut r);
        assert!(find(&r, "randread", RATIO_NBD, RATIO).is_none());
        assert!(table(&r).contains("NOT ROUTED"));
        assert!(targets(&r)[0].contains("NOT ROUTED"));
    }
}
