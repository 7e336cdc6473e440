//! Messages between a client and the pipe service: one message per `SOCK_SEQPACKET` packet,
//! little-endian, a tag byte first. A submission carries its two descriptors as `SCM_RIGHTS`
//! (see [`crate::socket`]). Everything decoded is checked: a peer may be buggy.
//!
//! | tag | message | body |
//! | --- | --- | --- |
//! | 1 | `Hello` | version u16, weight u16, name length u8, name (UTF-8, ≤ 64 B; empty: the service names the tenant) |
//! | 2 | `Submit` | id u64, len u64 (0: until the source ends), source offset u64 (`u64::MAX`: none, read at the file's own position; else at most `i64::MAX`) — with exactly 2 fds: source, sink |
//! | 3 | `Cancel` | id u64 |
//! | 4 | `Stats` | — |
//! | 0x81 | `Welcome` | version u16, weight u16, tenant name (the rest) |
//! | 0x82 | `Refused` | reason (UTF-8, the rest) |
//! | 0x83 | `Done` | id u64, moved u64, errno i32 (0: success), primitive u8 (0: none) |
//! | 0x84 | `StatsReply` | JSON (the rest) |

use crate::transfer::Primitive;
use crate::PipeError;

/// The protocol's version; a service refuses a client of another one. (2: `Submit` carries a
/// source offset.)
pub const VERSION: u16 = 2;
/// A `Submit`'s source offset meaning "none".
pub const NO_OFFSET: u64 = u64::MAX;
/// Longest tenant name.
pub const MAX_NAME: usize = 64;
/// Largest packet either side sends (a statistics reply is the big one).
pub const MAX_PACKET: usize = 1 << 20;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToService {
    Hello {
        version: u16,
        weight: u16,
        name: String,
    },
    /// The two descriptors travel with the packet. `src_off`: read the source (a regular
    /// file) at this offset, leaving its file position alone (`sendfile` with an offset).
    Submit {
        id: u64,
        len: Option<u64>,
        src_off: Option<u64>,
    },
    Cancel {
        id: u64,
    },
    Stats,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToClient {
    Welcome {
        version: u16,
        weight: u16,
        tenant: String,
    },
    Refused {
        reason: String,
    },
    Done(Done),
    StatsReply {
        json: String,
    },
}

/// A finished transfer: bytes moved, and `errno` 0 or why it stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Done {
    pub id: u64,
    pub moved: u64,
    pub errno: i32,
    pub primitive: Option<Primitive>,
}

const T_HELLO: u8 = 1;
const T_SUBMIT: u8 = 2;
const T_CANCEL: u8 = 3;
const T_STATS: u8 = 4;
const T_WELCOME: u8 = 0x81;
const T_REFUSED: u8 = 0x82;
const T_DONE: u8 = 0x83;
const T_STATS_REPLY: u8 = 0x84;

impl ToService {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(32);
        match self {
            ToService::Hello {
                version,
                weight,
                name,
            } => {
                b.push(T_HELLO);
                b.extend(version.to_le_bytes());
                b.extend(weight.to_le_bytes());
                let name = clip(name, MAX_NAME);
                b.push(name.len() as u8);
                b.extend(name.as_bytes());
            }
            ToService::Submit { id, len, src_off } => {
                b.push(T_SUBMIT);
                b.extend(id.to_le_bytes());
                b.extend(len.unwrap_or(0).to_le_bytes());
                b.extend(src_off.unwrap_or(NO_OFFSET).to_le_bytes());
            }
            ToService::Cancel { id } => {
                b.push(T_CANCEL);
                b.extend(id.to_le_bytes());
            }
            ToService::Stats => b.push(T_STATS),
        }
        b
    }

    pub fn decode(p: &[u8]) -> Result<ToService, PipeError> {
        let mut r = Reader::new(p)?;
        let m = match r.tag {
            T_HELLO => {
                let version = r.u16()?;
                let weight = r.u16()?;
                let n = r.u8()? as usize;
                if n > MAX_NAME {
                    return Err(bad(format!(
                        "tenant name of {n} bytes (at most {MAX_NAME})"
                    )));
                }
                let name = r.utf8(n)?;
                ToService::Hello {
                    version,
                    weight,
                    name,
                }
            }
            T_SUBMIT => {
                let id = r.u64()?;
                let len = Some(r.u64()?).filter(|&l| l != 0);
                let src_off = match r.u64()? {
                    NO_OFFSET => None,
                    o if o > i64::MAX as u64 => {
                        return Err(bad(format!("source offset {o} beyond a file's largest")))
                    }
                    o => Some(o),
                };
                ToService::Submit { id, len, src_off }
            }
            T_CANCEL => ToService::Cancel { id: r.u64()? },
            T_STATS => ToService::Stats,
            t => return Err(bad(format!("unknown message tag {t:#x} from a client"))),
        };
        r.end()?;
        Ok(m)
    }
}

