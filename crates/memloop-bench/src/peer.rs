//! `memloop-bench peer` (hidden): the far end of a benchmark path, run as its own process so
//! every path crosses a process boundary, as real traffic does.

use crate::bench::{self, proto};
use crate::error::{fail, CliResult};
use std::path::Path;

#[derive(clap::Args)]
pub struct PeerArgs {
    /// memloop, unix, tcp or cacheline.
    #[arg(long)]
    path: String,
    /// The service name, socket name, host:port or line file to connect to.
    #[arg(long)]
    addr: String,
    /// Region (memloop path).
    #[arg(long)]
    region: Option<String>,
    /// Ring capacity (memloop path).
    #[arg(long)]
    ring: Option<u64>,
    /// CPU to pin to.
    #[arg(long)]
    cpu: Option<usize>,
}

pub fn run(a: &PeerArgs) -> CliResult<()> {
    bench::pin_peer(a.cpu)?;
    let mut conn = match a.path.as_str() {
        "memloop" => {
            let region = a
                .region
                .as_deref()
                .ok_or_else(|| fail("--region is required for memloop"))?;
            bench::connect_native(
                region,
                &a.addr,
                a.ring.unwrap_or(memloop::DEFAULT_RING_CAPACITY),
            )?
        }
        "unix" | "tcp" => bench::connect_baseline(&a.path, &a.addr)?,
        "cacheline" => return bench::pingpong_respond(Path::new(&a.addr)),
        other => return Err(fail(format!("unknown path {other:?}"))),
    };
    proto::serve(conn.as_mut())
}
