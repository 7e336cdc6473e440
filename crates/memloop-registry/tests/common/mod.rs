#![allow(dead_code)]
use memloop_registry::*;

pub const MIB: u64 = 1 << 20;

pub fn params(size: u64) -> RegionParams {
    RegionParams::small(size)
}

pub fn fresh(size: u64) -> Registry {
    Registry::init(ShmSlice::new_heap(size as usize), &params(size)).unwrap()
}

pub fn ident(n: u32) -> MemberIdentity {
    MemberIdentity {
        pid: 1000 + n,
        start_time: 77 + n as u64,
        boot_id: [n as u8; 16],
        pid_ns: 4026531836,
        net_ns: 4026531840 + n as u64,
        name: format!("member-{n}"),
    }
}

pub fn native(name: &str) -> EndpointKey {
    EndpointKey::Native(name.to_owned())
}

pub fn baseline(r: &Registry) -> Usage {
    Usage {
        segments_total: r.nsegments(),
        ..Usage::default()
    }
}

/// A client and a server member, the server listening on "svc".
pub fn pair(r: &Registry) -> (MemberId, MemberId, EndpointId) {
    let c = r.join(&ident(1)).unwrap();
    let s = r.join(&ident(2)).unwrap();
    let ep = r.add_endpoint(s, &native("svc")).unwrap();
    (c, s, ep)
}

/// Offers to `ep` (cancelling what lands elsewhere) until an offer takes slot `idx` again:
/// slots are handed out next-fit, so reuse of one slot comes after a lap of the table.
pub fn offer_in_slot(
    r: &Registry,
    c: MemberId,
    ep: EndpointId,
    cap: u64,
    idx: u32,
) -> memloop_registry::ChannelId {
    for _ in 0..=r.params().max_channels {
        let ch = r.offer(c, ep, cap, None).unwrap();
        if ch.idx == idx {
            return ch;
        }
        r.cancel(ch, c).unwrap();
    }
    panic!("slot {idx} never came round again");
}
