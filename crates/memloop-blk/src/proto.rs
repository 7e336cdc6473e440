//! The block protocol's messages: pure, no I/O. Every message starts with a 64-byte header at
//! the start of its first segment (little-endian); what [`decode`](RequestHeader::decode)
//! and the `validate` functions accept is checked field by field, because the peer may be
//! buggy: a bad request becomes an `EINVAL` completion, never a panic.
//!
//! Two descriptor channels per attachment (see the crate documentation for why two): the
//! *request* channel carries `Hello` (client → server), `Info` (server → client) and then
//! `Request`s; the *completion* channel carries `Hello` (client → server, naming the session
//! by its token), `Ready` (server → client) and then `Completion`s.
//!
//! Common to all headers:
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 4 | magic `MLBK` (bytes `4d 4c 42 4b`) |
//! | 4 | 1 | version ([`VERSION`]) |
//! | 5 | 1 | kind: 1 `Hello`, 2 `Info`, 3 `Request`, 4 `Completion`, 5 `Ready` |
//!
//! `Hello` (kind 1):
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 6 | 1 | role: 1 requests (the first channel), 2 completions (the second) |
//! | 7 | 1 | 0 |
//! | 8 | 8 | token (role 2: the session's, from `Info`; role 1: 0) |
//! | 16 | 4 | queue depth wanted (0: the export's) |
//! | 20 | 4 | max I/O wanted, bytes (0: the export's) |
//! | 24 | 40 | 0 |
//!
//! `Info` (kind 2), the server's answer to a role-1 `Hello`:
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 6 | 2 | 0 |
//! | 8 | 8 | token: names this session in the second channel's `Hello` |
//! | 16 | 8 | size of the export, bytes (a multiple of the block size) |
//! | 24 | 4 | logical block size: 512 or 4096 |
//! | 28 | 4 | max I/O, bytes, for this session (a multiple of the block size) |
//! | 32 | 4 | queue depth for this session (1..=[`MAX_QUEUE_DEPTH`]) |
//! | 36 | 4 | flags: 1 read-only, 2 flush (a volatile cache: completed writes are durable only after a flush; clear for memory-backed storage, where a flush has nothing to do), 4 FUA, 8 discard |
//! | 40 | 4 | status: 0 attached; else an errno, and the fields above are 0 |
//! | 44 | 20 | 0 |
//!
//! `Ready` (kind 5), the server's answer to a role-2 `Hello`: 6..8 zero, 8 token, 16..64 zero.
//!
//! `Request` (kind 3):
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 6 | 1 | op: 1 READ, 2 WRITE, 3 FLUSH, 4 DISCARD |
//! | 7 | 1 | flags: 1 FUA (WRITE only) |
//! | 8 | 8 | tag (the client's; echoed by the completion) |
//! | 16 | 8 | offset, bytes (a multiple of the block size; FLUSH: 0) |
//! | 24 | 4 | length, bytes (a multiple of the block size, > 0; READ/WRITE ≤ max I/O; FLUSH: 0) |
//! | 28 | 4 | WRITE: where the payload starts in the message — a byte offset into its segments taken in order, ≥ 64; others 0 |
//! | 32 | 32 | 0 |
//!
//! `Completion` (kind 4):
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 6 | 2 | 0 |
//! | 8 | 8 | tag of the request (0 if the request was too broken to name one) |
//! | 16 | 4 | status: 0, or an errno (`EIO`, `EROFS`, `EINVAL`, `EOPNOTSUPP`, …) |
//! | 20 | 4 | READ with status 0: bytes of data in this message (the request's length); else 0 |
//! | 24 | 4 | READ with status 0: where the data starts in the first segment (≥ 64); else 0 |
//! | 28 | 36 | 0 |
//!
//! A write's payload follows its header in the client's own pool buffer (or in any segments
//! after it: a payload received from elsewhere can be forwarded); a read's data follows the
//! completion header in the server's pool buffer.

use std::fmt;

