//! A Linux TUN device: the kernel's end of a point-to-point IP link whose frames memloop carries
//! through shared memory.
//!
//! [`TunDevice::create`] opens `/dev/net/tun` and attaches a new, non-persistent layer-3 device
//! (`IFF_TUN | IFF_NO_PI`): every `read` returns one IP packet, every `write` injects one. With
//! [`TunConfig::vnet_hdr`] each packet is preceded by a [`VNET_HDR_LEN`]-byte virtio-net header
//! (`struct virtio_net_hdr_v1`), which is what lets the kernel hand over unchecksummed and
//! segmentation-offloaded (GSO) super-packets when offloads ([`TUN_F_CSUM`], [`TUN_F_TSO4`], …)
//! were accepted. Closing the device (dropping the [`TunDevice`]) deletes the interface.
//!
//! The interface is configured with the classic `ioctl`s on a throw-away socket (MTU, IPv4 and
//! IPv6 addresses, `IFF_UP`), so nothing here needs netlink or the `ip` tool.

use std::ffi::CStr;
use std::io;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// Offload: the peer may hand over packets whose checksum is still to be completed (and takes
/// such packets), flagged `VIRTIO_NET_HDR_F_NEEDS_CSUM` in the virtio-net header.
pub const TUN_F_CSUM: u32 = 0x01;
/// Offload: TCP segmentation offload for IPv4 (needs [`TUN_F_CSUM`]).
pub const TUN_F_TSO4: u32 = 0x02;
/// Offload: TCP segmentation offload for IPv6 (needs [`TUN_F_CSUM`]).
pub const TUN_F_TSO6: u32 = 0x04;
/// Offload: TSO with the ECN bit (needs [`TUN_F_TSO4`] or [`TUN_F_TSO6`]).
pub const TUN_F_TSO_ECN: u32 = 0x08;
/// Offload: UDP fragmentation offload (long removed from most kernels: usually refused).
pub const TUN_F_UFO: u32 = 0x10;
/// Offload: UDP segmentation offload for IPv4 (Linux 6.2 and later).
pub const TUN_F_USO4: u32 = 0x20;
/// Offload: UDP segmentation offload for IPv6 (Linux 6.2 and later).
pub const TUN_F_USO6: u32 = 0x40;

/// Every offload bit this module knows.
const TUN_F_ALL: u32 =
    TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_TSO_ECN | TUN_F_UFO | TUN_F_USO4 | TUN_F_USO6;

/// The bits given up, one group after another, while the kernel refuses a set of offloads:
/// the newest (and least widely supported) first, the checksum offload everything needs last.
const OFFLOAD_FALLBACKS: [u32; 5] = [
    TUN_F_USO4 | TUN_F_USO6,
    TUN_F_UFO,
    TUN_F_TSO_ECN,
    TUN_F_TSO4 | TUN_F_TSO6,
    TUN_F_CSUM,
];

/// Size of the virtio-net header carried before every frame (struct virtio_net_hdr_v1 /
/// mrg_rxbuf: 12 bytes).
pub const VNET_HDR_LEN: usize = 12;

/// The path of the TUN/TAP clone device.
const CLONE_DEVICE: &CStr = c"/dev/net/tun";

/// What [`TunDevice::create`] makes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TunConfig {
    /// The interface name: empty to let the kernel pick `tunN`, or a pattern with `%d`
    /// (`"ml%d"`), or a fixed name. At most 15 bytes.
    pub name: String,
    /// Whether every frame carries a [`VNET_HDR_LEN`]-byte virtio-net header (`IFF_VNET_HDR`).
    /// Offloads need it: without it, no offload is asked for.
    pub vnet_hdr: bool,
    /// The `TUN_F_*` offloads wanted (other bits are ignored); [`TunDevice::offloads`] tells
    /// which the kernel accepted.
    pub offloads: u32,
}

/// An open TUN device (layer 3, no packet-information prefix). Non-persistent: dropping it
/// closes the file descriptor, and the kernel deletes the interface.
#[derive(Debug)]
pub struct TunDevice {
    fd: OwnedFd,
    name: String,
    offloads: u32,
    vnet_hdr: bool,
}

