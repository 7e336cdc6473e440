//! The testbed of `bench blk`: two domains of this run's own, its region, three backing files
//! (in /dev/shm unless `--dir` says where) and a loop device in domain 1 on each path:
//!
//! - memloop: `blk-service export` (this binary's `memloop blk export --foreground`) in
//!   domain 0, `blk-service attach` in domain 1 (its FUSE file, a loop device on it);
//! - NBD over TCP: `nbdkit file` in domain 0 on its bridge address, `nbdfuse` in domain 1
//!   (the export as a FUSE file) with `losetup --direct-io=on` on it, both in one shell of
//!   domain 1 that undoes them when its stdin closes;
//! - local file: `losetup --direct-io=on` in domain 1 on a file of its own.
//!
//! Dropping the bed undoes all of it, in reverse, also on error; if this process dies, the
//! blk services and the NBD client's shell see their stdin close and undo their own, nbdkit
//! exits with its parent, and the janitor removes the domains and the region.

use super::{Opts, LOCAL, MEMLOOP, NBD};
use crate::bench::bgproc::BgProcess as Svc;
use crate::bench::tcp::procs::Testbed;
use crate::error::{fail, CliResult, Context};
use memloop::registry::header::RegionParams;
use memloop::{CreateRegion, RegionSpec};
use serde_json::Value;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// The export's name (the region is this run's own).
const NAME: &str = "bench";
/// The region's size: room for the sessions' buffer pools (queue depth × largest I/O, on
/// both sides), as `memloop blk`'s own tests give it.
const REGION_BYTES: u64 = 256 << 20;
/// nbdkit's port in domain 0 (the domain's network is this run's own).
const NBD_PORT: u16 = 10809;

/// The export's counters, as its stats file (and `memloop status --json`'s "blk") has them.
#[derive(Clone, Copy, Default, Debug)]
pub struct ExportStats {
    pub updated: u64,
    pub requests: u64,
    pub reads: u64,
    pub writes: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub flushes: u64,
    pub errors: u64,
}

impl ExportStats {
    fn of(v: &Value) -> ExportStats {
        let g = |k: &str| v[k].as_u64().unwrap_or(0);
        ExportStats {
            updated: g("updated"),
            requests: g("requests"),
            reads: g("reads"),
            writes: g("writes"),
            bytes_read: g("bytes_read"),
            bytes_written: g("bytes_written"),
            flushes: g("flushes"),
            errors: g("errors"),
        }
    }

    pub fn since(&self, b: &ExportStats) -> ExportStats {
        ExportStats {
            updated: self.updated,
            requests: self.requests.saturating_sub(b.requests),
            reads: self.reads.saturating_sub(b.reads),
            writes: self.writes.saturating_sub(b.writes),
            bytes_read: self.bytes_read.saturating_sub(b.bytes_read),
            bytes_written: self.bytes_written.saturating_sub(b.bytes_written),
            flushes: self.flushes.saturating_sub(b.flushes),
            errors: self.errors.saturating_sub(b.errors),
        }
    }
}

pub struct Bed {
    // Stopped in this order by the drop: the clients first, then the servers.
    nbd_client: Option<Svc>,
    attach: Option<Svc>,
    local: Option<Svc>,
    nbd_server: Option<Svc>,
    export: Option<Svc>,
    /// Loop devices: memloop's, NBD's, the local file's.
    pub devs: [String; 3],
    files: Vec<PathBuf>,
    nbd_mnt: PathBuf,
    tb: Testbed,
    exe: PathBuf,
    prefix: String,
    region_name: String,
    size: u64,
    dir: PathBuf,
}