/// `MLBK` as it lies in memory.
pub const MAGIC: [u8; 4] = *b"MLBK";
/// The protocol's version; either side refuses another.
pub const VERSION: u8 = 1;
/// Every header's size (and the room a buffer keeps before its payload).
pub const HEADER_LEN: usize = 64;
/// The default and largest I/O a session carries.
pub const DEFAULT_MAX_IO: u32 = 1 << 20;
pub const MAX_MAX_IO: u32 = 16 << 20;
/// The default queue depth, and the largest: a descriptor ring holds 512 slots each way,
/// and every request or completion in flight holds one until it is released.
pub const DEFAULT_QUEUE_DEPTH: u32 = 64;
pub const MAX_QUEUE_DEPTH: u32 = 256;

pub const KIND_HELLO: u8 = 1;
pub const KIND_INFO: u8 = 2;
pub const KIND_REQUEST: u8 = 3;
pub const KIND_COMPLETION: u8 = 4;
pub const KIND_READY: u8 = 5;

/// `Info` flags.
pub const INFO_READ_ONLY: u32 = 1;
pub const INFO_FLUSH: u32 = 2;
pub const INFO_FUA: u32 = 4;
pub const INFO_DISCARD: u32 = 8;
const INFO_KNOWN: u32 = INFO_READ_ONLY | INFO_FLUSH | INFO_FUA | INFO_DISCARD;

/// Request flags.
pub const FLAG_FUA: u8 = 1;

/// Highest errno a completion or an `Info` may carry.
pub const MAX_ERRNO: u32 = 4095;

/// errno values the protocol speaks (Linux numbering, the same on every Linux architecture
/// this runs on).
pub mod errno {
    pub const ENOENT: i32 = 2;
    pub const EIO: i32 = 5;
    pub const EAGAIN: i32 = 11;
    pub const ENOMEM: i32 = 12;
    pub const EINVAL: i32 = 22;
    pub const ENOSPC: i32 = 28;
    pub const EROFS: i32 = 30;
    pub const EPROTO: i32 = 71;
    pub const EOPNOTSUPP: i32 = 95;
    pub const ETIMEDOUT: i32 = 110;
}

/// What a request asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    Read = 1,
    Write = 2,
    Flush = 3,
    Discard = 4,
}

impl Op {
    pub fn from_wire(b: u8) -> Option<Op> {
        Some(match b {
            1 => Op::Read,
            2 => Op::Write,
            3 => Op::Flush,
            4 => Op::Discard,
            _ => return None,
        })
    }
}

/// Why a message was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Invalid {
    /// Fewer bytes than a header.
    Short(usize),
    Magic,
    Version(u8),
    Kind {
        want: u8,
        got: u8,
    },
    Op(u8),
    Flags(u8),
    Role(u8),
    /// A field that must be zero is not.
    Reserved(usize),
    ZeroLength,
    TooLong {
        len: u32,
        max: u32,
    },
    /// Offset or length not a multiple of the block size.
    Misaligned {
        offset: u64,
        len: u32,
        block: u32,
    },
    /// offset + length overflows.
    Overflow,
    /// Beyond the export's end.
    OutOfRange {
        end: u64,
        size: u64,
    },
    /// A write whose message holds fewer payload bytes than its length.
    ShortData {
        need: u64,
        have: u64,
    },
    /// A payload offset inside the header (or one given where none belongs).
    DataOffset(u32),
    /// FLUSH with an offset or a length.
    FlushRange,
    /// A status that is no errno.
    Status(u32),
    /// A read's completion whose data does not match the request.
    DataLength {
        want: u32,
        got: u32,
    },
    /// An `Info` that describes no usable export.
    Info(&'static str),
}

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Invalid::Short(n) => write!(f, "{n} bytes: shorter than a {HEADER_LEN}-byte header"),
            Invalid::Magic => write!(f, "not a block protocol header (bad magic)"),
            Invalid::Version(v) => write!(f, "protocol version {v} (this is {VERSION})"),
            Invalid::Kind { want, got } => write!(f, "message kind {got} where {want} belongs"),
            Invalid::Op(o) => write!(f, "unknown op {o}"),
            Invalid::Flags(x) => write!(f, "flags {x:#x} not valid for this op"),
            Invalid::Role(r) => write!(f, "unknown role {r}"),
            Invalid::Reserved(at) => write!(f, "reserved byte {at} is not zero"),
            Invalid::ZeroLength => write!(f, "length 0"),
            Invalid::TooLong { len, max } => write!(f, "length {len} above the maximum {max}"),
            Invalid::Misaligned { offset, len, block } => write!(
                f,
                "offset {offset} or length {len} not a multiple of the block size {block}"
            ),
            Invalid::Overflow => write!(f, "offset + length overflows"),
            Invalid::OutOfRange { end, size } => {
                write!(f, "ends at {end}, beyond the export's {size} bytes")
            }
            Invalid::ShortData { need, have } => {
                write!(
                    f,
                    "the message holds {have} bytes, the payload needs {need}"
                )
            }
            Invalid::DataOffset(o) => write!(f, "payload offset {o} not valid here"),
            Invalid::FlushRange => write!(f, "FLUSH with an offset or a length"),
            Invalid::Status(s) => write!(f, "status {s} is no errno"),
            Invalid::DataLength { want, got } => {
                write!(f, "{got} bytes of read data where {want} were asked for")
            }
            Invalid::Info(why) => write!(f, "export info: {why}"),
        }
    }
}

