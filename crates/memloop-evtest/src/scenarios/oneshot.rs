//! `oneshot_rearm`: `EPOLLONESHOT` fires on a waiter thread (A, asleep with timeout -1), the
//! main thread (B) reads and re-arms with `EPOLL_CTL_MOD` (a new data word each time, LT or
//! ET); data that arrives while disarmed is not reported, and a re-arm with data waiting
//! wakes A at once (the kernel's `ep_modify` queues a ready item and wakes the waiters).
//! Every arm fires exactly once.

use super::{no_reaction, Set};
use crate::ensure;
use crate::sys::{self, ET, IN, ONESHOT, RDHUP};
use crate::util::{self, evname, median_max, ms, Ctx, Net, Opts, Res, Rng};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

const ROUNDS: usize = 200;
const LIMIT: Duration = Duration::from_secs(3);

pub fn run(o: &Opts) -> Res<()> {
    let mut rng = Rng::new(o.seed);
    let net = Net::new()?;
    let mut pairs = net.pairs(1)?;
    let (c, s) = pairs.pop().expect("one pair");
    let (c, s) = (c.as_raw_fd(), s.as_raw_fd());
    let mut set = Set::new()?;
    let mut word = rng.next();
    set.add(c, IN | ONESHOT, word, "arm 0")?;
    let tid = set.waiter(8, -1, no_reaction());
    let mut pending = false;
    let mut lat = Vec::new();
    let mut words = vec![word];
    for round in 0..ROUNDS {
        if !pending {
            sys::send_all(s, b"a").ctx("send")?;
        }
        let e = set.next(word, 0, LIMIT, &format!("arm {round} never fired"))?;
        ensure!(
            e.events == IN,
            "arm {round}: events {}, want IN",
            evname(e.events)
        );
        let (got, _, _) = util::drain(c);
        ensure!(
            !got.is_empty(),
            "arm {round}: reported readable but nothing to read"
        );
        pending = rng.chance(0.6);
        if pending {
            // Arrives while disarmed: must not be reported until the re-arm.
            sys::send_all(s, b"b").ctx("send")?;
            if rng.chance(0.5) {
                util::wait_asleep(tid)?;
            }
        }
        set.quiet(
            word,
            1,
            Duration::ZERO,
            &format!("arm {round} fired more than once"),
        )?;
        let next = rng.next();
        let flags = if rng.chance(0.5) {
            IN | ONESHOT
        } else {
            IN | RDHUP | ONESHOT | ET
        };
        let t0 = Instant::now();
        set.modify(c, word, flags, next, &format!("arm {}", round + 1))?;
        if pending {
            let e = set.next(
                next,
                0,
                LIMIT,
                &format!("re-arm {} with data waiting", round + 1),
            )?;
            lat.push(e.at.saturating_duration_since(t0));
        }
        word = next;
        words.push(word);
    }
    std::thread::sleep(Duration::from_millis(30));
    for (i, w) in words.iter().enumerate().take(ROUNDS) {
        set.quiet(*w, 1, Duration::ZERO, &format!("arm {i}"))?;
    }
    set.finish()?;
    rearm_latency(&mut lat)
}

/// A re-arm with data waiting must wake the sleeping waiter at once, as the kernel does.
fn rearm_latency(lat: &mut [Duration]) -> Res<()> {
    let (med, max) = median_max(lat);
    util::info(&format!(
        "{} re-arms with data waiting: wake-up after median {:.3} ms, max {:.3} ms",
        lat.len(),
        ms(med),
        ms(max)
    ));
    ensure!(
        med <= Duration::from_millis(50),
        "a re-arm (MOD) with data waiting woke the sleeping waiter only after a median {:.1} ms \
         (max {:.1} ms); the kernel wakes it at once",
        ms(med),
        ms(max)
    );
    Ok(())
}
