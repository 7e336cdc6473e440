//! `memloop-evtest <scenario> [--seed N] [--events N]`: synthetic readiness scenarios for
//! epoll/poll/select over TCP connections, correct on kernel TCP, run again under
//! `libmemloop_preload.so` by `crates/memloop-preload/tests/evloop.rs`.
//!
//! Each scenario makes its own peers (threads of this process, connected to a listener of
//! this process, or a child process re-executing this binary with a hidden role), checks
//! everything it sees, and ends with `OK <scenario>` (exit 0) or `FAIL <scenario>: reason`
//! (exit 1). A watchdog ends a run that is still going after 40 s (exit 3). Everything goes
//! through the C library's functions: the preload library only sees those.

mod book;
mod scenarios;
mod sys;
mod util;

use std::io::Write;
use std::time::{Duration, Instant};
use util::{Opts, Res};

/// Seconds before the watchdog ends the process (longer stress runs get more, see
/// [`watchdog_secs`]).
const WATCHDOG_SECS: u64 = 40;

type Run = fn(&Opts) -> Res<()>;

/// Every scenario, by name.
const SCENARIOS: &[(&str, Run)] = &[
    ("data_words", scenarios::data_words::run),
    ("tag_words", scenarios::tag_words::run),
    ("multi_waiters", scenarios::multi_waiters::run),
    ("exclusive", scenarios::exclusive::run),
    ("oneshot_rearm", scenarios::oneshot::run),
    ("et_partial", scenarios::et_partial::run),
    ("pwait2", scenarios::pwait2::run),
    ("nested_poll", scenarios::nested::run_poll),
    ("nested_select", scenarios::nested::run_select),
    ("nested_epoll", scenarios::nested::run_epoll),
    ("fork_shared_set", scenarios::fork::run_fork),
    ("exec_inherits", scenarios::fork::run_exec),
    ("close_with_dup", scenarios::close_dup::run),
    ("mixed_fds", scenarios::mixed::run),
    ("listener_dup", scenarios::listener_dup::run),
    ("wake_burst", scenarios::wake_burst::run),
    ("stress", scenarios::stress::run),
    ("stress_churn", scenarios::stress::run_churn),
];

fn usage() -> String {
    let names: Vec<&str> = SCENARIOS.iter().map(|(n, _)| *n).collect();
    format!(
        "usage: memloop-evtest <scenario> [--seed N] [--events N]\nscenarios: {}",
        names.join(" ")
    )
}

fn parse(args: &[String]) -> Res<(String, Opts)> {
    let mut opts = Opts {
        seed: 1,
        events: 100_000,
    };
    let mut name = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut num = |flag: &str| -> Res<u64> {
            let v = it.next().ok_or(format!("{flag} needs a value"))?;
            v.parse().map_err(|_| format!("{flag}: not a number: {v}"))
        };
        match a.as_str() {
            "--seed" => opts.seed = num("--seed")?,
            "--events" => opts.events = num("--events")?,
            "-h" | "--help" => return Err(usage()),
            s if s.starts_with('-') => return Err(format!("unknown option {s}\n{}", usage())),
            s if name.is_none() => name = Some(s.to_string()),
            s => return Err(format!("unexpected argument {s}\n{}", usage())),
        }
    }
    Ok((name.ok_or_else(usage)?, opts))
}

/// Prints a line and flushes (the process may leave with `_exit`).
pub fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// The watchdog's limit: 40 s, plus the extra time a stress run with more than 10^5 events
/// gets (see `scenarios::stress::gen_limit`).
fn watchdog_secs(name: &str, opts: &Opts) -> u64 {
    if name.starts_with("stress") {
        WATCHDOG_SECS + scenarios::stress::extra_time(opts.events).as_secs()
    } else {
        WATCHDOG_SECS
    }
}

/// Ends the process after `WATCHDOG_SECS` with a FAIL line.
pub fn watchdog(name: String) {
    watchdog_after(name, WATCHDOG_SECS);
}

pub fn watchdog_after(name: String, secs: u64) {
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(secs));
        say(&format!(
            "FAIL {name}: watchdog: still running after {secs} s (a hang)"
        ));
        sys::exit_now(3);
    });
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // Hidden roles: children that re-execute this binary.
    if let Some(role) = args.first().filter(|a| a.starts_with("__")) {
        let code = scenarios::child_role(role, &args[1..]);
        sys::exit_now(code);
    }
    let (name, opts) = match parse(&args) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let Some((_, run)) = SCENARIOS.iter().find(|(n, _)| *n == name) else {
        eprintln!("unknown scenario {name}\n{}", usage());
        std::process::exit(2);
    };
    // signalfd scenarios need their signal blocked in every thread: block it before any.
    if let Err(e) = sys::block_signals(&[libc::SIGUSR1]) {
        say(&format!("FAIL {name}: blocking SIGUSR1: {e}"));
        std::process::exit(1);
    }
    watchdog_after(name.clone(), watchdog_secs(&name, &opts));
    let t0 = Instant::now();
    match name.as_str() {
        "stress" | "stress_churn" => util::info(&format!(
            "{name}: seed {} events {}",
            opts.seed, opts.events
        )),
        _ => util::info(&format!("{name}: seed {}", opts.seed)),
    }
    let r = std::panic::catch_unwind(|| run(&opts))
        .unwrap_or_else(|_| Err("the scenario panicked".to_string()));
    let secs = t0.elapsed().as_secs_f64();
    say(&format!("rings {}", util::rings()));
    match r {
        Ok(()) => {
            say(&format!("OK {name} ({secs:.2} s)"));
            sys::exit_now(0);
        }
        Err(why) => {
            say(&format!("FAIL {name}: {why}"));
            sys::exit_now(1);
        }
    }
}
