//! The database figure of `bench blk`: PostgreSQL on an ext4 file system on one path's loop
//! device (in domain 1), `initdb` and then `pgbench` over the server's Unix socket (no network
//! in the measurement), durable as shipped: fsync, synchronous commit and full-page writes on.
//! Every round starts from a fresh file system (fio's runs write over the raw device).

use super::bed::Bed;
use super::{
    Opts, LOCAL, MEMLOOP, NBD, NOT_ROUTED, PATHS, RATIO, RATIO_LOCAL, RATIO_NBD, TARGET_PG,
};
use crate::bench::report::{self, Record};
use crate::bench::study::progs::{parse_pgbench, pg_bin, AS_POSTGRES};
use crate::bench::sys::run_bounded;
use crate::error::{fail, CliResult};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// The test's name in `--only`, the records and the table.
pub const TEST: &str = "pgbench";
/// Transactions per second.
pub const TPS: &str = "TPS";
/// Seconds `initdb` took (its own syncs included).
pub const INITDB: &str = "initdb s";
/// The client counts measured (`pgbench -c N -j min(N, 2)`); a record's size is N.
pub const CLIENTS: [u64; 2] = [1, 4];

/// What is missing for the figure (None: it can run).
pub fn missing() -> Option<String> {
    if pg_bin().is_none() {
        return Some(
            "no PostgreSQL server under /usr/lib/postgresql (apt-get install postgresql)".into(),
        );
    }
    for tool in ["pgbench", "mkfs.ext4", "setpriv"] {
        if !super::have(tool) {
            return Some(format!("`{tool}` is not installed"));
        }
    }
    let user = Command::new("id").args(["-u", "postgres"]).output();
    if !user.is_ok_and(|o| o.status.success()) {
        return Some("no user postgres".into());
    }
    None
}

/// pgbench's scale (rows: 100,000 × scale): ~15 MiB per unit, and the cluster itself (~40 MiB)
/// and its WAL (up to 64 MiB) beside it, inside the backing file.
fn scale(o: &Opts) -> u32 {
    ((o.size >> 20) / 128).clamp(1, 8) as u32
}

/// One path's database: its file system mounted, a cluster initialised, the postmaster up;
/// all undone on drop.
struct Db<'a> {
    bed: &'a Bed,
    bin: PathBuf,
    mnt: PathBuf,
    mounted: bool,
    started: bool,
}

impl Db<'_> {
    fn data(&self) -> PathBuf {
        self.mnt.join("data")
    }

    fn sock(&self) -> PathBuf {
        self.mnt.join("sock")
    }

    fn bin(&self, x: &str) -> String {
        self.bin.join(x).to_string_lossy().into_owned()
    }

    /// `cmd` as the postgres user, in domain 1.
    fn as_pg(&self, cmd: &[&str]) -> Vec<String> {
        let mut v = AS_POSTGRES.to_vec();
        v.extend_from_slice(cmd);
        self.bed.in_domain(1, &v)
    }

    fn run(&self, what: &str, argv: &[String], secs: u64) -> CliResult<String> {
        let r = run_bounded(argv, Duration::from_secs(secs))?;
        if !r.status.success() {
            return Err(fail(format!(
                "{what} failed ({}): {}",
                r.status,
                last_lines(&format!("{}{}", r.stdout, r.stderr))
            )));
        }
        Ok(r.stdout)
    }

    /// mkfs, mount, initdb (timed), start.
    fn up(&mut self, dev: &str) -> CliResult<f64> {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        self.run(
            &format!("mkfs.ext4 on {dev}"),
            &self.bed.in_domain(1, &["mkfs.ext4", "-q", "-F", dev]),
            120,
        )?;
        std::fs::create_dir_all(&self.mnt)?;
        let mnt = self.mnt.to_string_lossy().into_owned();
        self.run(&format!("mounting {dev}"), &s(&["mount", dev, &mnt]), 60)?;
        self.mounted = true;
        for d in [self.data(), self.sock()] {
            let d = d.to_string_lossy().into_owned();
            let argv = s(&[
                "install", "-d", "-o", "postgres", "-g", "postgres", "-m", "700", &d,
            ]);
            self.run("creating the database directories", &argv, 10)?;
        }
        let data = self.data().to_string_lossy().into_owned();
        let t = Instant::now();
        let initdb = self.bin("initdb");
        let argv = self.as_pg(&[
            &initdb,
            "-D",
            &data,
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
        ]);
        self.run("initdb", &argv, 300)?;
        let initdb_s = t.elapsed().as_secs_f64();
        let opts = format!(
            "-c listen_addresses='' -c unix_socket_directories={} -c shared_buffers=64MB \
             -c max_wal_size=64MB -c min_wal_size=32MB",
            self.sock().display()
        );
        let log = self
            .sock()
            .join("postgres.log")
            .to_string_lossy()
            .into_owned();
        let pg_ctl = self.bin("pg_ctl");
        let argv = self.as_pg(&[
            &pg_ctl, "-D", &data, "-l", &log, "-w", "-t", "60", "-o", &opts, "start",
        ]);
        self.run("starting postgres", &argv, 90)?;
        self.started = true;
        Ok(initdb_s)
    }

    fn pgbench(&self, args: &[&str], secs: u64) -> CliResult<String> {
        let sock = self.sock().to_string_lossy().into_owned();
        let mut v = vec!["pgbench", "-h", &sock, "-U", "postgres"];
        v.extend_from_slice(args);
        v.push("postgres");
        self.run(
            &format!("pgbench {}", args.join(" ")),
            &self.as_pg(&v),
            secs,
        )
    }
}