impl Bed {
    pub fn up(o: &Opts) -> CliResult<Bed> {
        if !rustix::process::geteuid().is_root() {
            return Err(fail(
                "`memloop bench blk` needs root: it creates network namespaces (domains), FUSE \
                 mounts and loop devices",
            ));
        }
        let pid = std::process::id();
        let prefix = format!("mbk{pid}");
        let region_name = format!("bench-blk-{pid}");
        let mut tb = Testbed::up_named(&prefix, std::slice::from_ref(&region_name))?;
        tb.create_region_with(
            &region_name,
            &CreateRegion {
                params: RegionParams::for_size(REGION_BYTES),
                ..CreateRegion::default()
            },
        )?;
        let exe = std::env::current_exe().context("locating the memloop-bench binary")?;
        let mut bed = Bed {
            nbd_client: None,
            attach: None,
            nbd_server: None,
            export: None,
            devs: Default::default(),
            local: None,
            files: Vec::new(),
            nbd_mnt: std::env::temp_dir().join(format!("memloop-bench-blk-{pid}-nbd")),
            tb,
            exe,
            prefix,
            region_name,
            size: o.size,
            dir: o.dir.clone(),
        };
        for p in [MEMLOOP, NBD, LOCAL] {
            let f = o.dir.join(format!("memloop-bench-blk-{pid}-{p}.img"));
            bed.files.push(f.clone());
            fill(&f, o.size)?;
        }
        bed.up_memloop()?;
        bed.up_nbd()?;
        bed.up_local()?;
        Ok(bed)
    }

    fn file(&self, i: usize) -> String {
        self.files[i].to_string_lossy().into_owned()
    }

    fn up_memloop(&mut self) -> CliResult<()> {
        let f = self.file(0);
        let r = self.region_name.clone();
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<String>>();
        let argv = self.tb.command_of(
            "blk-service",
            0,
            None,
            None,
            &s(&["export", NAME, "--file", &f, "--region", &r, "--foreground"]),
        );
        let env = [("MEMLOOP_BLK_NOTIFY", "1"), (super::STOP_ON_EOF, "1")];
        let (svc, _) = Svc::start("blk", "the blk export (domain 0)", &argv, &env, true)?;
        self.export = Some(svc);
        let argv = self.tb.command_of(
            "blk-service",
            1,
            None,
            None,
            &s(&["attach", NAME, "--region", &r, "--foreground"]),
        );
        let (svc, dev) = Svc::start("blk", "the blk attach (domain 1)", &argv, &env, true)?;
        self.attach = Some(svc);
        if !dev.starts_with("/dev/loop") {
            return Err(fail(format!(
                "blk attach printed {dev:?}, not a loop device"
            )));
        }
        self.devs[0] = dev;
        Ok(())
    }

    fn up_nbd(&mut self) -> CliResult<()> {
        let addr = self.tb.addr(0);
        let f = self.file(1);
        let server = self.in_domain(
            0,
            &[
                "nbdkit",
                "-f",
                "--exit-with-parent",
                "-i",
                &addr.to_string(),
                "-p",
                &NBD_PORT.to_string(),
                "file",
                &f,
            ],
        );
        let (mut svc, _) = Svc::start("blk", "nbdkit (domain 0)", &server, &[], false)?;
        svc.wait_listen(NBD_PORT)?;
        self.nbd_server = Some(svc);
        let mnt = self.nbd_mnt.to_string_lossy().into_owned();
        let pidf = format!("{mnt}.pid");
        let uri = format!("nbd://{addr}:{NBD_PORT}");
        let client = self.in_domain(
            1,
            &["sh", "-c", NBD_CLIENT, "nbd-client", &mnt, &uri, &pidf],
        );
        let (svc, dev) = Svc::start("blk", "nbdfuse (domain 1)", &client, &[], true)?;
        self.nbd_client = Some(svc);
        if !dev.starts_with("/dev/loop") {
            return Err(fail(format!(
                "the nbdfuse loop device: got {dev:?}, not a loop device"
            )));
        }
        self.devs[1] = dev;
        Ok(())
    }