impl TunDevice {
    /// Opens `/dev/net/tun` (`O_RDWR | O_CLOEXEC`) and attaches a new device with `TUNSETIFF`
    /// (`IFF_TUN | IFF_NO_PI`, and `IFF_VNET_HDR` if `cfg.vnet_hdr`). With a virtio-net header,
    /// its size is set to [`VNET_HDR_LEN`] (`TUNSETVNETHDRSZ`) and the wanted offloads are
    /// negotiated with `TUNSETOFFLOAD`: while the kernel refuses a set (`EINVAL`), UDP
    /// segmentation (USO4/USO6), then UFO, then TSO_ECN, then TSO4/TSO6 and finally CSUM are
    /// given up. Without the header no offload is enabled (the frames could not say which
    /// packets need a checksum or segmentation).
    ///
    /// Needs `CAP_NET_ADMIN` in the current network namespace.
    pub fn create(cfg: &TunConfig) -> io::Result<TunDevice> {
        let mut ifr = ifreq_named(&cfg.name)?;
        // SAFETY: `CLONE_DEVICE` is a NUL-terminated path; `open` has no other preconditions.
        let raw = unsafe { libc::open(CLONE_DEVICE.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if raw < 0 {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(e.kind(), format!("open /dev/net/tun: {e}")));
        }
        // SAFETY: `open` succeeded, so `raw` is a descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };

        let mut flags = libc::IFF_TUN | libc::IFF_NO_PI;
        if cfg.vnet_hdr {
            flags |= libc::IFF_VNET_HDR;
        }
        ifr.ifr_ifru.ifru_flags = flags as libc::c_short;
        let wanted_name = if cfg.name.is_empty() {
            "tun%d"
        } else {
            &cfg.name
        };
        // SAFETY: TUNSETIFF reads and writes one `struct ifreq`, which `ifr` is, alive and
        // exclusively borrowed for the call.
        cvt(unsafe {
            libc::ioctl(
                fd.as_raw_fd(),
                libc::TUNSETIFF,
                &mut ifr as *mut libc::ifreq,
            )
        })
        .map_err(|e| context(e, "TUNSETIFF", wanted_name))?;
        let name = ifreq_name(&ifr);

        let mut offloads = 0;
        if cfg.vnet_hdr {
            let size: libc::c_int = VNET_HDR_LEN as libc::c_int;
            // SAFETY: TUNSETVNETHDRSZ reads one `int` through the pointer, which points to
            // `size`, alive for the call.
            cvt(unsafe {
                libc::ioctl(
                    fd.as_raw_fd(),
                    libc::TUNSETVNETHDRSZ,
                    &size as *const libc::c_int,
                )
            })
            .map_err(|e| context(e, "TUNSETVNETHDRSZ", &name))?;
            offloads = negotiate_offloads(fd.as_fd(), cfg.offloads & TUN_F_ALL)
                .map_err(|e| context(e, "TUNSETOFFLOAD", &name))?;
        } else {
            // Make sure no offload is on (a fresh device has none; this only says it plainly).
            set_offload(fd.as_fd(), 0).map_err(|e| context(e, "TUNSETOFFLOAD", &name))?;
        }
        Ok(TunDevice {
            fd,
            name,
            offloads,
            vnet_hdr: cfg.vnet_hdr,
        })
    }

    /// The interface name the kernel gave the device (e.g. `tun0`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The `TUN_F_*` offloads the kernel accepted (0 without a virtio-net header).
    pub fn offloads(&self) -> u32 {
        self.offloads
    }

    /// Whether every frame carries a [`VNET_HDR_LEN`]-byte virtio-net header.
    pub fn vnet_hdr(&self) -> bool {
        self.vnet_hdr
    }

    /// The device's file descriptor: one frame per `read`/`write`, pollable.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Sets or clears `O_NONBLOCK` on the descriptor (a `read` with no frame queued then fails
    /// with `WouldBlock`).
    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        let fd = self.fd.as_raw_fd();
        // SAFETY: F_GETFL takes no argument; `fd` is open while `self` lives.
        let flags = cvt(unsafe { libc::fcntl(fd, libc::F_GETFL) })
            .map_err(|e| context(e, "F_GETFL", &self.name))?;
        let new = if on {
            flags | libc::O_NONBLOCK
        } else {
            flags & !libc::O_NONBLOCK
        };
        if new != flags {
            // SAFETY: F_SETFL takes an `int` by value; `fd` is open while `self` lives.
            cvt(unsafe { libc::fcntl(fd, libc::F_SETFL, new) })
                .map_err(|e| context(e, "F_SETFL", &self.name))?;
        }
        Ok(())
    }