impl Drop for Db<'_> {
    fn drop(&mut self) {
        let data = self.data().to_string_lossy().into_owned();
        if self.started {
            let pg_ctl = self.bin("pg_ctl");
            let argv = self.as_pg(&[&pg_ctl, "-D", &data, "-m", "fast", "-w", "-t", "60", "stop"]);
            let _ = run_bounded(&argv, Duration::from_secs(90));
        }
        if self.mounted {
            let _ = rustix::mount::unmount(&self.mnt, rustix::mount::UnmountFlags::empty());
        }
        let _ = std::fs::remove_dir(&self.mnt);
    }
}

fn last_lines(s: &str) -> String {
    let l: Vec<&str> = s.lines().collect();
    l[l.len().saturating_sub(4)..].join(" | ")
}

/// The database figures on path `p`: initdb's seconds and pgbench's TPS at each client
/// count; for memloop, only if the export's counters saw the database's writes.
pub fn figures(bed: &mut Bed, p: usize, o: &Opts) -> CliResult<Vec<Record>> {
    bed.check()?;
    let path = PATHS[p];
    let bin = pg_bin().ok_or_else(|| fail("no PostgreSQL server"))?;
    let before = match path == MEMLOOP {
        true => Some(bed.stats()?),
        false => None,
    };
    let mnt = mount_dir(path);
    let mut db = Db {
        bed,
        bin,
        mnt,
        mounted: false,
        started: false,
    };
    let initdb_s = db.up(&bed.devs[p])?;
    let sc = scale(o).to_string();
    db.pgbench(&["-i", "-q", "-s", &sc], 600)?;
    let mut out = vec![Record::new(TEST, path, 0, INITDB, initdb_s)];
    for c in CLIENTS {
        let (n, j, t) = (c.to_string(), c.min(2).to_string(), o.secs.to_string());
        let text = db.pgbench(&["-c", &n, "-j", &j, "-T", &t], o.secs + 120)?;
        let tps = parse_pgbench(&text).ok_or_else(|| {
            fail(format!(
                "pgbench -c {c} on {path}: no tps in {}",
                last_lines(&text)
            ))
        })?;
        out.push(Record::new(TEST, path, c, TPS, tps));
    }
    drop(db);
    let Some(before) = before else {
        return Ok(out);
    };
    // The services publish their counters every second.
    std::thread::sleep(Duration::from_millis(1200));
    let grew = bed.stats()?.since(&before);
    let seen = format!(
        "the export's counters grew by {} requests ({} writes, {} B written, {} flushes), {} \
         errors",
        grew.requests, grew.writes, grew.bytes_written, grew.flushes, grew.errors
    );
    // (A memory-backed export has no volatile cache: the attach answers flushes itself.)
    if grew.bytes_written < 16 << 20 {
        let mut nr = Record::new(TEST, MEMLOOP, 0, NOT_ROUTED, 0.0);
        nr.note = Some(seen);
        return Ok(vec![nr]);
    }
    out[0].note = Some(seen);
    Ok(out)
}

