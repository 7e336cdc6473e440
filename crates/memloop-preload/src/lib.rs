//! `libmemloop_preload.so`: loaded with `LD_PRELOAD` (or `memloop run -- CMD`), it gives TCP
//! connections between co-resident programs a shared-memory ring, and leaves every other
//! connection on the kernel's path.
//!
//! - `ffi` exports the C library's socket functions; each checks a flat fd table first, so a
//!   call on an fd that is not ours costs one load and goes to the real function.
//! - `dispatch` does the bookkeeping (socket, connect, listen, accept, close, dup, fork).
//! - `agree` is the connection agreement with the registry (offer, accept, decline marker).
//! - `conn` is one ring connection: data, readiness, doorbells, shutdown, close.
//! - `pollsel` and `epoll` answer readiness for mixed ring and kernel fds.
//! - `inherit` re-adopts ring connections inherited across `exec`.
//!
//! `unsafe` lives in `ffi`, `real` (the C ABI boundary) and `forklock` (a mutex that can be
//! released by the fork handlers); shared memory is still only touched through `memloop-shm`.
#![deny(unsafe_code)]

mod agree;
mod conn;
mod dispatch;
mod engine;
mod epoll;
mod ffi;
mod forklock;
mod inherit;
mod listen;
mod plain;
mod pollsel;
mod real;
mod table;

/// Logging is off unless `MEMLOOP_LOG` holds a filter (e.g. `debug`).
fn init_logging() {
    let Ok(filter) = std::env::var("MEMLOOP_LOG") else {
        return;
    };
    let Ok(filter) = tracing_subscriber::EnvFilter::try_new(filter) else {
        return;
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
}