    /// Raises or drops the link's carrier (`TUNSETCARRIER`): without it the kernel sees the
    /// link as down (operstate `down`) and sends nothing, even though the interface is up.
    pub fn set_carrier(&self, up: bool) -> io::Result<()> {
        let on: libc::c_int = up.into();
        // SAFETY: TUNSETCARRIER reads one `int` through the pointer, which points to `on`,
        // alive for the call; the descriptor is open while `self` lives.
        cvt(unsafe {
            libc::ioctl(
                self.fd.as_raw_fd(),
                libc::TUNSETCARRIER,
                &on as *const libc::c_int,
            )
        })
        .map_err(|e| context(e, "TUNSETCARRIER", &self.name))?;
        Ok(())
    }

    /// Sets the interface's MTU (`SIOCSIFMTU`).
    pub fn set_mtu(&self, mtu: u32) -> io::Result<()> {
        let mtu = libc::c_int::try_from(mtu).map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("MTU {mtu} of {} is too large", self.name),
            )
        })?;
        let sock = control_socket(libc::AF_INET)?;
        let mut ifr = ifreq_named(&self.name)?;
        ifr.ifr_ifru.ifru_mtu = mtu;
        // SAFETY: SIOCSIFMTU reads one `struct ifreq`, which `ifr` is; `sock` is open.
        cvt(unsafe {
            libc::ioctl(
                sock.as_raw_fd(),
                libc::SIOCSIFMTU as _,
                &mut ifr as *mut libc::ifreq,
            )
        })
        .map_err(|e| context(e, "SIOCSIFMTU", &self.name))?;
        Ok(())
    }

    /// Gives the interface the IPv4 address `addr/prefix` (`SIOCSIFADDR`, then
    /// `SIOCSIFNETMASK`): on a point-to-point link such as `10.99.0.1/30`, the kernel adds the
    /// route to the subnet when the interface is up. Replaces the interface's first IPv4
    /// address, if it had one.
    pub fn set_ipv4(&self, addr: Ipv4Addr, prefix: u8) -> io::Result<()> {
        if prefix > 32 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("IPv4 prefix /{prefix} for {} is longer than 32", self.name),
            ));
        }
        let mask = netmask_v4(prefix);
        let sock = control_socket(libc::AF_INET)?;
        let mut ifr = ifreq_named(&self.name)?;
        ifr.ifr_ifru.ifru_addr = sockaddr_v4(addr);
        // SAFETY: SIOCSIFADDR reads one `struct ifreq`, which `ifr` is; `sock` is open.
        cvt(unsafe {
            libc::ioctl(
                sock.as_raw_fd(),
                libc::SIOCSIFADDR as _,
                &mut ifr as *mut libc::ifreq,
            )
        })
        .map_err(|e| context(e, "SIOCSIFADDR", &self.name))?;
        ifr.ifr_ifru.ifru_netmask = sockaddr_v4(mask);
        // SAFETY: SIOCSIFNETMASK reads one `struct ifreq`, which `ifr` is; `sock` is open.
        cvt(unsafe {
            libc::ioctl(
                sock.as_raw_fd(),
                libc::SIOCSIFNETMASK as _,
                &mut ifr as *mut libc::ifreq,
            )
        })
        .map_err(|e| context(e, "SIOCSIFNETMASK", &self.name))?;
        Ok(())
    }

    /// Adds the IPv6 address `addr/prefix` to the interface (`SIOCSIFADDR` on an `AF_INET6`
    /// socket with a `struct in6_ifreq`, which names the interface by index: `SIOCGIFINDEX`).
    pub fn add_ipv6(&self, addr: Ipv6Addr, prefix: u8) -> io::Result<()> {
        if prefix > 128 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("IPv6 prefix /{prefix} for {} is longer than 128", self.name),
            ));
        }
        let sock = control_socket(libc::AF_INET6)?;
        let mut ifr = ifreq_named(&self.name)?;
        // SAFETY: SIOCGIFINDEX reads the name from and writes the index into one
        // `struct ifreq`, which `ifr` is; `sock` is open.
        cvt(unsafe {
            libc::ioctl(
                sock.as_raw_fd(),
                libc::SIOCGIFINDEX as _,
                &mut ifr as *mut libc::ifreq,
            )
        })
        .map_err(|e| context(e, "SIOCGIFINDEX", &self.name))?;
        // SAFETY: SIOCGIFINDEX succeeded, so the kernel wrote `ifru_ifindex`, an `int` (and any
        // bit pattern is one).
        let ifindex = unsafe { ifr.ifr_ifru.ifru_ifindex };
        let mut req = libc::in6_ifreq {
            ifr6_addr: libc::in6_addr {
                s6_addr: addr.octets(),
            },
            ifr6_prefixlen: u32::from(prefix),
            ifr6_ifindex: ifindex,
        };
        // SAFETY: SIOCSIFADDR on an AF_INET6 socket reads one `struct in6_ifreq`, which `req`
        // is; `sock` is open.
        cvt(unsafe {
            libc::ioctl(
                sock.as_raw_fd(),
                libc::SIOCSIFADDR as _,
                &mut req as *mut libc::in6_ifreq,
            )
        })
        .map_err(|e| context(e, "SIOCSIFADDR (IPv6)", &self.name))?;
        Ok(())
    }

    /// Sets or clears `IFF_UP` (`SIOCGIFFLAGS`, then `SIOCSIFFLAGS`), leaving the other flags.
    pub fn set_up(&self, up: bool) -> io::Result<()> {
        let sock = control_socket(libc::AF_INET)?;
        let mut ifr = ifreq_named(&self.name)?;
        // SAFETY: SIOCGIFFLAGS reads the name from and writes the flags into one
        // `struct ifreq`, which `ifr` is; `sock` is open.
        cvt(unsafe {
            libc::ioctl(
                sock.as_raw_fd(),
                libc::SIOCGIFFLAGS as _,
                &mut ifr as *mut libc::ifreq,
            )
        })
        .map_err(|e| context(e, "SIOCGIFFLAGS", &self.name))?;
        // SAFETY: SIOCGIFFLAGS succeeded, so the kernel wrote `ifru_flags`, a `short` (any
        // bit pattern is one).
        let flags = unsafe { ifr.ifr_ifru.ifru_flags };
        let up_bit = libc::IFF_UP as libc::c_short;
        ifr.ifr_ifru.ifru_flags = if up { flags | up_bit } else { flags & !up_bit };
        // SAFETY: SIOCSIFFLAGS reads one `struct ifreq`, which `ifr` is; `sock` is open.
        cvt(unsafe {
            libc::ioctl(
                sock.as_raw_fd(),
                libc::SIOCSIFFLAGS as _,
                &mut ifr as *mut libc::ifreq,
            )
        })
        .map_err(|e| context(e, "SIOCSIFFLAGS", &self.name))?;
        Ok(())
    }

    /// Reads one frame (with its virtio-net header, if any) with `read(2)`; a buffer shorter
    /// than the frame gets its start, the rest is lost. `EINTR` is retried.
    pub fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            // SAFETY: `buf` is valid for writes of `buf.len()` bytes for the call; the
            // descriptor is open while `self` lives.
            let n = unsafe {
                libc::read(
                    self.fd.as_raw_fd(),
                    buf.as_mut_ptr().cast::<libc::c_void>(),
                    buf.len(),
                )
            };
            match retry_eintr(n) {
                Some(r) => return r,
                None => continue,
            }
        }
    }

    /// Writes one frame (with its virtio-net header, if any) with `write(2)`. `EINTR` is
    /// retried.
    pub fn write(&self, buf: &[u8]) -> io::Result<usize> {
        loop {
            // SAFETY: `buf` is valid for reads of `buf.len()` bytes for the call; the
            // descriptor is open while `self` lives.
            let n = unsafe {
                libc::write(
                    self.fd.as_raw_fd(),
                    buf.as_ptr().cast::<libc::c_void>(),
                    buf.len(),
                )
            };
            match retry_eintr(n) {
                Some(r) => return r,
                None => continue,
            }
        }
    }
}

