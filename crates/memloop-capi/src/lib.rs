//! The C API of memloop's zero-copy messaging ([`memloop::zerocopy`]): `libmemloop_zc.so`
//! and its header `include/memloop_zc.h`, generated from these definitions by cbindgen
//! (`build.rs`).
//!
//! Handles are opaque pointers made and freed by the library: `ml_node` (membership),
//! `ml_pool` and `ml_loan` (buffers of our own), `ml_listener` and `ml_port` (channels),
//! `ml_msg` (a received message, read in place and held until freed). A source loans a
//! buffer, writes into it and sends it; a middle stage forwards what it received — whole,
//! or a range of it behind a header loan of its own — with `ml_port_forward` /
//! `ml_port_sendv`; no payload byte is copied on the way.
//!
//! Every entry point:
//! - returns `ML_OK`/`ML_EOF`/a negative `ml_status`, a new handle or NULL, or a plain value
//!   (0 / NULL) — a failure also records a message (`ml_last_error`, per thread) and its code
//!   (`ml_last_error_code`);
//! - answers a NULL handle or pointer with `ML_INVALID` (free functions ignore NULL, like
//!   `free`);
//! - catches any panic inside the library and reports it as `ML_ERROR`: none crosses into C.
//!
//! The unsafe code of this crate is the FFI boundary only: turning C pointers into handles
//! and strings (`status.rs`) and writing out-parameters. Shared memory is reached only
//! through the `memloop` crate.

// The workspace lints deny these already; this crate is one of the two allowed to hold
// unsafe code (the C ABI), so it says so where it is read first.
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks, clippy::missing_safety_doc)]

// (In this order in the header.)
mod node;

mod port;

mod msg;

mod status;

pub use msg::*;
pub use node::*;
pub use port::*;
pub use status::{ml_last_error, ml_last_error_code, ml_status, ml_strerror};

/// What the handles' documented thread rules rest on.
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    const fn send<T: Send>() {}
    send_sync::<memloop::Node>();
    send_sync::<memloop::zerocopy::Pool>();
    send_sync::<memloop::zerocopy::Received>();
    send::<memloop::zerocopy::Loan>();
    send::<memloop::zerocopy::ZcPort>();
    send::<memloop::zerocopy::ZcListener>();
};