impl ToClient {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(32);
        match self {
            ToClient::Welcome {
                version,
                weight,
                tenant,
            } => {
                b.push(T_WELCOME);
                b.extend(version.to_le_bytes());
                b.extend(weight.to_le_bytes());
                b.extend(clip(tenant, MAX_NAME).as_bytes());
            }
            ToClient::Refused { reason } => {
                b.push(T_REFUSED);
                b.extend(clip(reason, 1024).as_bytes());
            }
            ToClient::Done(d) => {
                b.push(T_DONE);
                b.extend(d.id.to_le_bytes());
                b.extend(d.moved.to_le_bytes());
                b.extend(d.errno.to_le_bytes());
                b.push(primitive_code(d.primitive));
            }
            ToClient::StatsReply { json } => {
                b.push(T_STATS_REPLY);
                b.extend(clip(json, MAX_PACKET - 1).as_bytes());
            }
        }
        b
    }

    pub fn decode(p: &[u8]) -> Result<ToClient, PipeError> {
        let mut r = Reader::new(p)?;
        let m = match r.tag {
            T_WELCOME => ToClient::Welcome {
                version: r.u16()?,
                weight: r.u16()?,
                tenant: r.rest_utf8()?,
            },
            T_REFUSED => ToClient::Refused {
                reason: r.rest_utf8()?,
            },
            T_DONE => ToClient::Done(Done {
                id: r.u64()?,
                moved: r.u64()?,
                errno: r.i32()?,
                primitive: primitive_of(r.u8()?)?,
            }),
            T_STATS_REPLY => ToClient::StatsReply {
                json: r.rest_utf8()?,
            },
            t => return Err(bad(format!("unknown message tag {t:#x} from the service"))),
        };
        r.end()?;
        Ok(m)
    }
}

fn primitive_code(p: Option<Primitive>) -> u8 {
    match p {
        None => 0,
        Some(Primitive::CopyFileRange) => 1,
        Some(Primitive::Sendfile) => 2,
        Some(Primitive::Splice) => 3,
        Some(Primitive::SpliceViaPipe) => 4,
        Some(Primitive::Copy) => 5,
    }
}

fn primitive_of(c: u8) -> Result<Option<Primitive>, PipeError> {
    Ok(Some(match c {
        0 => return Ok(None),
        1 => Primitive::CopyFileRange,
        2 => Primitive::Sendfile,
        3 => Primitive::Splice,
        4 => Primitive::SpliceViaPipe,
        5 => Primitive::Copy,
        c => return Err(bad(format!("unknown primitive {c}"))),
    }))
}

