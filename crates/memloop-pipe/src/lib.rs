//! The pipe service (vPipe, capability C12): a client hands two file descriptors and a length
//! to a service process, which moves the bytes between them with the kernel's zero-copy
//! primitives, and charges the work to the client's tenant.
//!
//! - [`transfer`]: one transfer between two descriptors — which primitive suits the pair
//!   (`copy_file_range`, `sendfile`, `splice`, a copy loop as the last resort), falling back
//!   when the kernel refuses one, moved in bounded chunks so tenants can take turns.
//! - [`credits`]: which tenant's transfer runs next — weighted, work-conserving, time passed
//!   in (no I/O, no clock).
//! - [`wire`]: the messages between a client and the service (one per `SOCK_SEQPACKET`
//!   packet, descriptors as `SCM_RIGHTS`), every field checked on receipt.
//! - [`service`] and [`client`]: the I/O around them.
#![forbid(unsafe_code)]

pub mod client;
pub mod credits;
pub mod error;
pub mod service;
mod socket;
pub mod transfer;
pub mod wire;

pub use error::PipeError;
