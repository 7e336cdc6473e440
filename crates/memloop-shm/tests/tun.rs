//! `memloop_shm::tun` against the real kernel: each test body runs in a fresh network namespace
//! (this test binary re-executed under `unshare --net --mount`, with its own sysfs so that
//! `/sys/class/net` shows the namespace's devices), so the host's interfaces are never touched.
//!
//! Needs root, `/dev/net/tun` and `unshare`. Without them the runner (memloop-testkit) reports
//! a test ignored with the reason — or, when `CI` is set, fails it.

#[cfg(loom)]
fn main() {}

#[cfg(not(loom))]
fn main() -> std::process::ExitCode {
    netns::main()
}

#[cfg(not(loom))]
mod netns {
    use memloop_shm::tun::{
        offload_names, TunConfig, TunDevice, TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6, TUN_F_TSO_ECN,
        TUN_F_UFO, TUN_F_USO4, TUN_F_USO6, VNET_HDR_LEN,
    };
    use std::io::ErrorKind;
    use std::net::{Ipv4Addr, UdpSocket};
    use std::process::Command;
    use std::time::{Duration, Instant};

    /// Set (to the test's name) in the re-executed child that runs the test body.
    const CHILD: &str = "MEMLOOP_TUN_TEST_IN_NETNS";

    const ALL_OFFLOADS: u32 =
        TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_TSO_ECN | TUN_F_UFO | TUN_F_USO4 | TUN_F_USO6;

