//! The `memloop` operator tool as a library: the binary's commands, shared with `memloop-bench`,
//! which needs `run`, `domains` and `region` for its peers and the size and error helpers.
#![forbid(unsafe_code)]

pub mod blk_cmd;
pub mod cat;
pub mod container;
pub mod domains;
pub mod error;
pub mod link_cmd;
pub mod pipe_cmd;
pub mod prometheus;
pub mod region_cmd;
pub mod run;
pub mod service;
pub mod status;
pub mod switch_cmd;
pub mod units;

/// Logging is off unless `MEMLOOP_LOG` holds a filter (e.g. `debug`, `memloop=trace`).
pub fn init_logging() {
    let Ok(filter) = std::env::var("MEMLOOP_LOG") else {
        return;
    };
    let filter = tracing_subscriber::EnvFilter::try_new(&filter).unwrap_or_else(|e| {
        eprintln!("memloop: ignoring bad MEMLOOP_LOG {filter:?}: {e}");
        tracing_subscriber::EnvFilter::new("off")
    });
    // Colour only for a terminal: logs are often redirected to a file.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .init();
}
