//! A tiny measurement (not a benchmark suite): 4 KiB random writes, then reads, at queue
//! depth 32, against a tmpfs-backed file exported by a server in another process; with the
//! bytes each side copied per request, as the counters say.
//!
//! `cargo run --release -p memloop-blk --example iops [SECONDS] [QD]` (default 2 s, 32).
//! The file lives in /dev/shm (`BLK_IOPS_DIR` to change it); the server serves each client
//! on one thread (`BLK_IOPS_WORKERS=N` for N I/O threads).

use memloop::{CreateRegion, Node, Region, RegionSpec};
use memloop_blk::{BlkClient, BlkServer, ClientOptions};
use rand::{Rng, SeedableRng};
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const ROLE: &str = "BLK_IOPS_ROLE";
const SIZE: u64 = 256 << 20;
const IO: u32 = 4096;

fn main() {
    if std::env::var(ROLE).is_ok() {
        server();
        return;
    }
    let mut args = std::env::args().skip(1);
    let secs: f64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(2.0);
    let qd: u32 = args.next().and_then(|a| a.parse().ok()).unwrap_or(32);
    let name = format!("blk-iops-{}", std::process::id());
    let spec = RegionSpec::Named(name.clone());
    let _ = Region::destroy(&spec);
    let region = Region::open_or_create(
        &spec,
        &CreateRegion {
            params: memloop::registry::RegionParams::for_size(512 << 20),
            ..CreateRegion::default()
        },
    )
    .expect("region");
    let dir = std::env::var("BLK_IOPS_DIR").unwrap_or_else(|_| "/dev/shm".into());
    let path = PathBuf::from(dir).join(format!("blk-iops-data-{}", std::process::id()));
    let _cleanup = Cleanup {
        path: path.clone(),
        spec: spec.clone(),
    };
    // Written through once, so reads find pages, not holes.
    std::fs::write(&path, vec![0x5au8; SIZE as usize]).expect("backing file");

    let mut child = Command::new(std::env::current_exe().unwrap())
        .env(ROLE, "server")
        .env("MEMLOOP_REGION", &name)
        .env("BLK_IOPS_FILE", &path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("server process");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "ready");

    let node = Node::join(region, "iops-client").expect("join");
    let opts = ClientOptions {
        queue_depth: qd,
        max_io: 128 << 10,
        ..ClientOptions::default()
    };
    let mut c = BlkClient::connect_with(&node, "iops", opts).expect("attach");
    let blocks = SIZE / IO as u64;
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    println!("4 KiB random I/O, queue depth {qd}, {secs} s each, server in another process, file on tmpfs");
    for write in [true, false] {
        let (mut tag, mut done) = (0u64, 0u64);
        let copied0 = c.stats().copied_bytes;
        let start = Instant::now();
        let run = Duration::from_secs_f64(secs);
        loop {
            let more = start.elapsed() < run;
            if !more && c.in_flight() == 0 {
                break;
            }
            while more && c.outstanding() < qd as usize {
                tag += 1;
                let off = rng.gen_range(0..blocks) * IO as u64;
                if write {
                    let mut b = c.write_buf().unwrap();
                    // The data is produced in place (a stamp here; the FUSE frontend reads
                    // the kernel's request into this very buffer).
                    let p = b.payload_mut(IO as usize).unwrap();
                    p[..8].copy_from_slice(&tag.to_le_bytes());
                    c.submit_write(tag, off, b, false).unwrap();
                } else {
                    c.submit_read(tag, off, IO).unwrap();
                }
            }
            for comp in c.complete(None).unwrap() {
                assert!(comp.is_ok());
                // The data is used in place (the FUSE frontend writev()s it to the kernel).
                if !write {
                    std::hint::black_box(comp.data()[0]);
                }
                done += 1;
            }
        }
        let t = start.elapsed().as_secs_f64();
        let copied = c.stats().copied_bytes - copied0;
        println!(
            "  {}: {:>8.0} IOPS ({:.0} MiB/s), client user-space copies {} B/request",
            if write { "write" } else { "read " },
            done as f64 / t,
            done as f64 * IO as f64 / t / (1 << 20) as f64,
            copied / done.max(1)
        );
    }
    // The helpers copy, and count it.
    let c0 = c.stats().copied_bytes;
    let mut buf = vec![0u8; IO as usize];
    c.write_at(0, &buf, false).unwrap();
    c.read_at(0, &mut buf).unwrap();
    println!(
        "  (write_at + read_at of 4 KiB: the helpers copied {} B in user space)",
        c.stats().copied_bytes - c0
    );
    drop(c);
    drop(child.stdin.take());
    let mut stats = String::new();
    out.read_line(&mut stats).unwrap();
    println!("  server: {}", stats.trim());
    let _ = child.wait();

    // For scale: the same I/O by the storage process itself, one pwrite/pread at a time.
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    for write in [true, false] {
        let start = Instant::now();
        let mut n = 0u64;
        while start.elapsed() < Duration::from_secs_f64(secs.min(1.0)) {
            let off = rng.gen_range(0..blocks) * IO as u64;
            if write {
                rustix::io::pwrite(&f, &buf, off).unwrap();
            } else {
                rustix::io::pread(&f, &mut buf, off).unwrap();
            }
            n += 1;
        }
        println!(
            "  local {} on the same file, no memloop: {:>8.0} IOPS",
            if write { "pwrite" } else { "pread " },
            n as f64 / start.elapsed().as_secs_f64()
        );
    }
}

/// Removes the file and the region however `main` ends (a panic, a closed stdout).
struct Cleanup {
    path: PathBuf,
    spec: RegionSpec,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
        let _ = Region::destroy(&self.spec);
    }
}

fn server() {
    let region = Region::open(&RegionSpec::from_env()).expect("region");
    let node = Node::join(region, "iops-server").expect("join");
    let path = PathBuf::from(std::env::var("BLK_IOPS_FILE").unwrap());
    let workers = std::env::var("BLK_IOPS_WORKERS")
        .ok()
        .and_then(|w| w.parse().ok())
        .unwrap_or(1);
    let opts = memloop_blk::ExportOptions {
        workers,
        ..memloop_blk::ExportOptions::default()
    };
    let srv = BlkServer::export_with(&node, "iops", &path, opts).expect("export");
    let mut out = std::io::stdout().lock();
    writeln!(out, "ready").unwrap();
    out.flush().unwrap();
    let mut l = String::new();
    while std::io::stdin().lock().read_line(&mut l).unwrap_or(0) > 0 {}
    let s = srv.stats();
    let per = |bytes: u64, n: u64| bytes / n.max(1);
    writeln!(
        out,
        "{} reads, {} writes; kernel copies (pread/pwrite) {} B/read, {} B/write; user-space copies 0 (none in the server's code)",
        s.reads,
        s.writes,
        per(s.bytes_read, s.reads),
        per(s.bytes_written, s.writes)
    )
    .unwrap();
    out.flush().unwrap();
}