impl AsFd for TunDevice {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Names of the bits set, e.g. `["csum", "tso4", "tso6"]` — for status output. Unknown bits
/// are left out.
pub fn offload_names(bits: u32) -> Vec<&'static str> {
    const NAMES: [(u32, &str); 7] = [
        (TUN_F_CSUM, "csum"),
        (TUN_F_TSO4, "tso4"),
        (TUN_F_TSO6, "tso6"),
        (TUN_F_TSO_ECN, "tso_ecn"),
        (TUN_F_UFO, "ufo"),
        (TUN_F_USO4, "uso4"),
        (TUN_F_USO6, "uso6"),
    ];
    NAMES
        .iter()
        .filter(|(bit, _)| bits & bit != 0)
        .map(|&(_, name)| name)
        .collect()
}

/// The offload sets tried, in order, for `wanted`: `wanted` itself, then with each group of
/// [`OFFLOAD_FALLBACKS`] removed in turn, skipping sets already tried; the last is 0.
fn offload_attempts(wanted: u32) -> Vec<u32> {
    let mut attempts = vec![wanted];
    let mut set = wanted;
    for drop in OFFLOAD_FALLBACKS {
        set &= !drop;
        if attempts.last() != Some(&set) {
            attempts.push(set);
        }
    }
    attempts
}