fn mount_dir(path: &str) -> PathBuf {
    Path::new(&std::env::temp_dir()).join(format!(
        "memloop-bench-blk-{}-pg-{path}",
        std::process::id()
    ))
}

fn find<'a>(r: &'a [Record], path: &str, size: u64, unit: &str) -> Option<&'a Record> {
    r.iter()
        .find(|x| x.test == TEST && x.path == path && x.size == size && x.unit == unit)
}

/// Ratio records of the TPS (memloop over NBD, memloop over the local file), per client count.
pub fn ratios(records: &mut Vec<Record>) {
    let mut add = Vec::new();
    for c in CLIENTS {
        let Some(m) = find(records, MEMLOOP, c, TPS) else {
            continue;
        };
        for (other, path) in [(NBD, RATIO_NBD), (LOCAL, RATIO_LOCAL)] {
            if let Some(x) = find(records, other, c, TPS).filter(|x| x.value > 0.0) {
                add.push(Record::new(TEST, path, c, RATIO, m.value / x.value));
            }
        }
    }
    records.extend(add);
}

/// The database table (rows: initdb and each client count; columns: the paths, the ratios),
/// or nothing if it did not run.
pub fn table(r: &[Record]) -> Option<String> {
    if !r.iter().any(|x| x.test == TEST) {
        return None;
    }
    let head = [
        "PostgreSQL",
        "metric",
        MEMLOOP,
        NBD,
        LOCAL,
        "memloop / nbd",
        "memloop / local",
        "target",
    ];
    let mut lines: Vec<Vec<String>> = vec![head.iter().map(|s| s.to_string()).collect()];
    let v = |p: &str, size: u64, unit: &str| {
        find(r, p, size, unit).map_or("-".to_string(), |x| report::fmt_num(x.value))
    };
    let initdb =
        |p: &str| find(r, p, 0, INITDB).map_or("-".to_string(), |x| format!("{:.2}", x.value));
    let routed = find(r, MEMLOOP, 0, NOT_ROUTED).is_none();
    lines.push(vec![
        "initdb".into(),
        "seconds".into(),
        if routed {
            initdb(MEMLOOP)
        } else {
            "NOT ROUTED".into()
        },
        initdb(NBD),
        initdb(LOCAL),
        "-".into(),
        "-".into(),
        "-".into(),
    ]);
    for c in CLIENTS {
        let ratio =
            |p: &str| find(r, p, c, RATIO).map_or("-".to_string(), |x| format!("{:.2}×", x.value));
        lines.push(vec![
            format!("pgbench -c {c}"),
            TPS.into(),
            if routed {
                v(MEMLOOP, c, TPS)
            } else {
                "NOT ROUTED".into()
            },
            v(NBD, c, TPS),
            v(LOCAL, c, TPS),
            ratio(RATIO_NBD),
            ratio(RATIO_LOCAL),
            format!("≥ {TARGET_PG}×"),
        ]);
    }
    Some(report::align(&lines))
}

/// The PostgreSQL target at each client count, said met or not.
pub fn targets(r: &[Record]) -> Vec<String> {
    let mut out = Vec::new();
    if find(r, MEMLOOP, 0, NOT_ROUTED).is_some() {
        out.push(format!("PostgreSQL: memloop NOT ROUTED, no figure (target: ≥ {TARGET_PG}× the local file's TPS)"));
        return out;
    }
    for c in CLIENTS {
        if let Some(x) = find(r, RATIO_LOCAL, c, RATIO) {
            let met = if x.value >= TARGET_PG {
                "met"
            } else {
                "NOT met"
            };
            out.push(format!(
                "PostgreSQL pgbench -c {c}: memloop {:.2}× the local file's TPS (target: ≥ {TARGET_PG}×): {met}",
                x.value
            ));
        }
    }
    out
}
