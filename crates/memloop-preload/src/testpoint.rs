//! Pauses at named points, for tests that must put two processes' steps in one order: a race
//! that takes microseconds to lose in the wild (see `tests/semantics/races.py`) is then lost
//! every time. `MEMLOOP_TEST_PAUSE=POINT:MICROS[:TIMES][,…]` (read once, at load) pauses the
//! thread reaching POINT for MICROS, the first TIMES times (default: always). Unset, a point
//! costs one relaxed load; points sit only off the data path.

use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::OnceLock;
use std::time::Duration;

/// Where a test may pause.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Point {
    /// The heartbeat's switch sweep, after it listed the process's connections and before it
    /// looks at them (with at least one listed): the program may close them meanwhile.
    SweepListed,
    /// A ring wait about to sleep on the kernel socket (a blocking peek): the connection may
    /// switch and the peer's FIN arrive meanwhile.
    RingSleep,
    /// The end of the library's start-up (for the shim: inside its `dlopen`, its load lock
    /// held): another thread may fork meanwhile.
    EngineLoad,
    /// A connect of an inet stream socket, before the region is looked at (for
    /// `MEMLOOP_TEST_PANIC`: the engine must unwind and contain it).
    Connect,
}

impl Point {
    const ALL: [Point; 4] = [
        Point::SweepListed,
        Point::RingSleep,
        Point::EngineLoad,
        Point::Connect,
    ];

    fn name(self) -> &'static str {
        match self {
            Point::SweepListed => "sweep-listed",
            Point::RingSleep => "ring-sleep",
            Point::EngineLoad => "engine-load",
            Point::Connect => "connect",
        }
    }
}

struct Pause {
    at: Point,
    for_: Duration,
    /// Pauses left (`u32::MAX`: no limit).
    left: AtomicU32,
}

static PAUSES: OnceLock<Vec<Pause>> = OnceLock::new();

/// `MEMLOOP_TEST_PANIC=POINT:TIMES`: the first TIMES threads reaching POINT panic there (the
/// hook around it must contain the panic: unwinding has to work in the program as loaded).
static PANICS: OnceLock<Vec<Pause>> = OnceLock::new();

/// `MEMLOOP_TEST_RESIZE=EVERY`: every EVERY-th ring send of the process first asks its tx
/// ring for a random window (a grow at once, copying wrapped bytes; a shrink only if the ring
/// is empty) — the elastic windows' storm, through real programs. 0: off.
static RESIZE_EVERY: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static RESIZE_TICK: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A window exponent (window = 64 << it) if a test asked for a resize before this send.
pub fn resize_due() -> Option<u32> {
    let every = RESIZE_EVERY.load(Relaxed);
    if every == 0 {
        return None;
    }
    let t = RESIZE_TICK.fetch_add(1, Relaxed);
    // (A cheap scramble of the tick: the windows must not come in a cycle of the sends.)
    let r = t.wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29);
    (t % every == 0).then_some((r % 15) as u32)
}

/// Reads `MEMLOOP_TEST_PAUSE` and `MEMLOOP_TEST_RESIZE` (the library's constructor calls it:
/// no allocation later).
pub fn capture() {
    if let Some(e) = crate::real::setting("MEMLOOP_TEST_RESIZE").and_then(|v| v.parse().ok()) {
        RESIZE_EVERY.store(e, Relaxed);
    }
    PAUSES.get_or_init(|| {
        crate::real::setting("MEMLOOP_TEST_PAUSE")
            .map(|v| parse(&v))
            .unwrap_or_default()
    });
    PANICS.get_or_init(|| {
        // (The same POINT:MICROS:TIMES parser, with no pause: "POINT:TIMES" is POINT:0:TIMES.)
        crate::real::setting("MEMLOOP_TEST_PANIC")
            .map(|v| {
                let spec = v.split(',').map(|i| i.replacen(':', ":0:", 1));
                parse(&spec.collect::<Vec<_>>().join(","))
            })
            .unwrap_or_default()
    });
}

fn parse(spec: &str) -> Vec<Pause> {
    spec.split(',')
        .filter_map(|item| {
            let mut f = item.trim().split(':');
            let name = f.next()?;
            let at = Point::ALL.into_iter().find(|p| p.name() == name);
            let micros = f.next().and_then(|m| m.parse().ok());
            let times = f.next().map_or(Some(u32::MAX), |t| t.parse().ok());
            match (at, micros, times) {
                (Some(at), Some(m), Some(t)) => Some(Pause {
                    at,
                    for_: Duration::from_micros(m),
                    left: AtomicU32::new(t),
                }),
                _ => {
                    tracing::warn!(item, "MEMLOOP_TEST_PAUSE: not POINT:MICROS[:TIMES]");
                    None
                }
            }
        })
        .collect()
}

/// Pauses here if a test asked for it.
pub fn pause(at: Point) {
    for p in due(&PAUSES, at) {
        tracing::debug!(point = at.name(), for_ = ?p.for_, "test pause");
        std::thread::sleep(p.for_);
    }
}

/// Panics here if a test asked for it.
pub fn panic_if_asked(at: Point) {
    if due(&PANICS, at).next().is_some() {
        panic!("test panic at {}", at.name());
    }
}

/// The entries for `at` that still have a turn left (each yielded one used its turn).
fn due(list: &'static OnceLock<Vec<Pause>>, at: Point) -> impl Iterator<Item = &'static Pause> {
    let all = list.get().map_or(&[][..], |v| &v[..]);
    all.iter().filter(move |p| {
        p.at == at
            && p.left
                .fetch_update(Relaxed, Relaxed, |n| match n {
                    0 => None,
                    u32::MAX => Some(u32::MAX),
                    n => Some(n - 1),
                })
                .is_ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spec_names_points_times_and_rejects_the_rest() {
        let p = parse("sweep-listed:500:2, nowhere:1, sweep-listed:x, sweep-listed:7");
        assert_eq!(p.len(), 2);
        assert_eq!(
            (p[0].at, p[0].for_),
            (Point::SweepListed, Duration::from_micros(500))
        );
        assert_eq!(p[0].left.load(Relaxed), 2);
        assert_eq!(p[1].left.load(Relaxed), u32::MAX);
    }
}
