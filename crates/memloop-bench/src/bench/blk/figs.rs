//! One measurement of `bench blk`: fio in domain 1 on one path's loop device. A memloop figure
//! is kept only if the export's counters show fio's I/O crossed the region.

use super::bed::{Bed, ExportStats};
use super::{Fio, Opts, COPIED, MEMLOOP, NOT_ROUTED, PATHS};
use crate::bench::report::Record;
use crate::bench::sys::run_bounded;
use crate::error::{fail, CliResult};
use serde_json::Value;
use std::time::{Duration, Instant};

/// What fio did in one job.
struct Done {
    io_bytes: u64,
    iops: f64,
    bw_bytes: f64,
}

fn parse(stdout: &str, dir: &str) -> CliResult<Done> {
    // fio may print notes before its JSON.
    let at = stdout
        .find('{')
        .ok_or_else(|| fail("fio printed no JSON"))?;
    let v: Value =
        serde_json::from_str(&stdout[at..]).map_err(|e| fail(format!("fio's JSON: {e}")))?;
    let job = &v["jobs"][0];
    if job["error"].as_u64().unwrap_or(0) != 0 {
        return Err(fail(format!("fio: job error {}", job["error"])));
    }
    let d = &job[dir];
    Ok(Done {
        io_bytes: d["io_bytes"].as_u64().unwrap_or(0),
        iops: d["iops"].as_f64().unwrap_or(0.0),
        bw_bytes: d["bw_bytes"].as_f64().unwrap_or(0.0),
    })
}

/// The export's counters once they cover `want` bytes in direction `dir` (the service
/// publishes them every second: give it up to 4 s), or the last look.
fn after(bed: &Bed, before: &ExportStats, dir: &str, want: u64) -> CliResult<(ExportStats, bool)> {
    let deadline = Instant::now() + Duration::from_secs(4);
    loop {
        let grew = bed.stats()?.since(before);
        let moved = if dir == "read" {
            grew.bytes_read
        } else {
            grew.bytes_written
        };
        if moved >= want {
            return Ok((grew, true));
        }
        if Instant::now() >= deadline {
            return Ok((grew, false));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// fio `t` on path `p` (an index into [`PATHS`]): the figure, and for memloop the bytes the
/// export copied per byte fio moved.
pub fn fio(bed: &mut Bed, p: usize, t: &Fio, o: &Opts) -> CliResult<Vec<Record>> {
    bed.check()?;
    let path = PATHS[p];
    let before = if path == MEMLOOP {
        Some(bed.stats()?)
    } else {
        None
    };
    let (filename, rw, bs, qd, runtime) = (
        format!("--filename={}", bed.devs[p]),
        format!("--rw={}", t.rw),
        format!("--bs={}", t.bs),
        format!("--iodepth={}", t.qd),
        format!("--runtime={}", o.secs),
    );
    let mut args = vec![
        "fio",
        "--name=bench-blk",
        &filename,
        "--ioengine=libaio",
        "--direct=1",
        &qd,
        &rw,
        &bs,
        "--time_based",
        &runtime,
        "--output-format=json",
    ];
    if t.rw.starts_with("rand") {
        args.extend(["--randrepeat=0", "--norandommap"]);
    }
    let argv = bed.in_domain(1, &args);
    let r = run_bounded(&argv, Duration::from_secs(o.secs + 60))?;
    if !r.status.success() {
        return Err(fail(format!(
            "fio {} on {} ({path}) failed ({}): {}",
            t.rw,
            bed.devs[p],
            r.status,
            r.stderr.trim()
        )));
    }
    let dir = if t.rw.contains("read") {
        "read"
    } else {
        "write"
    };
    let d = parse(&r.stdout, dir)?;
    if d.io_bytes == 0 {
        return Err(fail(format!(
            "fio {} on {} ({path}) moved nothing",
            t.rw, bed.devs[p]
        )));
    }
    let value = if t.unit == super::IOPS {
        d.iops
    } else {
        d.bw_bytes / f64::from(1 << 20)
    };
    let mut rec = Record::new(t.test, path, t.bs, t.unit, value);
    let Some(before) = before else {
        return Ok(vec![rec]);
    };
    let (grew, routed) = after(bed, &before, dir, d.io_bytes)?;
    let moved = if dir == "read" {
        grew.bytes_read
    } else {
        grew.bytes_written
    };
    let seen = format!(
        "the export's counters grew by {} requests ({} reads, {} writes), {moved} B {} \
         (fio {}: {} B), {} errors",
        grew.requests,
        grew.reads,
        grew.writes,
        if dir == "read" { "read" } else { "written" },
        if dir == "read" { "read" } else { "wrote" },
        d.io_bytes,
        grew.errors
    );
    if !routed {
        let mut nr = Record::new(t.test, MEMLOOP, t.bs, NOT_ROUTED, 0.0);
        nr.note = Some(seen);
        return Ok(vec![nr]);
    }
    rec.note = Some(seen);
    // The export's bytes are its one copy (pread into the pool / pwrite from it).
    let copied = Record::new(
        t.test,
        MEMLOOP,
        t.bs,
        COPIED,
        moved as f64 / d.io_bytes as f64,
    );
    Ok(vec![rec, copied])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fio_json_after_notes_is_read() {
        let out = "note: something\n{\"jobs\": [{\"error\": 0, \"read\": {\"io_bytes\": 4096, \
                   \"iops\": 1.5, \"bw_bytes\": 2048.0}}]}";
        let d = parse(out, "read").unwrap();
        assert_eq!(d.io_bytes, 4096);
        assert_eq!(d.iops, 1.5);
        assert_eq!(d.bw_bytes, 2048.0);
        assert!(parse("no json", "read").is_err());
    }
}