/// Tries the sets of [`offload_attempts`] until the kernel accepts one (any error other than
/// `EINVAL` ends the search); the set accepted.
fn negotiate_offloads(fd: BorrowedFd<'_>, wanted: u32) -> io::Result<u32> {
    let mut last = None;
    for set in offload_attempts(wanted) {
        match set_offload(fd, set) {
            Ok(()) => return Ok(set),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| io::Error::from_raw_os_error(libc::EINVAL)))
}

/// `TUNSETOFFLOAD` with `bits` (passed by value, as the kernel expects).
fn set_offload(fd: BorrowedFd<'_>, bits: u32) -> io::Result<()> {
    // SAFETY: TUNSETOFFLOAD takes an `unsigned long` by value and dereferences nothing; `fd`
    // is an open descriptor (borrowed for the call).
    cvt(unsafe {
        libc::ioctl(
            fd.as_raw_fd(),
            libc::TUNSETOFFLOAD,
            libc::c_ulong::from(bits),
        )
    })
    .map(drop)
}

/// A zeroed `struct ifreq` carrying `name` (empty stays empty). Fails for names that do not
/// fit `IFNAMSIZ` with its NUL, or contain a NUL.
fn ifreq_named(name: &str) -> io::Result<libc::ifreq> {
    if name.len() >= libc::IFNAMSIZ || name.as_bytes().contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "interface name {name:?} must be shorter than {} bytes, without NUL",
                libc::IFNAMSIZ
            ),
        ));
    }
    // SAFETY: `ifreq` is a C struct of a `c_char` array and a union of plain integers, socket
    // addresses and a raw pointer: all zeroes is a valid value of each (a null pointer).
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, &src) in ifr.ifr_name.iter_mut().zip(name.as_bytes()) {
        *dst = src as libc::c_char;
    }
    Ok(ifr)
}

/// The NUL-terminated name in `ifr` (lossy: the kernel only makes valid names anyway).
fn ifreq_name(ifr: &libc::ifreq) -> String {
    let bytes: Vec<u8> = ifr
        .ifr_name
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The IPv4 netmask of a prefix length (at most 32).
fn netmask_v4(prefix: u8) -> Ipv4Addr {
    Ipv4Addr::from(u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0))
}