impl std::error::Error for Invalid {}

/// A refused request: why, and the tag to answer if the header named one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub tag: Option<u64>,
    pub why: Invalid,
}

// ---------------------------------------------------------------------------------------------
// Field access.

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(w)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// A header of `kind` with the common fields written, the rest zero.
fn header(kind: u8) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[..4].copy_from_slice(&MAGIC);
    h[4] = VERSION;
    h[5] = kind;
    h
}

/// The header's first [`HEADER_LEN`] bytes, after checking magic, version and kind.
fn common(b: &[u8], kind: u8) -> Result<&[u8], Invalid> {
    if b.len() < HEADER_LEN {
        return Err(Invalid::Short(b.len()));
    }
    let h = &b[..HEADER_LEN];
    if h[..4] != MAGIC {
        return Err(Invalid::Magic);
    }
    if h[4] != VERSION {
        return Err(Invalid::Version(h[4]));
    }
    if h[5] != kind {
        return Err(Invalid::Kind {
            want: kind,
            got: h[5],
        });
    }
    Ok(h)
}

/// The kind byte of a header that passes the common checks (for dispatch).
pub fn kind_of(b: &[u8]) -> Result<u8, Invalid> {
    let k = b.get(5).copied().ok_or(Invalid::Short(b.len()))?;
    common(b, k).map(|h| h[5])
}

/// Every byte of `range` is zero.
fn zeros(h: &[u8], range: std::ops::Range<usize>) -> Result<(), Invalid> {
    match h[range.clone()].iter().position(|&b| b != 0) {
        Some(i) => Err(Invalid::Reserved(range.start + i)),
        None => Ok(()),
    }
}

fn status_ok(s: u32) -> Result<u32, Invalid> {
    match s <= MAX_ERRNO {
        true => Ok(s),
        false => Err(Invalid::Status(s)),
    }
}

// ---------------------------------------------------------------------------------------------
// Hello, Info, Ready.

/// Which of the two channels a `Hello` opens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Requests = 1,
    Completions = 2,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    pub role: Role,
    pub token: u64,
    /// 0: the export's.
    pub queue_depth: u32,
    /// 0: the export's.
    pub max_io: u32,
}