    /// The local file's loop device, held by a shell in domain 1 that, once its stdin
    /// closes, detaches it and removes the run's backing files (also if this process dies).
    fn up_local(&mut self) -> CliResult<()> {
        // The local file first ($1), then the others.
        let files: Vec<String> = [2, 0, 1].map(|i| self.file(i)).to_vec();
        let mut cmd = vec!["sh", "-c", LOCAL_KEEPER, "local-keeper"];
        cmd.extend(files.iter().map(String::as_str));
        let argv = self.in_domain(1, &cmd);
        let (svc, dev) = Svc::start(
            "blk",
            "the local file's losetup (domain 1)",
            &argv,
            &[],
            true,
        )?;
        self.local = Some(svc);
        if !dev.starts_with("/dev/loop") {
            return Err(fail(format!(
                "losetup on {}: got {dev:?}, not a loop device",
                files[0]
            )));
        }
        self.devs[2] = dev;
        Ok(())
    }

    /// The argv running `cmd` in domain `d`.
    pub fn in_domain(&self, d: u8, cmd: &[&str]) -> Vec<String> {
        let mut v = vec![
            self.exe.to_string_lossy().into_owned(),
            "domains".into(),
            "exec".into(),
            d.to_string(),
            "--prefix".into(),
            self.prefix.clone(),
            "--".into(),
        ];
        v.extend(cmd.iter().map(|s| s.to_string()));
        v
    }

    /// Fails if a service of the bed has exited.
    pub fn check(&mut self) -> CliResult<()> {
        for s in [
            &mut self.export,
            &mut self.attach,
            &mut self.local,
            &mut self.nbd_server,
            &mut self.nbd_client,
        ]
        .into_iter()
        .flatten()
        {
            s.check()?;
        }
        Ok(())
    }

    /// A failed measurement's error, with the service that exited if that explains it.
    pub fn explain<T>(&mut self, r: CliResult<T>) -> CliResult<T> {
        r.map_err(|e| match self.check() {
            Err(why) => fail(format!("{e} ({why})")),
            Ok(()) => e,
        })
    }

    /// The export's counters now (its stats file in the region's wake directory, refreshed
    /// every second by the service, as `memloop status --json` reads it).
    pub fn stats(&self) -> CliResult<ExportStats> {
        let spec = RegionSpec::parse(&self.region_name);
        let v = memloop_cli::blk_cmd::blk_json(&spec.path());
        v["exports"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|e| e["name"] == NAME)
            .map(ExportStats::of)
            .ok_or_else(|| fail(format!("export {NAME} is not in the blk status: {v}")))
    }

    /// Whether each loop device does direct I/O (`/sys/block/loopN/loop/dio`).
    pub fn dio(&self, i: usize) -> String {
        let d = self.devs[i].trim_start_matches("/dev/");
        match std::fs::read_to_string(format!("/sys/block/{d}/loop/dio")) {
            Ok(s) if s.trim() == "1" => "on".into(),
            Ok(_) => "OFF".into(),
            Err(_) => "?".into(),
        }
    }

    pub fn describe(&self) -> String {
        format!(
            "storage in domain 0, client (fio, postgres) in domain 1, backing files of {} MiB \
             in {} ({}), \
             one per path; memloop: `memloop blk export` in domain 0, `memloop blk attach` in \
             domain 1 → {} (direct I/O {}), region {}; NBD over TCP: nbdkit file plugin on \
             {}:{NBD_PORT} in domain 0, nbdfuse (FUSE file) + losetup --direct-io=on in domain \
             1 → {} (direct I/O {}); local file: losetup --direct-io=on in domain 1 → {} \
             (direct I/O {}); all loop devices 512 B sectors",
            self.size >> 20,
            self.dir.display(),
            fs_type(&self.dir),
            self.devs[0],
            self.dio(0),
            self.region_name,
            self.tb.addr(0),
            self.devs[1],
            self.dio(1),
            self.devs[2],
            self.dio(2),
        )
    }
}