/// A `struct sockaddr` holding the `sockaddr_in` for `addr` (port 0).
fn sockaddr_v4(addr: Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(addr).to_be(),
        },
        sin_zero: [0; 8],
    };
    const _: () =
        assert!(std::mem::size_of::<libc::sockaddr_in>() == std::mem::size_of::<libc::sockaddr>());
    // SAFETY: both are 16-byte plain-data C structs (checked above) and every bit pattern is
    // a valid `sockaddr`; this is how the C API means a `sockaddr_in` to be passed.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

/// A datagram socket of `family` to issue interface `ioctl`s on.
fn control_socket(family: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: `socket` has no memory preconditions.
    let raw = unsafe { libc::socket(family, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if raw < 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(
            e.kind(),
            format!("socket for interface ioctls: {e}"),
        ));
    }
    // SAFETY: `socket` succeeded, so `raw` is a descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// A -1 return as the thread's `errno`.
fn cvt(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// The result of a `read`/`write` returning `n`, or `None` to retry (`EINTR`).
fn retry_eintr(n: isize) -> Option<io::Result<usize>> {
    if n >= 0 {
        return Some(Ok(n as usize));
    }
    let e = io::Error::last_os_error();
    if e.kind() == io::ErrorKind::Interrupted {
        None
    } else {
        Some(Err(e))
    }
}

/// `e` with the `ioctl` (or call) that failed and the interface it was for.
fn context(e: io::Error, what: &str, name: &str) -> io::Error {
    io::Error::new(e.kind(), format!("{what} on {name}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offload_names_lists_the_bits_in_order() {
        assert_eq!(offload_names(0), Vec::<&str>::new());
        assert_eq!(
            offload_names(TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6),
            ["csum", "tso4", "tso6"]
        );
        assert_eq!(
            offload_names(TUN_F_ALL | 0x8000_0000),
            ["csum", "tso4", "tso6", "tso_ecn", "ufo", "uso4", "uso6"]
        );
        assert_eq!(offload_names(TUN_F_USO6 | TUN_F_UFO), ["ufo", "uso6"]);
    }

    #[test]
    fn offloads_are_given_up_newest_first_down_to_none() {
        assert_eq!(
            offload_attempts(TUN_F_ALL),
            [
                TUN_F_ALL,
                TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_TSO_ECN | TUN_F_UFO,
                TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_TSO_ECN,
                TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6,
                TUN_F_CSUM,
                0,
            ]
        );
        // Groups not wanted are not tried twice.
        assert_eq!(
            offload_attempts(TUN_F_CSUM | TUN_F_TSO4),
            [TUN_F_CSUM | TUN_F_TSO4, TUN_F_CSUM, 0]
        );
        assert_eq!(offload_attempts(0), [0]);
    }

    #[test]
    fn names_that_do_not_fit_are_refused() {
        assert_eq!(
            ifreq_named("a-name-of-16-byt").unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
        assert_eq!(
            ifreq_named("a\0b").unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
        let ifr = ifreq_named("ml%d").unwrap();
        assert_eq!(ifreq_name(&ifr), "ml%d");
        assert_eq!(ifreq_name(&ifreq_named("").unwrap()), "");
        let cfg = TunConfig {
            name: "x".repeat(16),
            ..TunConfig::default()
        };
        assert_eq!(
            TunDevice::create(&cfg).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
    }

    #[test]
    fn netmasks_are_built_from_prefixes() {
        assert_eq!(netmask_v4(0), Ipv4Addr::new(0, 0, 0, 0));
        assert_eq!(netmask_v4(1), Ipv4Addr::new(128, 0, 0, 0));
        assert_eq!(netmask_v4(30), Ipv4Addr::new(255, 255, 255, 252));
        assert_eq!(netmask_v4(32), Ipv4Addr::new(255, 255, 255, 255));
    }

    #[test]
    fn sockaddr_v4_holds_the_address_in_network_order() {
        let s = sockaddr_v4(Ipv4Addr::new(10, 99, 0, 1));
        assert_eq!(s.sa_family, libc::AF_INET as libc::sa_family_t);
        // sa_data: the port (2 bytes), then the address in network order.
        assert_eq!(
            &s.sa_data[2..6],
            &[10, 99, 0, 1].map(|b: u8| b as libc::c_char)
        );
    }
}
