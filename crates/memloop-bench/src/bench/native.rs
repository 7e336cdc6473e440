//! The memloop path: a temporary region, a listener here, a peer process that connects to it.

use super::proto::Conn;
use super::sys::{wait_for, Peer};
use super::Link;
use crate::error::{CliResult, Context};
use memloop::{CreateRegion, Error, Listener, Node, Region, RegionSpec, Stream};
use std::time::Duration;

/// A bench's region: `--region` if given (left in place afterwards), else a fresh
/// `bench-<pid>`, destroyed on drop.
pub struct OwnedRegion {
    pub region: Region,
    /// The name as given to peers (`--region`, `MEMLOOP_REGION`).
    pub arg: String,
    temporary: bool,
}

impl OwnedRegion {
    pub fn open(region: Option<&str>) -> CliResult<OwnedRegion> {
        let (arg, temporary) = match region {
            Some(r) => (r.to_string(), false),
            None => (format!("bench-{}", std::process::id()), true),
        };
        let spec = RegionSpec::parse(&arg);
        let region = Region::open_or_create(&spec, &CreateRegion::default())
            .context(format!("opening bench region {}", spec.path().display()))?;
        Ok(OwnedRegion {
            region,
            arg,
            temporary,
        })
    }
}

impl Drop for OwnedRegion {
    fn drop(&mut self) {
        if self.temporary {
            let spec = self.region.spec();
            if let Err(e) = Region::destroy(spec) {
                eprintln!(
                    "memloop: could not remove bench region {}: {e}",
                    spec.path().display()
                );
            }
        }
    }
}

/// The native bench's region, joined (its listener lives here).
pub struct BenchRegion {
    node: Node,
    /// After the node: the region is destroyed once we have left it.
    owned: OwnedRegion,
}

impl BenchRegion {
    /// `--region` if given (left in place afterwards), else a fresh `bench-<pid>`.
    pub fn open(region: Option<&str>) -> CliResult<BenchRegion> {
        let owned = OwnedRegion::open(region)?;
        let node = Node::join(owned.region.clone(), "memloop-bench")
            .context("joining the bench region")?;
        Ok(BenchRegion { node, owned })
    }

    /// Binds a service, starts the peer and accepts its connection.
    pub fn connect_peer(&self, ring: u64, peer_args: &[String]) -> CliResult<Link> {
        let service = format!("bench-{}", std::process::id());
        let listener = Listener::bind(&self.node, &service).context("binding the bench service")?;
        let mut args: Vec<String> = [
            "--path",
            "memloop",
            "--addr",
            &service,
            "--region",
            &self.owned.arg,
        ]
        .map(String::from)
        .into();
        args.extend(["--ring".into(), ring.to_string()]);
        args.extend_from_slice(peer_args);
        let mut peer = Peer::spawn(&args)?;
        let stream = wait_for(&mut peer, "the memloop peer to connect", || match listener
            .accept_timeout(Some(Duration::from_millis(10)))
        {
            Ok(s) => Ok(Some(s)),
            Err(Error::TimedOut) => Ok(None),
            Err(e) => Err(e.into()),
        })?;
        Ok(Link::new("memloop", Box::new(stream), peer))
    }
}

/// The peer's end: join the region and connect to the driver's service.
pub fn connect(region: &str, service: &str, ring: u64) -> CliResult<Box<dyn Conn>> {
    let spec = RegionSpec::parse(region);
    let region = Region::open(&spec).context("opening the bench region")?;
    let node = Node::join(region, "memloop-bench-peer").context("joining the bench region")?;
    let stream =
        Stream::connect_with(&node, service, ring).context(format!("connecting to {service:?}"))?;
    Ok(Box::new(stream))
}
