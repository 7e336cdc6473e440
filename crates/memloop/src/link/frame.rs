//! A link frame: a virtio-net header (`struct virtio_net_hdr_v1`, 12 bytes, little endian)
//! followed by an IP packet. The peer wrote it, so it is checked before a device sees it: a
//! buggy or hostile side must cost one dropped, counted frame — never a crash, and never a
//! frame that makes the kernel on this side do something it would refuse from a real NIC.
//! The frame is handed to the device in place, so a peer could still change it between this
//! check and the kernel's copy: that gains it nothing, as the TUN driver checks the header and
//! the packet again on its own copy (the check here is for a clear counter, not for safety).
//!
//! | offset | field |
//! | --- | --- |
//! | 0 | flags: 1 needs checksum (csum_start/csum_offset valid), 2 data valid |
//! | 1 | gso type: 0 none, 1 TCPv4, 3 UDP, 4 TCPv6, 5 UDP L4; bit 7 ECN |
//! | 2, 4 | header length, segment size (gso) |
//! | 6, 8 | checksum start, checksum offset (from the start of the packet) |
//! | 10 | number of buffers (unused: 0) |

/// Size of the virtio-net header before every packet.
pub const VNET_HDR_LEN: usize = 12;
/// The largest frame: the header and an IPv6 packet with a 64 KiB payload (a GSO
/// super-packet), rounded up to 8 bytes.
pub const MAX_FRAME: usize = (VNET_HDR_LEN + 40 + 65535).next_multiple_of(8);
/// How much of a frame [`check_frame`] looks at: the header and the IP header.
pub const FRAME_HEAD: usize = VNET_HDR_LEN + 40;

const F_NEEDS_CSUM: u8 = 1;
const F_DATA_VALID: u8 = 2;
const GSO_ECN: u8 = 0x80;

