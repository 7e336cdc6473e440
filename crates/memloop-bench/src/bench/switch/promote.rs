//! The promotion trigger of `memloop bench switch`: the bench process asks the region's
//! registry itself (what `memloop promote --conn ID` does), so the trigger time is the moment
//! of that one store, on the clocks the peers use. On a plain kernel path (a control) it only
//! takes the time.

use super::peer::{now, wall, PromoteAsk, Promoted};
use crate::error::{fail, CliResult, Context};
use memloop::registry::{ChannelId, ChannelState, ConnTuple, Registry, RegistryError};
use memloop::{Region, RegionSpec};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// How often the switch word is looked at while waiting for the promotion to finish.
const POLL: Duration = Duration::from_micros(100);

/// The region's registry, when the preloaded paths run.
pub struct Promoter {
    region: Option<Region>,
}

impl Promoter {
    /// For region `name` (`None`: no preloaded path runs, every trigger is a no-op).
    pub fn open(name: Option<&str>) -> CliResult<Promoter> {
        let region = match name {
            Some(n) => Some(Region::open(&RegionSpec::parse(n)).context(format!("opening {n}"))?),
            None => None,
        };
        Ok(Promoter { region })
    }

    /// The trigger for the connection `q` names: on a preloaded path (`ring`) asks the
    /// promotion, then waits up to `wait` for it to finish; on a control only the time.
    pub fn trigger(&self, q: &PromoteAsk, ring: bool, wait: Duration) -> CliResult<Promoted> {
        let reg = match (&self.region, ring) {
            (Some(r), true) => r.registry(),
            _ => {
                let (at_wall, at_mono) = (wall(), now());
                return Ok(Promoted {
                    at_mono,
                    at_wall,
                    done_ns: None,
                });
            }
        };
        let addr = |s: &str| -> CliResult<SocketAddr> {
            s.parse()
                .map_err(|e| fail(format!("promote: bad address {s:?}: {e}")))
        };
        let (local, peer) = (addr(&q.local)?, addr(&q.peer)?);
        let ch = find(reg, local, peer)
            .ok_or_else(|| fail(format!("promote: no channel for {local} → {peer}")))?;
        let (at_wall, at_mono) = (wall(), now());
        reg.request_promote(ch)
            .map_err(|e| fail(format!("promote: channel {}.{}: {e}", ch.idx, ch.gen)))?;
        memloop::channel::kick_sides(reg, ch); // as `memloop promote` does
        let done_ns = wait_quiet(reg, ch, wait).map(|_| now() - at_mono);
        Ok(Promoted {
            at_mono,
            at_wall,
            done_ns,
        })
    }
}

/// Waits until channel `ch`'s switch word is quiet again (the promotion finished); `None` if
/// it is not within `wait` (or the channel went).
fn wait_quiet(reg: &Registry, ch: ChannelId, wait: Duration) -> Option<()> {
    let deadline = Instant::now() + wait;
    loop {
        match reg.switch_word(ch) {
            Ok(w) if w.quiet() => return Some(()),
            Err(RegistryError::Stale | RegistryError::NotFound) => return None,
            _ if Instant::now() >= deadline => return None,
            _ => std::thread::sleep(POLL),
        }
    }
}

/// The accepted channel of the connection from `local` (its client) to `peer`.
fn find(reg: &Registry, local: SocketAddr, peer: SocketAddr) -> Option<ChannelId> {
    reg.channels()
        .into_iter()
        .filter(|c| c.state == ChannelState::Accepted && !c.marker)
        .find(|c| c.tuple.is_some_and(|t| is_conn(&t, local, peer)))
        .map(|c| c.id)
}

/// Whether `t` is the connection a client sees from `local` to `peer` (addresses compared in
/// their canonical form: an IPv4-mapped IPv6 address is the IPv4 one).
fn is_conn(t: &ConnTuple, local: SocketAddr, peer: SocketAddr) -> bool {
    let canon = |a: SocketAddr| SocketAddr::new(a.ip().to_canonical(), a.port());
    canon(t.client) == canon(local) && canon(t.server) == canon(peer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tuple_matches_its_client_view_only() {
        let a = |s: &str| s.parse::<SocketAddr>().unwrap();
        let t = ConnTuple {
            client: a("10.9.8.2:40000"),
            server: a("10.9.8.1:5000"),
        };
        assert!(is_conn(&t, a("10.9.8.2:40000"), a("10.9.8.1:5000")));
        assert!(is_conn(
            &t,
            a("[::ffff:10.9.8.2]:40000"),
            a("10.9.8.1:5000")
        ));
        // The server's view, another port: not this connection (as the client sees it).
        assert!(!is_conn(&t, a("10.9.8.1:5000"), a("10.9.8.2:40000")));
        assert!(!is_conn(&t, a("10.9.8.2:40001"), a("10.9.8.1:5000")));
    }

    #[test]
    fn a_control_trigger_only_takes_the_time() {
        let p = Promoter::open(None).unwrap();
        let q = PromoteAsk {
            local: "garbage".into(),
            peer: "garbage".into(),
        };
        let t = p.trigger(&q, false, Duration::ZERO).unwrap();
        assert!(t.at_mono > 0 && t.at_wall > 0 && t.done_ns.is_none());
    }
}