    const LOCAL: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 1);
    const PEER: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 2);

    /// `VIRTIO_NET_HDR_F_NEEDS_CSUM`.
    const NEEDS_CSUM: u8 = 1;

    /// Why the tests cannot run here, if they cannot.
    fn unmet_need() -> Option<String> {
        if !rustix::process::geteuid().is_root() {
            return Some("needs root (network namespaces, TUN devices)".into());
        }
        if !std::path::Path::new("/dev/net/tun").exists() {
            return Some("needs /dev/net/tun (the tun module)".into());
        }
        let unshare = Command::new("unshare")
            .args(["--net", "--mount", "true"])
            .output();
        match unshare {
            Ok(out) if out.status.success() => None,
            Ok(out) => Some(format!(
                "needs network namespaces: `unshare --net --mount true` failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )),
            Err(e) => Some(format!("needs `unshare` (util-linux): {e}")),
        }
    }

    /// The tests, by name: each body runs in a fresh network namespace.
    const TESTS: [(&str, fn()); 2] = [
        ("tun_link_in_a_fresh_netns", link),
        ("tun_without_vnet_hdr_in_a_fresh_netns", plain),
    ];

    /// Runs test `name`'s body in a fresh network (and mount) namespace: this binary re-executed
    /// under `unshare` with [`CHILD`] naming the test; its output is shown.
    fn in_fresh_netns(name: &str) {
        let exe = std::env::current_exe().expect("path of the test binary");
        let out = Command::new("unshare")
            .args(["--net", "--mount", "--propagation", "private", "sh", "-c"])
            // A sysfs of the new namespace, or /sys/class/net would show the host's devices.
            .arg(r#"mount -t sysfs sysfs /sys && exec "$0""#)
            .arg(&exe)
            .env(CHILD, name)
            .output()
            .expect("run the test binary under unshare");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        println!("--- {name} in a fresh network namespace ---\n{stdout}{stderr}");
        assert!(
        out.status.success(),
        "{name} in a fresh network namespace: {}\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}",
        out.status
    );
    }

    /// `/sys/class/net/<dev>/<attr>`, trimmed.
    fn sys_attr(dev: &str, attr: &str) -> std::io::Result<String> {
        std::fs::read_to_string(format!("/sys/class/net/{dev}/{attr}"))
            .map(|s| s.trim().to_string())
    }

    /// The next IPv4 frame the device gives (other frames, e.g. IPv6 router solicitations, are
    /// skipped), with its virtio-net header if the device has one; within 5 seconds.
    fn next_ipv4_frame(dev: &TunDevice) -> Vec<u8> {
        let hdr = if dev.vnet_hdr() { VNET_HDR_LEN } else { 0 };
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut buf = vec![0u8; 65536 + VNET_HDR_LEN];
        loop {
            match dev.read(&mut buf) {
                Ok(n) if n > hdr && buf[hdr] >> 4 == 4 => return buf[..n].to_vec(),
                Ok(n) => println!(
                    "skipping a frame of {n} bytes (IP version {})",
                    buf.get(hdr).map_or(0, |b| b >> 4)
                ),
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    assert!(Instant::now() < deadline, "no IPv4 frame within 5 s");
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => panic!("read from {}: {e}", dev.name()),
            }
        }
    }

    /// The Internet checksum of `bytes`.
    fn inet_checksum(bytes: &[u8]) -> u16 {
        let mut sum: u32 = bytes
            .chunks(2)
            .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
            .sum();
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        !(sum as u16)
    }

    /// An IPv4/UDP packet (UDP checksum 0: none) with a correct IPv4 header checksum.
    fn udp_packet(src: (Ipv4Addr, u16), dst: (Ipv4Addr, u16), payload: &[u8]) -> Vec<u8> {
        let udp_len = 8 + payload.len();
        let total = 20 + udp_len;
        let mut p = Vec::with_capacity(total);
        p.extend_from_slice(&[0x45, 0]);
        p.extend_from_slice(&(total as u16).to_be_bytes());
        p.extend_from_slice(&[0x12, 0x34, 0x40, 0]); // id, DF
        p.extend_from_slice(&[64, 17, 0, 0]); // TTL, UDP, checksum (below)
        p.extend_from_slice(&src.0.octets());
        p.extend_from_slice(&dst.0.octets());
        let csum = inet_checksum(&p[..20]);
        p[10..12].copy_from_slice(&csum.to_be_bytes());
        p.extend_from_slice(&src.1.to_be_bytes());
        p.extend_from_slice(&dst.1.to_be_bytes());
        p.extend_from_slice(&(udp_len as u16).to_be_bytes());
        p.extend_from_slice(&[0, 0]);
        p.extend_from_slice(payload);
        p
    }

    /// The device with a virtio-net header and every offload wanted: configured as one end of a
    /// /30 link, it hands out what the stack sends to the peer and delivers what is written to it.
    fn link() {
        let dev = TunDevice::create(&TunConfig {
            name: "mltest%d".into(),
            vnet_hdr: true,
            offloads: ALL_OFFLOADS,
        })
        .expect("create the TUN device");
        println!(
            "device {}: offloads accepted {:#04x} {:?}",
            dev.name(),
            dev.offloads(),
            offload_names(dev.offloads())
        );
        assert!(dev.name().starts_with("mltest"), "{}", dev.name());
        assert!(dev.vnet_hdr());
        let needed = TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6;
        assert_eq!(
            dev.offloads() & needed,
            needed,
            "{:?}",
            offload_names(dev.offloads())
        );
        assert_eq!(dev.offloads() & !ALL_OFFLOADS, 0);

        dev.set_mtu(65535).expect("set the MTU");
        dev.set_ipv4(LOCAL, 30).expect("set the IPv4 address");
        dev.set_up(true).expect("set the device up");
        dev.set_carrier(true).expect("carrier on");
        dev.add_ipv6("fd99::1".parse().unwrap(), 64)
            .expect("add an IPv6 address");
        dev.set_nonblocking(true).unwrap();
        assert_eq!(sys_attr(dev.name(), "mtu").unwrap(), "65535");
        assert_eq!(sys_attr(dev.name(), "carrier").unwrap(), "1");
        let flags = u32::from_str_radix(
            sys_attr(dev.name(), "flags")
                .unwrap()
                .trim_start_matches("0x"),
            16,
        )
        .unwrap();
        assert_ne!(flags & libc::IFF_UP as u32, 0, "flags {flags:#x}");
        let if_inet6 = std::fs::read_to_string("/proc/net/if_inet6").unwrap();
        assert!(
            if_inet6
                .lines()
                .any(|l| l.starts_with("fd990000000000000000000000000001")
                    && l.ends_with(dev.name())
                    && l.contains(" 40 ")),
            "fd99::1/64 not on {}:\n{if_inet6}",
            dev.name()
        );

        // The stack to the peer: the frame comes out of the device.
        let tx = UdpSocket::bind((LOCAL, 0)).unwrap();
        let payload = b"hello through the tun device";
        tx.send_to(payload, (PEER, 9)).unwrap();
        let frame = next_ipv4_frame(&dev);
        let (vnet, ip) = frame.split_at(VNET_HDR_LEN);
        println!(
            "frame: virtio-net header {vnet:02x?}, {} bytes of IP",
            ip.len()
        );
        let ihl = usize::from(ip[0] & 0x0f) * 4;
        assert!(
            ip.len() >= ihl + 8 + payload.len(),
            "short frame: {frame:02x?}"
        );
        assert_eq!(ip[9], 17, "not UDP");
        assert_eq!(
            Ipv4Addr::from(<[u8; 4]>::try_from(&ip[12..16]).unwrap()),
            LOCAL
        );
        assert_eq!(
            Ipv4Addr::from(<[u8; 4]>::try_from(&ip[16..20]).unwrap()),
            PEER
        );
        assert_eq!(&ip[ihl + 2..ihl + 4], &9u16.to_be_bytes());
        assert_eq!(&ip[ihl + 8..ihl + 8 + payload.len()], payload);
        assert_eq!(vnet[1], 0, "gso_type of a small datagram is NONE");
        if vnet[0] & NEEDS_CSUM != 0 {
            // Checksum left to the reader: it starts at the UDP header, the field at offset 6.
            assert_eq!(u16::from_le_bytes([vnet[6], vnet[7]]), ihl as u16);
            assert_eq!(u16::from_le_bytes([vnet[8], vnet[9]]), 6);
        }

        // The peer to the stack: a frame written to the device is delivered.
        let rx = UdpSocket::bind((LOCAL, 5555)).unwrap();
        rx.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let reply = b"hello back from the peer";
        let mut frame = vec![0u8; VNET_HDR_LEN];
        frame.extend(udp_packet((PEER, 7777), (LOCAL, 5555), reply));
        assert_eq!(dev.write(&frame).expect("write a frame"), frame.len());
        let mut got = [0u8; 128];
        let (n, from) = rx
            .recv_from(&mut got)
            .expect("the written frame is delivered");
        assert_eq!(&got[..n], reply);
        assert_eq!(from, (PEER, 7777).into());

        // Carrier off: the link is down though the interface is up.
        dev.set_carrier(false).expect("carrier off");
        let deadline = Instant::now() + Duration::from_secs(3);
        loop {
            let carrier = sys_attr(dev.name(), "carrier").unwrap_or_default();
            let operstate = sys_attr(dev.name(), "operstate").unwrap_or_default();
            if carrier == "0" || operstate == "down" {
                println!("carrier off: carrier {carrier:?}, operstate {operstate:?}");
                break;
            }
            assert!(
                Instant::now() < deadline,
                "carrier still on: carrier {carrier:?}, operstate {operstate:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        dev.set_carrier(true).expect("carrier on again");
        assert_eq!(sys_attr(dev.name(), "carrier").unwrap(), "1");
    }

    /// Without a virtio-net header: no offloads (whatever was wanted), frames are bare IP packets,
    /// the kernel names the device, and dropping it deletes the interface.
    fn plain() {
        let dev = TunDevice::create(&TunConfig {
            name: String::new(),
            vnet_hdr: false,
            offloads: ALL_OFFLOADS,
        })
        .expect("create the TUN device");
        let name = dev.name().to_string();
        assert!(name.starts_with("tun"), "{name}");
        assert!(!dev.vnet_hdr());
        assert_eq!(dev.offloads(), 0);
        dev.set_ipv4(LOCAL, 30).unwrap();
        dev.set_up(true).unwrap();
        dev.set_nonblocking(true).unwrap();
        // Invalid arguments are refused before any ioctl.
        assert_eq!(
            dev.set_ipv4(LOCAL, 33).unwrap_err().kind(),
            ErrorKind::InvalidInput
        );
        assert_eq!(
            dev.add_ipv6("fd99::1".parse().unwrap(), 129)
                .unwrap_err()
                .kind(),
            ErrorKind::InvalidInput
        );

        let tx = UdpSocket::bind((LOCAL, 0)).unwrap();
        tx.send_to(b"bare", (PEER, 9)).unwrap();
        let frame = next_ipv4_frame(&dev);
        assert_eq!(frame[0] >> 4, 4);
        assert_eq!(&frame[16..20], &PEER.octets());
        assert_eq!(&frame[frame.len() - 4..], b"bare");

        // The name is taken while the first device is open: a second attach is refused.
        let again = TunDevice::create(&TunConfig {
            name: name.clone(),
            vnet_hdr: true,
            offloads: 0,
        });
        let err = again.expect_err("a second TUNSETIFF on a name in use");
        assert!(err.to_string().contains("TUNSETIFF"), "{err}");

        assert!(std::path::Path::new(&format!("/sys/class/net/{name}")).exists());
        drop(dev);
        let deadline = Instant::now() + Duration::from_secs(3);
        while std::path::Path::new(&format!("/sys/class/net/{name}")).exists() {
            assert!(Instant::now() < deadline, "{name} still exists after close");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn main() -> std::process::ExitCode {
        if let Ok(name) = std::env::var(CHILD) {
            let (_, body) = TESTS.iter().find(|(n, _)| *n == name).expect("known test");
            body();
            std::process::exit(0);
        }
        let need = unmet_need().map_or(Ok(()), Err);
        memloop_testkit::run(
            TESTS
                .iter()
                .map(|&(name, _)| {
                    memloop_testkit::Test::new(name, move || in_fresh_netns(name))
                        .needs(need.clone())
                })
                .collect(),
        )
    }
}