/// Domain 1's NBD client: nbdfuse on `$1` (the export as `$1/nbd`), a loop device on it
/// printed, then, once stdin closes, both undone.
const NBD_CLIENT: &str = r#"
mnt="$1"; uri="$2"; pidf="$3"
mkdir -p "$mnt"; rm -f "$pidf"
nbdfuse -P "$pidf" "$mnt" "$uri" >&2 &
np=$!
i=0
while [ ! -s "$pidf" ]; do
  i=$((i + 1))
  if [ $i -gt 400 ] || ! kill -0 $np 2>/dev/null; then
    echo "nbdfuse did not come up" >&2; kill $np 2>/dev/null; exit 1
  fi
  sleep 0.05
done
if ! dev=$(losetup --direct-io=on --find --show "$mnt/nbd"); then
  fusermount3 -u "$mnt"; wait $np; exit 1
fi
echo "$dev"
cat >/dev/null
losetup -d "$dev"
fusermount3 -u "$mnt" || umount -l "$mnt"
wait $np
rm -f "$pidf"; rmdir "$mnt"
"#;

/// Domain 1's loop device on the local file `$1` (printed), then, once stdin closes, detached
/// and the run's backing files (`$1 $2 …`) removed.
const LOCAL_KEEPER: &str = r#"
dev=$(losetup --direct-io=on --find --show "$1") || { rm -f "$@"; exit 1; }
echo "$dev"
cat >/dev/null
losetup -d "$dev"
rm -f "$@"
"#;

impl Drop for Bed {
    fn drop(&mut self) {
        // The NBD client's shell detaches its loop device and unmounts once stdin closes.
        if let Some(mut s) = self.nbd_client.take() {
            s.stop(false, Duration::from_secs(15));
        }
        // The attach service detaches its loop device and unmounts on SIGTERM.
        if let Some(mut s) = self.attach.take() {
            s.stop(true, Duration::from_secs(15));
        }
        if let Some(mut s) = self.local.take() {
            s.stop(false, Duration::from_secs(10));
        }
        // Loop devices still on our files (a client that did not undo its own).
        for d in &self.devs {
            if d.is_empty() {
                continue;
            }
            let back = std::fs::read_to_string(format!(
                "/sys/block/{}/loop/backing_file",
                d.trim_start_matches("/dev/")
            ))
            .unwrap_or_default();
            let ours = back.contains(&format!("memloop-bench-blk-{}", std::process::id()))
                || back.contains(&self.region_name);
            if ours && !back.is_empty() {
                let _ = Command::new("losetup").args(["-d", d]).status();
            }
        }
        if let Some(mut s) = self.nbd_server.take() {
            s.stop(true, Duration::from_secs(5));
        }
        if let Some(mut s) = self.export.take() {
            s.stop(true, Duration::from_secs(15));
        }
        let m = self.nbd_mnt.clone();
        if m.exists() {
            let _ = rustix::mount::unmount(&m, rustix::mount::UnmountFlags::DETACH);
            let _ = std::fs::remove_dir(&m);
        }
        let _ = std::fs::remove_file(m.with_extension("pid"));
        for f in &self.files {
            let _ = std::fs::remove_file(f);
        }
        // Then the testbed's own drop: the domains, the region, the janitor.
    }
}

/// Writes `size` bytes of a non-zero pattern to `path` (no holes: every path reads data).
fn fill(path: &Path, size: u64) -> CliResult<()> {
    let mut f = std::fs::File::create(path).context(format!("creating {}", path.display()))?;
    let mut buf = vec![0u8; 1 << 20];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    let mut left = size;
    while left > 0 {
        let n = left.min(buf.len() as u64) as usize;
        f.write_all(&buf[..n])
            .context(format!("writing {}", path.display()))?;
        left -= n as u64;
    }
    Ok(())
}

/// The file system type of `dir` (`stat -f`), or "?".
fn fs_type(dir: &Path) -> String {
    Command::new("stat")
        .args(["-f", "-c", "%T"])
        .arg(dir)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map_or("?".into(), |o| {
            String::from_utf8_lossy(&o.stdout).trim().to_string()
        })
}