/// Why a frame was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("malformed link frame: {0}")]
pub struct BadFrame(pub &'static str);

/// Checks a frame of `len` bytes whose first bytes are `head` (at least [`FRAME_HEAD`] of
/// them, or the whole frame if shorter).
pub fn check_frame(head: &[u8], len: u64) -> Result<(), BadFrame> {
    if len > MAX_FRAME as u64 {
        return Err(BadFrame("longer than the largest frame"));
    }
    if (head.len() as u64) < len.min(FRAME_HEAD as u64) {
        return Err(BadFrame("fewer bytes looked at than the frame has"));
    }
    if len < (VNET_HDR_LEN + 20) as u64 {
        return Err(BadFrame("shorter than a virtio-net and an IPv4 header"));
    }
    let pkt = len - VNET_HDR_LEN as u64;
    check_vnet(&head[..VNET_HDR_LEN], pkt)?;
    check_ip(&head[VNET_HDR_LEN..], pkt)
}

fn le16(b: &[u8], at: usize) -> u64 {
    u16::from_le_bytes([b[at], b[at + 1]]) as u64
}

fn check_vnet(h: &[u8], pkt: u64) -> Result<(), BadFrame> {
    let (flags, gso) = (h[0], h[1]);
    if flags & !(F_NEEDS_CSUM | F_DATA_VALID) != 0 {
        return Err(BadFrame("unknown virtio-net header flags"));
    }
    if flags & F_NEEDS_CSUM != 0 && le16(h, 6) + le16(h, 8) + 2 > pkt {
        return Err(BadFrame("checksum field outside the packet"));
    }
    match gso & !GSO_ECN {
        0 if gso & GSO_ECN != 0 => Err(BadFrame("ECN bit without segmentation")),
        0 => Ok(()),
        1 | 3 | 4 | 5 if le16(h, 4) == 0 => Err(BadFrame("segmentation with a zero segment size")),
        1 | 3 | 4 | 5 if le16(h, 2) > pkt => Err(BadFrame("header length beyond the packet")),
        1 | 3 | 4 | 5 if flags & F_NEEDS_CSUM == 0 => {
            Err(BadFrame("segmentation without a partial checksum"))
        }
        1 | 3 | 4 | 5 => Ok(()),
        _ => Err(BadFrame("unknown segmentation type")),
    }
}

fn check_ip(ip: &[u8], pkt: u64) -> Result<(), BadFrame> {
    match ip[0] >> 4 {
        4 => {
            let ihl = (ip[0] & 0x0f) as u64 * 4;
            let total = u16::from_be_bytes([ip[2], ip[3]]) as u64;
            if ihl < 20 || total < ihl || total > pkt {
                return Err(BadFrame(
                    "IPv4 header or length inconsistent with the frame",
                ));
            }
            Ok(())
        }
        6 if pkt < 40 => Err(BadFrame("shorter than an IPv6 header")),
        6 => {
            let payload = u16::from_be_bytes([ip[4], ip[5]]) as u64;
            if 40 + payload > pkt {
                return Err(BadFrame("IPv6 payload length beyond the frame"));
            }
            Ok(())
        }
        _ => Err(BadFrame("neither IPv4 nor IPv6")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A frame: header fields as given, then an IPv4 header of `total` bytes.
    fn v4(flags: u8, gso: u8, gso_size: u16, csum: (u16, u16), total: u16) -> Vec<u8> {
        let mut f = vec![0u8; VNET_HDR_LEN + total as usize];
        f[0] = flags;
        f[1] = gso;
        f[2..4].copy_from_slice(&40u16.to_le_bytes());
        f[4..6].copy_from_slice(&gso_size.to_le_bytes());
        f[6..8].copy_from_slice(&csum.0.to_le_bytes());
        f[8..10].copy_from_slice(&csum.1.to_le_bytes());
        f[12] = 0x45;
        f[14..16].copy_from_slice(&total.to_be_bytes());
        f
    }

    fn check(f: &[u8]) -> Result<(), BadFrame> {
        check_frame(&f[..f.len().min(FRAME_HEAD)], f.len() as u64)
    }

    #[test]
    fn well_formed_frames_pass() {
        check(&v4(0, 0, 0, (0, 0), 84)).unwrap();
        check(&v4(1, 1, 1448, (20, 16), 65535)).unwrap();
        check(&v4(1, 0x81, 1448, (20, 16), 3000)).unwrap();
        let mut v6 = vec![0u8; VNET_HDR_LEN + 40 + 8];
        v6[12] = 0x60;
        v6[16..18].copy_from_slice(&8u16.to_be_bytes());
        check(&v6).unwrap();
        let mut big6 = vec![0u8; VNET_HDR_LEN + 40 + 65535];
        big6[12] = 0x60;
        big6[16..18].copy_from_slice(&65535u16.to_be_bytes());
        assert!(big6.len() <= MAX_FRAME);
        check(&big6).unwrap();
    }

    #[test]
    fn malformed_frames_are_refused_with_a_reason() {
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (vec![0u8; 20], "shorter"),
            (v4(8, 0, 0, (0, 0), 84), "flags"),
            (v4(1, 0, 0, (80, 4), 84), "checksum field"),
            (v4(1, 1, 0, (20, 16), 84), "zero segment size"),
            (v4(0, 1, 1448, (0, 0), 84), "without a partial checksum"),
            (v4(1, 2, 1448, (20, 16), 84), "unknown segmentation"),
            (v4(0, 0x80, 0, (0, 0), 84), "ECN"),
            (
                {
                    let mut f = v4(0, 0, 0, (0, 0), 84);
                    f[14..16].copy_from_slice(&900u16.to_be_bytes());
                    f
                },
                "IPv4",
            ),
            (
                {
                    let mut f = v4(0, 0, 0, (0, 0), 84);
                    f[12] = 0x41;
                    f
                },
                "IPv4",
            ),
            (
                {
                    let mut f = v4(0, 0, 0, (0, 0), 84);
                    f[12] = 0x15;
                    f
                },
                "neither",
            ),
        ];
        for (f, want) in cases {
            let e = check(&f).expect_err(want);
            assert!(e.0.contains(want), "{want}: got {e}");
        }
        assert!(check_frame(&[0u8; 8], 100).is_err(), "too little looked at");
        assert!(check_frame(&[0u8; FRAME_HEAD], MAX_FRAME as u64 + 1).is_err());
    }
}
