//! Fixed-size binary encodings of ids, addresses and endpoint keys.
//!
//! The region is shared by processes and VMs built from possibly different binaries, so every
//! encoding is explicit little-endian bytes (never `repr(Rust)` layouts), and every decoder
//! validates what it reads: a peer's bug yields `Corrupt`, never a panic.

use crate::error::RegistryError;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// A member slot and the generation of its occupant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MemberId {
    pub idx: u32,
    pub gen: u32,
}

/// An endpoint slot and the generation of its occupant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EndpointId {
    pub idx: u32,
    pub gen: u32,
}

/// A channel slot and the generation of its occupant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ChannelId {
    pub idx: u32,
    pub gen: u32,
}

/// Transport protocol of a socket endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Proto {
    Tcp,
    Udp,
}

impl std::fmt::Display for EndpointKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EndpointKey::Native(name) => write!(f, "native {name}"),
            EndpointKey::Socket {
                proto,
                scope,
                addr,
                port,
            } => {
                let proto = match proto {
                    Proto::Tcp => "tcp",
                    Proto::Udp => "udp",
                };
                write!(f, "{proto} {}", std::net::SocketAddr::new(*addr, *port))?;
                match scope {
                    0 => Ok(()),
                    s => write!(f, " (netns {s})"),
                }
            }
        }
    }
}

/// What a listener is found by: a native service name, or a socket address. `scope` is the
/// network-namespace inode for loopback addresses (they only match inside one namespace) and 0
/// for addresses that mean the same thing everywhere.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum EndpointKey {
    Native(String),
    Socket {
        proto: Proto,
        scope: u64,
        addr: IpAddr,
        port: u16,
    },
}

/// The TCP 4-tuple of the real connection behind a transparent channel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConnTuple {
    pub client: SocketAddr,
    pub server: SocketAddr,
}

/// Longest native service name.
pub const MAX_NATIVE_NAME: usize = 64;
/// Bytes of an encoded [`EndpointKey`].
pub const KEY_BYTES: usize = 8 + MAX_NATIVE_NAME;
/// Bytes of an encoded [`ConnTuple`] (flag/families/ports word + two addresses).
pub const TUPLE_BYTES: usize = 40;

/// Packs an id into a u64 where 0 means "none": `(idx+1) | gen << 32`.
pub(crate) fn pack_id(idx: u32, gen: u32) -> u64 {
    (idx as u64 + 1) | ((gen as u64) << 32)
}

/// Inverse of [`pack_id`]; `None` for 0 or an index not below `limit`.
pub(crate) fn unpack_id(v: u64, limit: u32) -> Option<(u32, u32)> {
    let low = (v & 0xffff_ffff) as u32;
    let idx = low.checked_sub(1)?;
    (idx < limit).then_some((idx, (v >> 32) as u32))
}

/// The 24-bit tag of a member incarnation stored inside other entries' state words:
/// 12 bits of `idx+1` and the low 12 bits of the generation (0 means "none").
pub(crate) fn member_tag(id: MemberId) -> u32 {
    ((id.idx + 1) & 0xfff) | ((id.gen & 0xfff) << 12)
}

/// Encodes an address as a family byte (4 or 6) and 16 address bytes.
pub(crate) fn encode_ip(ip: &IpAddr) -> (u8, [u8; 16]) {
    let mut b = [0u8; 16];
    match ip {
        IpAddr::V4(a) => {
            b[..4].copy_from_slice(&a.octets());
            (4, b)
        }
        IpAddr::V6(a) => (6, a.octets()),
    }
}

pub(crate) fn decode_ip(fam: u8, b: &[u8; 16]) -> Result<IpAddr, RegistryError> {
    match fam {
        4 => Ok(IpAddr::V4(Ipv4Addr::new(b[0], b[1], b[2], b[3]))),
        6 => Ok(IpAddr::V6(Ipv6Addr::from(*b))),
        f => Err(RegistryError::corrupt(
            "address",
            format!("family byte {f}"),
        )),
    }
}

pub(crate) fn arr16(b: &[u8]) -> [u8; 16] {
    let mut a = [0u8; 16];
    a.copy_from_slice(&b[..16]);
    a
}

/// Checks a key a caller passes in (not from the region).
pub(crate) fn check_key(key: &EndpointKey) -> Result<(), RegistryError> {
    match key {
        EndpointKey::Native(n) if n.is_empty() || n.len() > MAX_NATIVE_NAME => {
            Err(RegistryError::InvalidParams(format!(
                "native name must be 1..={MAX_NATIVE_NAME} bytes"
            )))
        }
        _ => Ok(()),
    }
}

/// Canonical encoding: `[kind, a, b, 0, port lo, port hi, 0, 0]` then 64 bytes.
/// Native: a = length, then the name. Socket: a = proto, b = family, then scope u64 and address.
pub(crate) fn encode_key(key: &EndpointKey) -> [u8; KEY_BYTES] {
    let mut b = [0u8; KEY_BYTES];
    match key {
        EndpointKey::Native(name) => {
            let n = name.len().min(MAX_NATIVE_NAME);
            b[0] = 1;
            b[1] = n as u8;
            b[8..8 + n].copy_from_slice(&name.as_bytes()[..n]);
        }
        EndpointKey::Socket {
            proto,
            scope,
            addr,
            port,
        } => {
            let (fam, a) = encode_ip(addr);
            b[0] = 2;
            b[1] = match proto {
                Proto::Tcp => 1,
                Proto::Udp => 2,
            };
            b[2] = fam;
            b[4..6].copy_from_slice(&port.to_le_bytes());
            b[8..16].copy_from_slice(&scope.to_le_bytes());
            b[16..32].copy_from_slice(&a);
        }
    }
    b
}

