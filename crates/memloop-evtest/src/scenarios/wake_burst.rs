//! `wake_burst`: a set of 200 connections, all idle for over a second (under the preload a set
//! this large looks only at the members its wake-ups name, and idle members go quiet), then
//! data on every one of them at once while a waiter sleeps. Every member must be reported,
//! once (edge-triggered), promptly — as the kernel reports them: far more wake-ups than a Unix
//! datagram socket queues (10 by default) arrive together, and none may be lost. Three rounds.

use super::{no_reaction, Set};
use crate::ensure;
use crate::sys::{self, ET, IN};
use crate::util::{self, ms, Ctx, Net, Opts, Res};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

const CONNS: usize = 200;
const ROUNDS: usize = 3;
/// Idle time before each burst: long enough for idle members to go quiet.
const IDLE: Duration = Duration::from_millis(1300);
/// Every member reported within this of the burst (the kernel: at once; a lost wake-up would
/// wait for the preload's once-a-second full look).
const PROMPT: Duration = Duration::from_millis(500);
const WORD: u64 = 0xb0b5_0000_0000_0000;

pub fn run(o: &Opts) -> Res<()> {
    let _ = o;
    let net = Net::new()?;
    let pairs = net.pairs(CONNS)?;
    let mut set = Set::new()?;
    for (i, (c, _)) in pairs.iter().enumerate() {
        set.add(
            c.as_raw_fd(),
            IN | ET,
            WORD | i as u64,
            &format!("conn {i}"),
        )?;
    }
    let tid = set.waiter(64, -1, no_reaction());
    for round in 0..ROUNDS {
        std::thread::sleep(IDLE);
        util::wait_asleep(tid)?;
        let t0 = Instant::now();
        for (_, s) in &pairs {
            sys::send_all(s.as_raw_fd(), b"x").ctx("send")?;
        }
        let missing = |v: &[crate::book::Seen]| {
            (0..CONNS)
                .filter(|i| v.iter().filter(|s| s.data == WORD | *i as u64).count() <= round)
                .count()
        };
        let all = set.log.wait_for(PROMPT, "", |v| missing(v) == 0);
        let took = t0.elapsed();
        ensure!(
            all.is_ok(),
            "round {round}: {} of {CONNS} members not reported within {:.0} ms of data arriving \
             on all of them at once (lost wake-ups)",
            missing(&set.log.snapshot()),
            ms(PROMPT)
        );
        util::info(&format!(
            "round {round}: {CONNS} members reported within {:.1} ms",
            ms(took)
        ));
        for (c, _) in &pairs {
            let (got, _, _) = util::drain(c.as_raw_fd());
            ensure!(got == b"x", "round {round}: read {got:?}, want one byte");
        }
    }
    std::thread::sleep(Duration::from_millis(30));
    for i in 0..CONNS {
        set.quiet(
            WORD | i as u64,
            ROUNDS,
            Duration::ZERO,
            &format!("conn {i}"),
        )?;
    }
    set.finish()
}
