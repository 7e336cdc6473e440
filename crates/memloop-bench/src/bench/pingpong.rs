//! The physical limit: two processes bouncing one shared 64-byte line, both spinning.
//!
//! The driver writes odd numbers, the peer answers each with the next even one, so every value
//! also checks that no round trip was skipped. Timing is per batch: reading the clock per round
//! trip would cost as much as the round trip itself.

use super::sys::Peer;
use crate::error::{fail, CliResult, Context};
use memloop_shm::sync::Ordering::{Acquire, Release};
use memloop_shm::{Backend, CreateOptions, Mapping, ShmU64};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Tells the peer to exit.
const STOP: u64 = u64::MAX;
/// The peer saw a value out of sequence.
const BAD: u64 = u64::MAX - 1;
const BATCH: u64 = 256;
/// Spins between clock reads or yields: far more than one round trip takes.
const SPINS: u32 = 1 << 14;
const PATIENCE: Duration = Duration::from_secs(10);

/// Removes the line's file on drop.
struct LineFile(PathBuf);

impl Drop for LineFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Median and p99 of the round trip time, in nanoseconds per round trip.
pub fn measure(warmup: Duration, dur: Duration, peer_args: &[String]) -> CliResult<(f64, f64)> {
    let file = LineFile(PathBuf::from(format!(
        "/dev/shm/memloop-bench-{}-line",
        std::process::id()
    )));
    let _ = std::fs::remove_file(&file.0);
    let opts = CreateOptions {
        size: 4096,
        mode: 0o600,
        gid: None,
        locked: false,
    };
    let map = Mapping::create_new(&file.0, Backend::File, &opts)
        .context("creating the ping-pong line")?;
    let word = map.view().u64_at(0)?;
    let mut args = vec![
        "--path".into(),
        "cacheline".into(),
        "--addr".into(),
        file.0.display().to_string(),
    ];
    args.extend_from_slice(peer_args);
    let mut peer = Peer::spawn(&args)?;
    let mut v = 1;
    let t0 = Instant::now();
    while t0.elapsed() < warmup {
        batch(&word, &mut v, &mut peer)?;
    }
    let mut per_rt = Vec::new();
    let t0 = Instant::now();
    while t0.elapsed() < dur {
        let t = Instant::now();
        batch(&word, &mut v, &mut peer)?;
        per_rt.push(t.elapsed().as_nanos() as f64 / BATCH as f64);
    }
    word.store(STOP, Release);
    peer.finish()?;
    per_rt.sort_by(f64::total_cmp);
    Ok((percentile(&per_rt, 0.5), percentile(&per_rt, 0.99)))
}

pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    sorted
        .get(((sorted.len() as f64 - 1.0) * q).round() as usize)
        .copied()
        .unwrap_or(0.0)
}

fn batch(word: &ShmU64, v: &mut u64, peer: &mut Peer) -> CliResult<()> {
    for _ in 0..BATCH {
        word.store(*v, Release);
        let want = *v + 1;
        spin_until(
            word,
            |got| got == want || got == BAD,
            || peer.check_running(),
        )?;
        if word.load(Acquire) == BAD {
            return Err(fail(
                "DATA MISMATCH: the ping-pong peer saw a value out of sequence",
            ));
        }
        *v += 2;
    }
    Ok(())
}

/// Spins until `done(value)`; between long spins yields (in case we share a CPU with the other
/// side) and runs `alive`, failing after [`PATIENCE`] without progress.
fn spin_until(
    word: &ShmU64,
    done: impl Fn(u64) -> bool,
    mut alive: impl FnMut() -> CliResult<()>,
) -> CliResult<u64> {
    let mut since: Option<Instant> = None;
    loop {
        for _ in 0..SPINS {
            let got = word.load(Acquire);
            if done(got) {
                return Ok(got);
            }
            std::hint::spin_loop();
        }
        std::thread::yield_now();
        alive()?;
        if since.get_or_insert_with(Instant::now).elapsed() > PATIENCE {
            return Err(fail("ping-pong: the other side stopped answering"));
        }
    }
}

/// The peer's side: answer each odd value with the next even one until told to stop.
pub fn respond(path: &Path) -> CliResult<()> {
    let map = Mapping::open(path, Backend::File, true).context("opening the ping-pong line")?;
    let word = map.view().u64_at(0)?;
    let mut want = 1;
    loop {
        // Odd values (STOP included) are the driver's; even ones are our own answer.
        let got = spin_until(&word, |g| g % 2 == 1, || Ok(()))?;
        if got == STOP {
            return Ok(());
        }
        if got != want {
            word.store(BAD, Release);
            return Err(fail(format!("ping-pong: saw {got}, expected {want}")));
        }
        word.store(want + 1, Release);
        want += 2;
    }
}