pub(crate) fn decode_key(b: &[u8; KEY_BYTES]) -> Result<EndpointKey, RegistryError> {
    match b[0] {
        1 => {
            let n = b[1] as usize;
            if n == 0 || n > MAX_NATIVE_NAME {
                return Err(RegistryError::corrupt(
                    "endpoint key",
                    format!("name length {n}"),
                ));
            }
            let s = std::str::from_utf8(&b[8..8 + n])
                .map_err(|e| RegistryError::corrupt("endpoint key", format!("name: {e}")))?;
            Ok(EndpointKey::Native(s.to_owned()))
        }
        2 => {
            let proto = match b[1] {
                1 => Proto::Tcp,
                2 => Proto::Udp,
                p => return Err(RegistryError::corrupt("endpoint key", format!("proto {p}"))),
            };
            let addr = decode_ip(b[2], &arr16(&b[16..32]))?;
            let port = u16::from_le_bytes([b[4], b[5]]);
            let scope = u64::from_le_bytes(b[8..16].try_into().unwrap_or_default());
            Ok(EndpointKey::Socket {
                proto,
                scope,
                addr,
                port,
            })
        }
        k => Err(RegistryError::corrupt("endpoint key", format!("kind {k}"))),
    }
}

/// Stable across processes and builds (no random seed), which a shared table needs. A word at
/// a time with splitmix64's finish: the byte-wise FNV-1a it replaced cost ~100 ns a key (72
/// dependent multiplies), and a UDP send to a non-member looks up three keys.
pub(crate) fn hash_key(b: &[u8; KEY_BYTES]) -> u64 {
    const _: () = assert!(KEY_BYTES % 8 == 0);
    let mut h = 0x9e37_79b9_7f4a_7c15u64;
    for w in b.chunks_exact(8) {
        let x = u64::from_le_bytes(w.try_into().expect("8 bytes"));
        h = (h ^ x).wrapping_mul(0xbf58_476d_1ce4_e5b9).rotate_left(31);
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// `[1, fam c, fam s, 0, port c (2), port s (2)]`, client address, server address.
/// IPv6 flow info and scope ids are not part of the identity of a connection and are dropped.
pub(crate) fn encode_tuple(t: &ConnTuple) -> [u8; TUPLE_BYTES] {
    let mut b = [0u8; TUPLE_BYTES];
    let (cf, ca) = encode_ip(&t.client.ip());
    let (sf, sa) = encode_ip(&t.server.ip());
    b[0] = 1;
    b[1] = cf;
    b[2] = sf;
    b[4..6].copy_from_slice(&t.client.port().to_le_bytes());
    b[6..8].copy_from_slice(&t.server.port().to_le_bytes());
    b[8..24].copy_from_slice(&ca);
    b[24..40].copy_from_slice(&sa);
    b
}

pub(crate) fn decode_tuple(b: &[u8; TUPLE_BYTES]) -> Result<Option<ConnTuple>, RegistryError> {
    match b[0] {
        0 => Ok(None),
        1 => {
            let c = decode_ip(b[1], &arr16(&b[8..24]))?;
            let s = decode_ip(b[2], &arr16(&b[24..40]))?;
            let client = SocketAddr::new(c, u16::from_le_bytes([b[4], b[5]]));
            let server = SocketAddr::new(s, u16::from_le_bytes([b[6], b[7]]));
            Ok(Some(ConnTuple { client, server }))
        }
        f => Err(RegistryError::corrupt("channel tuple", format!("flag {f}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_and_hash_stably() {
        let keys = [
            EndpointKey::Native("echo".into()),
            EndpointKey::Socket {
                proto: Proto::Tcp,
                scope: 7,
                addr: "127.0.0.1".parse().unwrap(),
                port: 80,
            },
            EndpointKey::Socket {
                proto: Proto::Udp,
                scope: 0,
                addr: "fe80::1".parse().unwrap(),
                port: 53,
            },
        ];
        for k in &keys {
            let e = encode_key(k);
            assert_eq!(&decode_key(&e).unwrap(), k);
        }
        assert_eq!(
            hash_key(&encode_key(&keys[0])),
            hash_key(&encode_key(&keys[0]))
        );
        assert_ne!(
            hash_key(&encode_key(&keys[1])),
            hash_key(&encode_key(&keys[2]))
        );
    }

    #[test]
    fn bad_encodings_are_corrupt() {
        let mut e = encode_key(&EndpointKey::Native("x".into()));
        e[8] = 0xff;
        assert!(matches!(decode_key(&e), Err(RegistryError::Corrupt { .. })));
        e[1] = 65;
        assert!(decode_key(&e).is_err());
        let mut t = [0u8; TUPLE_BYTES];
        t[0] = 1;
        assert!(decode_tuple(&t).is_err());
        assert!(unpack_id(0, 4).is_none());
        assert_eq!(unpack_id(pack_id(3, 9), 4), Some((3, 9)));
        assert!(unpack_id(pack_id(4, 9), 4).is_none());
    }

    #[test]
    fn tuples_round_trip() {
        let t = ConnTuple {
            client: "10.0.0.1:5000".parse().unwrap(),
            server: "[::1]:80".parse().unwrap(),
        };
        assert_eq!(decode_tuple(&encode_tuple(&t)).unwrap(), Some(t));
    }
}
