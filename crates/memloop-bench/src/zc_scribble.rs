//! `memloop-bench zc-scribble` (hidden): a zero-copy receiver that writes into the buffer it
//! received, which must kill it with SIGSEGV — the reader's view of a pool is read-only. For
//! tests/vm/memloop.sh, where the view is a read-only mapping of the ivshmem BAR inside a
//! guest (crates/memloop/tests/zerocopy.rs proves the same between processes).
//!
//! It binds `--listen SVC`, accepts one descriptor channel, receives one message, prints
//! `read <first byte>`, then writes into that byte (`memloop_shm::fault_probe`). If it is
//! still alive it prints `wrote` and exits 0: the check that ran it has failed.

use crate::error::{fail, CliResult, Context};
use memloop::zerocopy::ZcListener;
use memloop::{Node, Region};
use memloop_cli::region_cmd::RegionArg;
use std::io::Write;

#[derive(clap::Args)]
pub struct ScribbleArgs {
    /// Region; default as `memloop cat`: $MEMLOOP_REGION (a guest's ivshmem BAR), else
    /// "default".
    #[command(flatten)]
    region: RegionArg,
    /// Serve this name (zero-copy) and take one message from the first channel.
    #[arg(long, value_name = "SVC")]
    listen: String,
}

pub fn run(a: &ScribbleArgs) -> CliResult<()> {
    let region = Region::open(&a.region.spec()).context("opening the region")?;
    let node = Node::join(region, "zc-scribble").context("joining the region")?;
    let l = ZcListener::bind(&node, &a.listen).context(format!("serving {}", a.listen))?;
    let mut port = l.accept().context("accepting")?;
    let m = port
        .recv()
        .context("receiving")?
        .ok_or_else(|| fail("the sender closed without a message"))?;
    let first = *m.bytes().first().ok_or_else(|| fail("an empty message"))?;
    say(&format!("read {first}"));
    memloop_shm::fault_probe::write_into(m.bytes(), !first).context("writing into it")?;
    say("wrote");
    Ok(())
}

fn say(s: &str) {
    let mut o = std::io::stdout().lock();
    let _ = writeln!(o, "{s}").and_then(|()| o.flush());
}