/// `s` cut to at most `max` bytes at a character boundary.
fn clip(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

fn bad(why: String) -> PipeError {
    PipeError::Protocol(why)
}

/// Reads fields off a packet, failing on a short one.
struct Reader<'a> {
    tag: u8,
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn new(p: &'a [u8]) -> Result<Self, PipeError> {
        match p.split_first() {
            Some((&tag, rest)) => Ok(Reader { tag, rest }),
            None => Err(bad("an empty packet".into())),
        }
    }
    fn take<const N: usize>(&mut self) -> Result<[u8; N], PipeError> {
        if self.rest.len() < N {
            return Err(bad(format!("message {:#x} cut short", self.tag)));
        }
        let (a, b) = self.rest.split_at(N);
        self.rest = b;
        Ok(a.try_into().expect("N bytes"))
    }
    fn u8(&mut self) -> Result<u8, PipeError> {
        Ok(self.take::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, PipeError> {
        Ok(u16::from_le_bytes(self.take()?))
    }
    fn i32(&mut self) -> Result<i32, PipeError> {
        Ok(i32::from_le_bytes(self.take()?))
    }
    fn u64(&mut self) -> Result<u64, PipeError> {
        Ok(u64::from_le_bytes(self.take()?))
    }
    fn utf8(&mut self, n: usize) -> Result<String, PipeError> {
        if self.rest.len() < n {
            return Err(bad(format!("message {:#x} cut short", self.tag)));
        }
        let (a, b) = self.rest.split_at(n);
        self.rest = b;
        String::from_utf8(a.to_vec()).map_err(|_| bad("a name that is not UTF-8".into()))
    }
    fn rest_utf8(&mut self) -> Result<String, PipeError> {
        self.utf8(self.rest.len())
    }
    fn end(&self) -> Result<(), PipeError> {
        match self.rest.is_empty() {
            true => Ok(()),
            false => Err(bad(format!(
                "{} stray bytes after message {:#x}",
                self.rest.len(),
                self.tag
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn every_message_round_trips() {
        let s = [
            ToService::Hello {
                version: VERSION,
                weight: 4,
                name: "tenant-é".into(),
            },
            ToService::Submit {
                id: 7,
                len: None,
                src_off: None,
            },
            ToService::Submit {
                id: u64::MAX,
                len: Some(1 << 40),
                src_off: Some(0),
            },
            ToService::Submit {
                id: 8,
                len: Some(5),
                src_off: Some(i64::MAX as u64),
            },
            ToService::Cancel { id: 3 },
            ToService::Stats,
        ];
        for m in s {
            assert_eq!(ToService::decode(&m.encode()).unwrap(), m);
        }
        let c = [
            ToClient::Welcome {
                version: VERSION,
                weight: 2,
                tenant: "cgroup:/a".into(),
            },
            ToClient::Refused {
                reason: "full".into(),
            },
            ToClient::Done(Done {
                id: 9,
                moved: 123,
                errno: 32,
                primitive: Some(Primitive::SpliceViaPipe),
            }),
            ToClient::StatsReply { json: "{}".into() },
        ];
        for m in c {
            assert_eq!(ToClient::decode(&m.encode()).unwrap(), m);
        }
    }

    #[test]
    fn short_long_and_unknown_packets_are_refused() {
        let ok = ToService::Cancel { id: 1 }.encode();
        assert!(ToService::decode(&ok[..ok.len() - 1]).is_err(), "short");
        let mut long = ok.clone();
        long.push(0);
        assert!(ToService::decode(&long).is_err(), "stray byte");
        assert!(ToService::decode(&[]).is_err(), "empty");
        assert!(ToService::decode(&[0x7f]).is_err(), "unknown tag");
        assert!(
            ToClient::decode(&[T_DONE; 22]).is_err(),
            "unknown primitive"
        );
        let submit = ToService::Submit {
            id: 1,
            len: None,
            src_off: Some(3),
        }
        .encode();
        assert!(
            ToService::decode(&submit[..submit.len() - 8]).is_err(),
            "a submission without its offset (version 1's)"
        );
        let mut far = submit[..submit.len() - 8].to_vec();
        far.extend((i64::MAX as u64 + 1).to_le_bytes());
        assert!(ToService::decode(&far).is_err(), "offset beyond i64::MAX");
        let mut hello = vec![T_HELLO, 1, 0, 1, 0, 65];
        hello.extend([b'a'; 65]);
        assert!(ToService::decode(&hello).is_err(), "name too long");
    }

    proptest! {
        #[test]
        fn decoding_garbage_never_panics(p in proptest::collection::vec(any::<u8>(), 0..128)) {
            let _ = ToService::decode(&p);
            let _ = ToClient::decode(&p);
        }
    }
}