impl Hello {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = header(KIND_HELLO);
        h[6] = self.role as u8;
        put_u64(&mut h, 8, self.token);
        put_u32(&mut h, 16, self.queue_depth);
        put_u32(&mut h, 20, self.max_io);
        h
    }

    pub fn decode(b: &[u8]) -> Result<Hello, Invalid> {
        let h = common(b, KIND_HELLO)?;
        let role = match h[6] {
            1 => Role::Requests,
            2 => Role::Completions,
            r => return Err(Invalid::Role(r)),
        };
        zeros(h, 7..8)?;
        zeros(h, 24..HEADER_LEN)?;
        Ok(Hello {
            role,
            token: u64_at(h, 8),
            queue_depth: u32_at(h, 16),
            max_io: u32_at(h, 20),
        })
    }
}

/// What an export is, for one session (its max I/O and queue depth are the session's).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ExportInfo {
    pub token: u64,
    pub size: u64,
    pub block_size: u32,
    pub max_io: u32,
    pub queue_depth: u32,
    pub flags: u32,
}

impl ExportInfo {
    pub fn read_only(&self) -> bool {
        self.flags & INFO_READ_ONLY != 0
    }
    pub fn can_discard(&self) -> bool {
        self.flags & INFO_DISCARD != 0
    }
    /// Whether completed writes become durable only with a flush (a volatile cache). Without
    /// it a flush has nothing to do, and a client may answer one itself.
    pub fn needs_flush(&self) -> bool {
        self.flags & INFO_FLUSH != 0
    }

    /// The checks a client makes of an `Info` (and a server of what it is about to send).
    pub fn validate(&self) -> Result<(), Invalid> {
        if self.block_size != 512 && self.block_size != 4096 {
            return Err(Invalid::Info("block size neither 512 nor 4096"));
        }
        let bs = self.block_size as u64;
        if self.size == 0 || self.size % bs != 0 {
            return Err(Invalid::Info(
                "size zero or not a multiple of the block size",
            ));
        }
        if self.max_io == 0 || self.max_io % self.block_size != 0 || self.max_io > MAX_MAX_IO {
            return Err(Invalid::Info("max I/O not a multiple of the block size"));
        }
        if self.queue_depth == 0 || self.queue_depth > MAX_QUEUE_DEPTH {
            return Err(Invalid::Info("queue depth out of range"));
        }
        if self.flags & !INFO_KNOWN != 0 {
            return Err(Invalid::Info("unknown flags"));
        }
        Ok(())
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = header(KIND_INFO);
        put_u64(&mut h, 8, self.token);
        put_u64(&mut h, 16, self.size);
        put_u32(&mut h, 24, self.block_size);
        put_u32(&mut h, 28, self.max_io);
        put_u32(&mut h, 32, self.queue_depth);
        put_u32(&mut h, 36, self.flags);
        h
    }

    /// A refusal to attach: only the status is set.
    pub fn encode_refusal(errno: i32) -> [u8; HEADER_LEN] {
        let mut h = header(KIND_INFO);
        put_u32(&mut h, 40, errno.clamp(1, MAX_ERRNO as i32) as u32);
        h
    }

    /// An `Info`: `Ok(Ok(info))` for a valid one, `Ok(Err(errno))` for a refusal.
    pub fn decode(b: &[u8]) -> Result<Result<ExportInfo, i32>, Invalid> {
        let h = common(b, KIND_INFO)?;
        zeros(h, 6..8)?;
        zeros(h, 44..HEADER_LEN)?;
        let status = status_ok(u32_at(h, 40))?;
        if status != 0 {
            zeros(h, 8..40)?;
            return Ok(Err(status as i32));
        }
        let info = ExportInfo {
            token: u64_at(h, 8),
            size: u64_at(h, 16),
            block_size: u32_at(h, 24),
            max_io: u32_at(h, 28),
            queue_depth: u32_at(h, 32),
            flags: u32_at(h, 36),
        };
        info.validate()?;
        Ok(Ok(info))
    }
}

/// The server's answer to the completion channel's `Hello`: the session is whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ready {
    pub token: u64,
}

