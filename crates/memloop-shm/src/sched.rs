//! What a waiter asks the scheduler before it spins: which CPU it runs on, and whether the
//! machine has more runnable threads than CPUs. Both are hints (wrong answers cost latency,
//! never correctness) and both are cheap: `sched_getcpu` is a vDSO call, and the run-queue
//! length is read from `/proc/loadavg` at most once per [`LOAD_EVERY`] per process, into
//! process-global atomics that every waiter reads.

/// How old a run-queue sample may get before a waiter refreshes it.
pub const LOAD_EVERY: std::time::Duration = std::time::Duration::from_millis(10);

/// The CPU the calling thread runs on (it may move right after): `None` if unknown.
#[cfg(not(loom))]
pub fn current_cpu() -> Option<u32> {
    u32::try_from(rustix::thread::sched_getcpu()).ok()
}

/// Under loom nothing is known about CPUs.
#[cfg(loom)]
pub fn current_cpu() -> Option<u32> {
    None
}

/// Runnable threads on the whole machine and its online CPUs, `None` if unknown. The
/// runnable count is the smaller of the last two samples (at least [`LOAD_EVERY`] apart), so
/// one momentary burst does not switch spinning off.
#[cfg(not(loom))]
pub fn runnable_and_cpus() -> Option<(u32, u32)> {
    load::get()
}

#[cfg(loom)]
pub fn runnable_and_cpus() -> Option<(u32, u32)> {
    None
}

/// Whether the last load sample (taken by [`runnable_and_cpus`], at most a few ms old) saw
/// more runnable threads than CPUs: two loads, no clock, no refresh.
#[cfg(not(loom))]
pub fn oversubscribed_hint() -> bool {
    load::oversubscribed()
}

#[cfg(loom)]
pub fn oversubscribed_hint() -> bool {
    false
}

/// Parses the runnable count of `/proc/loadavg` ("0.12 0.30 0.41 3/612 12345": 3).
pub fn parse_loadavg_running(text: &[u8]) -> Option<u32> {
    let field = text.split(|b| *b == b' ').nth(3)?;
    let running = field.split(|b| *b == b'/').next()?;
    std::str::from_utf8(running).ok()?.parse().ok()
}

/// Counts the CPUs of a kernel CPU list ("0-3,6,8-9": 7).
pub fn parse_cpu_list(text: &str) -> Option<u32> {
    let mut n = 0u32;
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a.parse::<u32>().ok()?, b.parse::<u32>().ok()?),
            None => {
                let a = part.parse::<u32>().ok()?;
                (a, a)
            }
        };
        n = n.checked_add(b.checked_sub(a)?.checked_add(1)?)?;
    }
    (n > 0).then_some(n)
}

#[cfg(not(loom))]
mod load {
    use super::LOAD_EVERY;
    use std::io::Read;
    use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
    use std::sync::OnceLock;
    use std::time::Instant;

    /// Process start of the sample clock.
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    /// When the last sample was taken (µs since `EPOCH`, +1; 0 = never).
    static TAKEN: AtomicU64 = AtomicU64::new(0);
    /// Last two runnable counts (previous << 32 | latest); 0 = none yet.
    static SAMPLES: AtomicU64 = AtomicU64::new(0);
    /// Online CPUs (0 = not read yet).
    static CPUS: AtomicU32 = AtomicU32::new(0);

    pub(super) fn get() -> Option<(u32, u32)> {
        let epoch = *EPOCH.get_or_init(Instant::now);
        let now = u64::try_from(epoch.elapsed().as_micros())
            .unwrap_or(u64::MAX)
            .saturating_add(1);
        let taken = TAKEN.load(Relaxed);
        let every = LOAD_EVERY.as_micros() as u64;
        // One thread of the process refreshes; the others use the sample they find.
        if (taken == 0 || now.saturating_sub(taken) >= every)
            && TAKEN.compare_exchange(taken, now, Relaxed, Relaxed).is_ok()
        {
            refresh();
        }
        let s = SAMPLES.load(Relaxed);
        let (prev, last) = ((s >> 32) as u32, s as u32);
        let cpus = CPUS.load(Relaxed);
        if last == 0 || cpus == 0 {
            return None;
        }
        let runnable = if prev == 0 { last } else { prev.min(last) };
        Some((runnable, cpus))
    }

    pub(super) fn oversubscribed() -> bool {
        let s = SAMPLES.load(Relaxed);
        let (prev, last) = ((s >> 32) as u32, s as u32);
        let runnable = if prev == 0 { last } else { prev.min(last) };
        let cpus = CPUS.load(Relaxed);
        cpus != 0 && runnable > cpus
    }

    fn refresh() {
        if CPUS.load(Relaxed) == 0 {
            let n = std::fs::read_to_string("/sys/devices/system/cpu/online")
                .ok()
                .and_then(|t| super::parse_cpu_list(&t))
                .or_else(|| {
                    std::thread::available_parallelism()
                        .ok()
                        .and_then(|n| u32::try_from(n.get()).ok())
                })
                .unwrap_or(u32::MAX);
            CPUS.store(n, Relaxed);
        }
        let mut buf = [0u8; 128];
        let Ok(mut f) = std::fs::File::open("/proc/loadavg") else {
            return;
        };
        let Ok(n) = f.read(&mut buf) else { return };
        let Some(running) = super::parse_loadavg_running(&buf[..n]) else {
            return;
        };
        let running = running.max(1); // the reader itself runs
        let old = SAMPLES.load(Relaxed);
        SAMPLES.store((old << 32) | running as u64, Relaxed);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn parses_loadavg() {
        assert_eq!(
            parse_loadavg_running(b"0.12 0.30 0.41 3/612 12345\n"),
            Some(3)
        );
        assert_eq!(parse_loadavg_running(b"0.12 0.30 0.41 x/612 1"), None);
        assert_eq!(parse_loadavg_running(b""), None);
        assert_eq!(parse_loadavg_running(b"1 2 3"), None);
    }

    #[test]
    fn parses_cpu_lists() {
        assert_eq!(parse_cpu_list("0-1\n"), Some(2));
        assert_eq!(parse_cpu_list("0-3,6,8-9"), Some(7));
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list(""), None);
        assert_eq!(parse_cpu_list("a"), None);
    }

    #[test]
    fn samples_this_machine() {
        assert!(current_cpu().is_some());
        let (runnable, cpus) = runnable_and_cpus().expect("/proc/loadavg is readable");
        assert!(runnable >= 1 && cpus >= 1);
    }
}