impl Ready {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = header(KIND_READY);
        put_u64(&mut h, 8, self.token);
        h
    }

    pub fn decode(b: &[u8]) -> Result<Ready, Invalid> {
        let h = common(b, KIND_READY)?;
        zeros(h, 6..8)?;
        zeros(h, 16..HEADER_LEN)?;
        Ok(Ready {
            token: u64_at(h, 8),
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Requests.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestHeader {
    pub op: Op,
    pub fua: bool,
    pub tag: u64,
    pub offset: u64,
    pub len: u32,
    /// WRITE: where the payload starts in the message; others 0.
    pub data_off: u32,
}

impl RequestHeader {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = header(KIND_REQUEST);
        h[6] = self.op as u8;
        h[7] = if self.fua { FLAG_FUA } else { 0 };
        put_u64(&mut h, 8, self.tag);
        put_u64(&mut h, 16, self.offset);
        put_u32(&mut h, 24, self.len);
        put_u32(&mut h, 28, self.data_off);
        h
    }

    /// The header's form: magic, version, kind, op, flags, zero bytes. The tag is returned
    /// with the refusal once the bytes are known to be a request header.
    pub fn decode(b: &[u8]) -> Result<RequestHeader, Refusal> {
        let h = common(b, KIND_REQUEST).map_err(|why| Refusal { tag: None, why })?;
        let tag = u64_at(h, 8);
        let refuse = |why| Refusal {
            tag: Some(tag),
            why,
        };
        let op = Op::from_wire(h[6]).ok_or(refuse(Invalid::Op(h[6])))?;
        let flags = h[7];
        let allowed = if op == Op::Write { FLAG_FUA } else { 0 };
        if flags & !allowed != 0 {
            return Err(refuse(Invalid::Flags(flags)));
        }
        zeros(h, 32..HEADER_LEN).map_err(refuse)?;
        Ok(RequestHeader {
            op,
            fua: flags & FLAG_FUA != 0,
            tag,
            offset: u64_at(h, 16),
            len: u32_at(h, 24),
            data_off: u32_at(h, 28),
        })
    }

    /// What the request asks, against the session (`info`) and the message that carries it
    /// (`msg_len`: its bytes over all segments). The client checks before it sends, the
    /// server again on receipt.
    pub fn validate(&self, info: &ExportInfo, msg_len: u64) -> Result<(), Invalid> {
        let bs = info.block_size.max(1);
        if self.op == Op::Flush {
            if self.offset != 0 || self.len != 0 {
                return Err(Invalid::FlushRange);
            }
            if self.data_off != 0 {
                return Err(Invalid::DataOffset(self.data_off));
            }
            return Ok(());
        }
        if self.len == 0 {
            return Err(Invalid::ZeroLength);
        }
        if matches!(self.op, Op::Read | Op::Write) && self.len > info.max_io {
            return Err(Invalid::TooLong {
                len: self.len,
                max: info.max_io,
            });
        }
        if self.offset % bs as u64 != 0 || self.len % bs != 0 {
            return Err(Invalid::Misaligned {
                offset: self.offset,
                len: self.len,
                block: bs,
            });
        }
        let end = self
            .offset
            .checked_add(self.len as u64)
            .ok_or(Invalid::Overflow)?;
        if end > info.size {
            return Err(Invalid::OutOfRange {
                end,
                size: info.size,
            });
        }
        match self.op {
            Op::Write => {
                if (self.data_off as usize) < HEADER_LEN {
                    return Err(Invalid::DataOffset(self.data_off));
                }
                let need = self.data_off as u64 + self.len as u64;
                if need > msg_len {
                    return Err(Invalid::ShortData {
                        need,
                        have: msg_len,
                    });
                }
            }
            _ if self.data_off != 0 => return Err(Invalid::DataOffset(self.data_off)),
            _ => {}
        }
        Ok(())
    }
}

/// Decodes and validates a request: the header `hdr` (the first segment's start), in a
/// message of `msg_len` bytes, for the session `info`.
pub fn parse_request(
    hdr: &[u8],
    msg_len: u64,
    info: &ExportInfo,
) -> Result<RequestHeader, Refusal> {
    let r = RequestHeader::decode(hdr)?;
    r.validate(info, msg_len).map_err(|why| Refusal {
        tag: Some(r.tag),
        why,
    })?;
    Ok(r)
}

// ---------------------------------------------------------------------------------------------
// Completions.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CompletionHeader {
    pub tag: u64,
    /// 0 or an errno.
    pub status: u32,
    /// READ with status 0: data bytes; else 0.
    pub len: u32,
    /// READ with status 0: where the data starts in the first segment; else 0.
    pub data_off: u32,
}

impl CompletionHeader {
    /// A completion carrying no data.
    pub fn status(tag: u64, errno: i32) -> CompletionHeader {
        CompletionHeader {
            tag,
            status: errno.clamp(0, MAX_ERRNO as i32) as u32,
            len: 0,
            data_off: 0,
        }
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = header(KIND_COMPLETION);
        put_u64(&mut h, 8, self.tag);
        put_u32(&mut h, 16, self.status);
        put_u32(&mut h, 20, self.len);
        put_u32(&mut h, 24, self.data_off);
        h
    }

    /// The header's form; what it says about its request is [`validate`](Self::validate)'s.
    pub fn decode(b: &[u8]) -> Result<CompletionHeader, Invalid> {
        let h = common(b, KIND_COMPLETION)?;
        zeros(h, 6..8)?;
        zeros(h, 28..HEADER_LEN)?;
        let c = CompletionHeader {
            tag: u64_at(h, 8),
            status: status_ok(u32_at(h, 16))?,
            len: u32_at(h, 20),
            data_off: u32_at(h, 24),
        };
        Ok(c)
    }

    /// Checks the completion against its request (`op`, `len` asked) and the first segment's
    /// length: a successful READ carries exactly the bytes asked for, inside the segment;
    /// anything else carries none.
    pub fn validate(&self, op: Op, want: u32, seg_len: usize) -> Result<(), Invalid> {
        if op == Op::Read && self.status == 0 {
            if self.len != want {
                return Err(Invalid::DataLength {
                    want,
                    got: self.len,
                });
            }
            if (self.data_off as usize) < HEADER_LEN {
                return Err(Invalid::DataOffset(self.data_off));
            }
            let need = self.data_off as u64 + self.len as u64;
            if need > seg_len as u64 {
                return Err(Invalid::ShortData {
                    need,
                    have: seg_len as u64,
                });
            }
            return Ok(());
        }
        if self.len != 0 {
            return Err(Invalid::DataLength {
                want: 0,
                got: self.len,
            });
        }
        if self.data_off != 0 {
            return Err(Invalid::DataOffset(self.data_off));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn info() -> ExportInfo {
        ExportInfo {
            token: 7,
            size: 1 << 20,
            block_size: 512,
            max_io: 128 << 10,
            queue_depth: 64,
            flags: INFO_FLUSH | INFO_FUA | INFO_DISCARD,
        }
    }

    fn write(offset: u64, len: u32) -> RequestHeader {
        RequestHeader {
            op: Op::Write,
            fua: false,
            tag: 9,
            offset,
            len,
            data_off: HEADER_LEN as u32,
        }
    }

    #[test]
    fn layout_is_as_documented() {
        let r = RequestHeader {
            op: Op::Write,
            fua: true,
            tag: 0x0102030405060708,
            offset: 0x1000,
            len: 0x200,
            data_off: 64,
        };
        let h = r.encode();
        assert_eq!(&h[..6], b"MLBK\x01\x03");
        assert_eq!((h[6], h[7]), (2, 1));
        assert_eq!(h[8..16], 0x0102030405060708u64.to_le_bytes());
        assert_eq!(h[16..24], 0x1000u64.to_le_bytes());
        assert_eq!(h[24..28], 0x200u32.to_le_bytes());
        assert_eq!(h[28..32], 64u32.to_le_bytes());
        assert!(h[32..].iter().all(|&b| b == 0));
        let c = CompletionHeader {
            tag: 5,
            status: 30,
            len: 0,
            data_off: 0,
        }
        .encode();
        assert_eq!(c[5], KIND_COMPLETION);
        assert_eq!(c[16..20], 30u32.to_le_bytes());
    }

    #[test]
    fn round_trips() {
        let i = info();
        assert_eq!(ExportInfo::decode(&i.encode()), Ok(Ok(i)));
        assert_eq!(
            ExportInfo::decode(&ExportInfo::encode_refusal(errno::ENOSPC)),
            Ok(Err(errno::ENOSPC))
        );
        let h = Hello {
            role: Role::Completions,
            token: 3,
            queue_depth: 32,
            max_io: 4096,
        };
        assert_eq!(Hello::decode(&h.encode()), Ok(h));
        assert_eq!(
            Ready::decode(&Ready { token: 4 }.encode()),
            Ok(Ready { token: 4 })
        );
        let w = write(512, 1024);
        assert_eq!(parse_request(&w.encode(), 64 + 1024, &i), Ok(w));
        let c = CompletionHeader {
            tag: 1,
            status: 0,
            len: 4096,
            data_off: 64,
        };
        assert_eq!(CompletionHeader::decode(&c.encode()), Ok(c));
        assert_eq!(c.validate(Op::Read, 4096, 64 + 4096), Ok(()));
    }

    #[test]
    fn bad_requests_are_refused_with_their_reason() {
        let i = info();
        let ok = write(0, 512);
        type Case = (RequestHeader, u64, fn(&Invalid) -> bool);
        let cases: Vec<Case> = vec![
            (write(0, 0), 64, |e| *e == Invalid::ZeroLength),
            (write(0, 256 << 10), 1 << 20, |e| {
                matches!(e, Invalid::TooLong { .. })
            }),
            (write(100, 512), 1024, |e| {
                matches!(e, Invalid::Misaligned { .. })
            }),
            (write(0, 100), 1024, |e| {
                matches!(e, Invalid::Misaligned { .. })
            }),
            (write(1 << 20, 512), 1024, |e| {
                matches!(e, Invalid::OutOfRange { .. })
            }),
            (write(u64::MAX - 511, 1024), 2048, |e| {
                *e == Invalid::Overflow
            }),
            (write(0, 1024), 64 + 512, |e| {
                matches!(e, Invalid::ShortData { .. })
            }),
            (RequestHeader { data_off: 10, ..ok }, 1024, |e| {
                matches!(e, Invalid::DataOffset(10))
            }),
            (
                RequestHeader {
                    op: Op::Flush,
                    len: 512,
                    ..ok
                },
                64,
                |e| *e == Invalid::FlushRange,
            ),
            (RequestHeader { op: Op::Read, ..ok }, 64, |e| {
                matches!(e, Invalid::DataOffset(64))
            }),
        ];
        for (r, len, want) in cases {
            let got = parse_request(&r.encode(), len, &i).unwrap_err();
            assert_eq!(got.tag, Some(9), "{r:?}");
            assert!(want(&got.why), "{r:?}: {}", got.why);
        }
        // Form: op, flags, reserved, magic, version, kind, length.
        let mut h = ok.encode();
        h[6] = 9;
        assert_eq!(RequestHeader::decode(&h).unwrap_err().why, Invalid::Op(9));
        let mut h = RequestHeader { op: Op::Read, ..ok }.encode();
        h[7] = FLAG_FUA;
        assert_eq!(
            RequestHeader::decode(&h).unwrap_err().why,
            Invalid::Flags(1)
        );
        let mut h = ok.encode();
        h[7] = 2;
        assert!(RequestHeader::decode(&h).is_err());
        let mut h = ok.encode();
        h[40] = 1;
        assert_eq!(
            RequestHeader::decode(&h).unwrap_err().why,
            Invalid::Reserved(40)
        );
        let mut h = ok.encode();
        h[0] = b'X';
        assert_eq!(
            RequestHeader::decode(&h).unwrap_err(),
            Refusal {
                tag: None,
                why: Invalid::Magic
            }
        );
        let mut h = ok.encode();
        h[4] = 2;
        assert_eq!(
            RequestHeader::decode(&h).unwrap_err().why,
            Invalid::Version(2)
        );
        let h = CompletionHeader::status(1, 0).encode();
        assert!(matches!(
            RequestHeader::decode(&h).unwrap_err().why,
            Invalid::Kind { .. }
        ));
        assert_eq!(
            RequestHeader::decode(&ok.encode()[..63]).unwrap_err().why,
            Invalid::Short(63)
        );
    }

    #[test]
    fn bad_completions_and_infos_are_refused() {
        let c = CompletionHeader {
            tag: 1,
            status: 0,
            len: 4096,
            data_off: 64,
        };
        assert!(c.validate(Op::Read, 8192, 1 << 20).is_err());
        assert!(c.validate(Op::Read, 4096, 64 + 4095).is_err());
        assert!(CompletionHeader { data_off: 8, ..c }
            .validate(Op::Read, 4096, 1 << 20)
            .is_err());
        assert!(c.validate(Op::Write, 4096, 1 << 20).is_err());
        let mut h = c.encode();
        h[16..20].copy_from_slice(&5000u32.to_le_bytes());
        assert_eq!(CompletionHeader::decode(&h), Err(Invalid::Status(5000)));
        for bad in [
            ExportInfo {
                block_size: 1024,
                ..info()
            },
            ExportInfo {
                size: 1000,
                ..info()
            },
            ExportInfo {
                max_io: 0,
                ..info()
            },
            ExportInfo {
                queue_depth: 1000,
                ..info()
            },
            ExportInfo {
                flags: 1 << 7,
                ..info()
            },
        ] {
            assert!(ExportInfo::decode(&bad.encode()).is_err(), "{bad:?}");
        }
    }

    proptest! {
        /// Any bytes: decoding never panics, and whatever passes validation lies inside the
        /// export, aligned, and (for writes) inside the message.
        #[test]
        fn arbitrary_headers_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..80),
                                         kind in 1u8..6, msg_len in 0u64..(1 << 21)) {
            let mut b = bytes;
            if b.len() >= 6 {
                b[..4].copy_from_slice(&MAGIC);
                b[4] = VERSION;
                b[5] = kind;
            }
            let i = info();
            if let Ok(r) = parse_request(&b, msg_len, &i) {
                if r.op != Op::Flush {
                    prop_assert!(r.offset + r.len as u64 <= i.size);
                    prop_assert_eq!(r.offset % 512, 0);
                    prop_assert_eq!(r.len % 512, 0);
                }
                if r.op == Op::Write {
                    prop_assert!(r.data_off as u64 + r.len as u64 <= msg_len);
                }
            }
            let _ = Hello::decode(&b);
            let _ = ExportInfo::decode(&b);
            let _ = Ready::decode(&b);
            if let Ok(c) = CompletionHeader::decode(&b) {
                let _ = c.validate(Op::Read, 512, msg_len as usize);
            }
            let _ = kind_of(&b);
        }

        #[test]
        fn valid_requests_round_trip(op in 1u8..5, fua: bool, tag: u64,
                                     block in 0u64..2048, blocks in 1u32..256) {
            let i = info();
            let op = Op::from_wire(op).unwrap();
            let r = RequestHeader {
                op,
                fua: fua && op == Op::Write,
                tag,
                offset: if op == Op::Flush { 0 } else { block * 512 },
                len: if op == Op::Flush { 0 } else { blocks * 512 },
                data_off: if op == Op::Write { 64 } else { 0 },
            };
            let msg = 64 + r.len as u64;
            let fits = op == Op::Flush || r.offset + r.len as u64 <= i.size;
            prop_assert_eq!(parse_request(&r.encode(), msg, &i).is_ok(), fits);
            if fits {
                prop_assert_eq!(parse_request(&r.encode(), msg, &i).unwrap(), r);
            }
        }
    }
}
