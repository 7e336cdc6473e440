//! `memloop blk` across two domains (network namespaces, `memloop domains`): an export in
//! domain 0 from a file in /dev/shm, attached in domain 1 as a loop device on the FUSE file.
//! ext4 made, mounted, filled with a checksummed tree, fsck'd clean and verified; fio's
//! crc32c verify on the raw device; a read-only export; the storage service SIGKILLed under
//! I/O (errors, no hang; a new export lets the client go on); a client SIGKILLed (its
//! session reclaimed). Needs root, /dev/fuse, losetup, mkfs.ext4, fsck.ext4 and fio
//! (tests/programs/install-deps.sh installs them).
//!
//!     cargo test --release -p memloop-cli --test blk -- --nocapture

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_memloop");

fn main() -> std::process::ExitCode {
    use memloop_testkit::{all, root, test, tool};
    let needs = || {
        all([
            root(),
            dev_fuse(),
            tool("ip", &["-V"]),
            tool("losetup", &["--version"]),
            tool("mkfs.ext4", &["-V"]),
            tool("fsck.ext4", &["-V"]),
            tool("fio", &["--version"]),
            tool("timeout", &["--version"]),
            tool("sha256sum", &["--version"]),
        ])
    };
    memloop_testkit::run(vec![
        test!(ext4_tree_fsck_and_fio_verify_across_two_domains).needs(needs()),
        test!(read_only_export_refuses_writes_and_serves_reads).needs(needs()),
        test!(storage_killed_mid_io_gives_errors_then_reexport_continues).needs(needs()),
        test!(stopped_storage_times_out_with_errors_then_resumes).needs(needs()),
        test!(a_file_system_whose_namespace_goes_is_written_back_in_full).needs(needs()),
    ])
}

fn dev_fuse() -> memloop_testkit::Need {
    match Path::new("/dev/fuse").exists() && Path::new("/dev/loop-control").exists() {
        true => Ok(()),
        false => Err("no /dev/fuse or /dev/loop-control".into()),
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A region, two domains and a backing file, all this test's own; cleaned up on drop.
struct Env {
    prefix: String,
    region: String,
    image: PathBuf,
    name: String,
    /// Loop devices attached (detached on drop if still there).
    devices: Vec<String>,
}

impl Env {
    fn new(k: u32, size_mib: u64) -> Env {
        let pid = std::process::id();
        let prefix = format!("b{pid}{k}");
        let region = format!("/dev/shm/mlblk-{pid}-{k}");
        let image = PathBuf::from(format!("/dev/shm/mlblk-{pid}-{k}.img"));
        let net = free_subnet(k);
        let e = Env {
            prefix,
            region,
            image,
            name: format!("t{pid}x{k}"),
            devices: Vec::new(),
        };
        let o = ml(&["region", "create", "--region", &e.region, "--size", "256M"]);
        assert!(o.status.success(), "region create: {}", text(&o.stderr));
        let subnet = format!("{net}0/24");
        let o = ml(&[
            "domains", "up", "2", "--prefix", &e.prefix, "--subnet", &subnet,
        ]);
        assert!(o.status.success(), "domains up: {}", text(&o.stderr));
        let f = std::fs::File::create(&e.image).expect("create the image");
        f.set_len(size_mib << 20).expect("size the image");
        e
    }

    /// `timeout SECS memloop domains exec I -- ARGS…`
    fn exec(&self, i: u32, secs: u32, args: &[&str]) -> Output {
        let mut c = Command::new("timeout");
        c.args(["-k", "5", &secs.to_string(), BIN, "domains", "exec"])
            .arg(i.to_string())
            .args(["--prefix", &self.prefix, "--"])
            .args(args)
            .stdin(Stdio::null());
        c.output().expect("run domains exec")
    }

    /// A shell script in domain `i`, which must succeed; its stdout.
    fn sh(&self, i: u32, secs: u32, script: &str) -> String {
        let o = self.exec(i, secs, &["sh", "-ec", script]);
        assert!(
            o.status.success(),
            "domain {i}: `{script}` failed ({}):\n{}\n{}",
            o.status,
            text(&o.stdout),
            text(&o.stderr)
        );
        text(&o.stdout)
    }

    fn export(&self, read_only: bool) {
        let img = self.image.to_string_lossy().to_string();
        let mut args = vec![
            BIN,
            "blk",
            "export",
            &self.name,
            "--file",
            &img,
            "--region",
            &self.region,
        ];
        if read_only {
            args.push("--read-only");
        }
        let o = self.exec(0, 20, &args);
        assert!(o.status.success(), "blk export: {}", text(&o.stderr));
    }

    /// Attaches in domain 1: the loop device.
    fn attach(&mut self) -> String {
        self.attach_with(&[])
    }

    fn attach_with(&mut self, extra: &[&str]) -> String {
        let mut args = vec![BIN, "blk", "attach", &self.name, "--region", &self.region];
        args.extend_from_slice(extra);
        let o = self.exec(1, 20, &args);
        assert!(o.status.success(), "blk attach: {}", text(&o.stderr));
        let dev = text(&o.stdout).trim().to_string();
        assert!(dev.starts_with("/dev/loop"), "attach printed {dev:?}");
        self.devices.push(dev.clone());
        dev
    }

    fn status(&self) -> Value {
        let o = ml(&["status", "--region", &self.region, "--json"]);
        assert!(o.status.success(), "status: {}", text(&o.stderr));
        let v: Value = serde_json::from_slice(&o.stdout).expect("status JSON");
        v["blk"].clone()
    }

    /// The status's blk section once `ok` holds of it (at most 5 s; then as it is).
    fn status_until(&self, ok: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let v = self.status();
            if ok(&v) || Instant::now() > deadline {
                return v;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn stats_pid(&self, file: &str) -> u32 {
        let path = format!("{}.wake/{file}", self.region);
        let v: Value = serde_json::from_str(&std::fs::read_to_string(&path).expect(&path))
            .expect("stats JSON");
        v["pid"].as_u64().expect("pid") as u32
    }

    fn export_pid(&self) -> u32 {
        self.stats_pid(&format!("blk-export-{}.json", self.name))
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        let _ = self.exec(
            1,
            20,
            &[BIN, "blk", "detach", &self.name, "--region", &self.region],
        );
        let _ = self.exec(
            0,
            20,
            &[BIN, "blk", "unexport", &self.name, "--region", &self.region],
        );
        for d in &self.devices {
            // (Still there if the attach service was killed.)
            let back = std::fs::read_to_string(format!(
                "/sys/block/{}/loop/backing_file",
                d.trim_start_matches("/dev/")
            ))
            .unwrap_or_default();
            if back.contains(&self.name) {
                let _ = Command::new("losetup").args(["-d", d]).status();
            }
        }
        let _ = ml(&["domains", "down", "--prefix", &self.prefix]);
        let _ = std::fs::remove_file(&self.image);
        let _ = std::fs::remove_file(&self.region);
        let _ = std::fs::remove_dir_all(format!("{}.wake", self.region));
    }
}

/// A /24 no interface uses yet, in 10.250-252.x (the programs suite takes 10.200-249.x, the
/// domains tests 10.100-199.x, the link suite 10.60-89.x).
fn free_subnet(k: u32) -> String {
    let used = Command::new("ip")
        .args(["-4", "-o", "addr", "show"])
        .output()
        .map(|o| text(&o.stdout))
        .unwrap_or_default();
    let pid = std::process::id();
    (0..256)
        .map(|j| format!("10.{}.{}.", 250 + k % 3, (pid + j) % 256))
        .find(|net| !used.contains(&format!(" {net}")))
        .expect("a free 10.25x.y.0/24")
}

fn ml(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run memloop")
}

fn step(what: &str, t0: Instant) {
    eprintln!("  [{:5.1} s] {what}", t0.elapsed().as_secs_f64());
}

fn ext4_tree_fsck_and_fio_verify_across_two_domains() {
    let t0 = Instant::now();
    let mut e = Env::new(1, 256);
    e.export(false);
    let dev = e.attach();
    step(
        &format!("exported in domain 0, attached in domain 1 as {dev}"),
        t0,
    );
    let mnt = format!("/tmp/mlblk-mnt-{}", e.name);
    let sums = format!("/tmp/mlblk-sums-{}", e.name);
    // 50 MiB of files in 5 directories, checksummed, then unmounted.
    e.sh(
        1,
        90,
        &format!(
            "mkfs.ext4 -q -F {dev}
             mkdir -p {mnt}; mount {dev} {mnt}
             for d in 0 1 2 3 4; do mkdir {mnt}/d$d; done
             i=0; while [ $i -lt 50 ]; do
               head -c 1048576 /dev/urandom > {mnt}/d$((i % 5))/f$i; i=$((i + 1)); done
             cd {mnt}; find . -type f -name 'f*' | sort | xargs sha256sum > {sums}; cd /
             umount {mnt}"
        ),
    );
    step("mkfs.ext4, 50 MiB tree written, unmounted", t0);
    let fsck = e.exec(1, 60, &["fsck.ext4", "-fn", &dev]);
    assert!(
        fsck.status.success(),
        "fsck.ext4 -fn {dev}: {}\n{}",
        text(&fsck.stdout),
        text(&fsck.stderr)
    );
    // The storage domain's own view: the backing file is that clean file system.
    let img = e.image.to_string_lossy().to_string();
    let fsck = e.exec(0, 60, &["fsck.ext4", "-fn", &img]);
    assert!(
        fsck.status.success(),
        "fsck.ext4 -fn {img} (domain 0): {}\n{}",
        text(&fsck.stdout),
        text(&fsck.stderr)
    );
    step(
        "fsck.ext4 -fn clean, on the loop device and on the backing file",
        t0,
    );
    // Mounted again in a fresh mount namespace: everything reads back.
    let out = e.sh(
        1,
        60,
        &format!("blockdev --flushbufs {dev}; mount {dev} {mnt}; cd {mnt}; sha256sum -c --quiet {sums}; cd /; umount {mnt}; echo verified"),
    );
    assert!(out.contains("verified"), "{out}");
    step("remounted, 50 files verified", t0);
    // (The services refresh their stats every second.)
    let blk = e.status_until(|b| b["exports"][0]["bytes_written"].as_u64() > Some(50 << 20));
    let ex = &blk["exports"][0];
    assert_eq!(ex["name"], e.name.as_str(), "{blk}");
    assert_eq!(ex["clients"], 1, "{blk}");
    assert!(ex["bytes_written"].as_u64().unwrap() > 50 << 20, "{blk}");
    let at = &blk["attachments"][0];
    assert_eq!(at["device"], dev.as_str(), "{blk}");
    assert_eq!(at["connected"], true, "{blk}");
    let text_status = text(&ml(&["status", "--region", &e.region]).stdout);
    assert!(
        text_status.contains("BLK EXPORTS") && text_status.contains("BLK ATTACHMENTS"),
        "{text_status}"
    );
    // fio: 4 KiB random writes at depth 32 through libaio, O_DIRECT, each block verified.
    let fio = e.exec(
        1,
        60,
        &[
            "fio",
            "--name=verify",
            &format!("--filename={dev}"),
            "--direct=1",
            "--ioengine=libaio",
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=32",
            "--size=64M",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            "--verify_state_save=0",
        ],
    );
    assert!(
        fio.status.success(),
        "fio verify: {}\n{}",
        text(&fio.stdout),
        text(&fio.stderr)
    );
    step("fio randwrite 4k qd32 + crc32c verify passed", t0);
    let o = e.exec(
        1,
        20,
        &[BIN, "blk", "detach", &e.name, "--region", &e.region],
    );
    assert!(o.status.success(), "detach: {}", text(&o.stderr));
    let back = std::fs::read_to_string(format!(
        "/sys/block/{}/loop/backing_file",
        dev.trim_start_matches("/dev/")
    ))
    .unwrap_or_default();
    assert!(!back.contains(&e.name), "{dev} still attached: {back}");
    step("detached", t0);
    let _ = std::fs::remove_file(&sums);
    let _ = std::fs::remove_dir(&mnt);
}

fn read_only_export_refuses_writes_and_serves_reads() {
    let t0 = Instant::now();
    let mut e = Env::new(2, 16);
    let data: Vec<u8> = (0..(16u32 << 20))
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    std::fs::write(&e.image, &data).expect("fill the image");
    e.export(true);
    let dev = e.attach();
    step(&format!("read-only export attached as {dev}"), t0);
    let out = e.sh(
        1,
        30,
        &format!("dd if={dev} bs=1M iflag=direct status=none | sha256sum"),
    );
    let want = {
        let o = Command::new("sha256sum").arg(&e.image).output().unwrap();
        text(&o.stdout)
            .split_whitespace()
            .next()
            .unwrap()
            .to_string()
    };
    assert!(out.starts_with(&want), "read back {out}, want {want}");
    step("reads match the backing file", t0);
    let w = e.exec(
        1,
        30,
        &[
            "dd",
            "if=/dev/zero",
            &format!("of={dev}"),
            "bs=4k",
            "count=1",
            "oflag=direct",
        ],
    );
    assert!(
        !w.status.success(),
        "a write to a read-only export succeeded"
    );
    let err = text(&w.stderr);
    assert!(
        err.contains("Read-only")
            || err.contains("Operation not permitted")
            || err.contains("Input/output"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(&e.image).unwrap(),
        data,
        "the backing file changed"
    );
    let blk = e.status();
    assert_eq!(blk["exports"][0]["read_only"], true, "{blk}");
    step("writes refused, backing file unchanged", t0);
}

fn storage_killed_mid_io_gives_errors_then_reexport_continues() {
    let t0 = Instant::now();
    let mut e = Env::new(3, 64);
    let data: Vec<u8> = (0..(64u32 << 20))
        .map(|i| (i.wrapping_mul(40503) >> 7) as u8)
        .collect();
    std::fs::write(&e.image, &data).expect("fill the image");
    e.export(false);
    let dev = e.attach();
    step(&format!("attached as {dev}"), t0);
    // Reads and writes in a loop until they fail (bounded: a hang fails the test).
    let mut io = Command::new("timeout");
    io.args(["-k", "5", "30", BIN, "domains", "exec", "1", "--prefix", &e.prefix, "--"])
        .args([
            "sh",
            "-c",
            &format!(
                "while dd if={dev} of=/dev/null bs=256k iflag=direct status=none &&
                       dd if={dev} of={dev} bs=64k count=64 iflag=direct oflag=direct conv=notrunc status=none; do :; done
                 echo failed"
            ),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = io.spawn().expect("start the I/O loop");
    std::thread::sleep(Duration::from_millis(1500));
    let pid = e.export_pid();
    let killed = Instant::now();
    Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
    let out = child.wait_with_output().expect("wait for the I/O loop");
    let took = killed.elapsed();
    assert!(
        text(&out.stdout).contains("failed"),
        "the I/O loop did not fail: {} {}",
        out.status,
        text(&out.stderr)
    );
    assert!(took < Duration::from_secs(10), "errors took {took:?}");
    step(
        &format!("storage SIGKILLed: the client's I/O failed after {took:?}"),
        t0,
    );
    // While no export: errors at once.
    let r = e.exec(
        1,
        15,
        &[
            "dd",
            &format!("if={dev}"),
            "of=/dev/null",
            "bs=4k",
            "count=1",
            "iflag=direct",
        ],
    );
    assert!(!r.status.success(), "a read with no export succeeded");
    // A new export of the same name: the same device goes on.
    e.export(false);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = e.exec(
            1,
            15,
            &[
                "sh",
                "-c",
                &format!("dd if={dev} bs=1M count=8 iflag=direct status=none | sha256sum"),
            ],
        );
        if r.status.success() && !text(&r.stdout).starts_with("e3b0c442") {
            break;
        }
        assert!(Instant::now() < deadline, "no I/O 10 s after the re-export");
        std::thread::sleep(Duration::from_millis(200));
    }
    let out = e.sh(
        1,
        30,
        &format!("dd if={dev} bs=1M iflag=direct status=none | sha256sum"),
    );
    let want = text(
        &Command::new("sha256sum")
            .arg(&e.image)
            .output()
            .unwrap()
            .stdout,
    );
    assert_eq!(
        out.split_whitespace().next(),
        want.split_whitespace().next(),
        "after re-export"
    );
    e.sh(
        1,
        30,
        &format!("dd if=/dev/urandom of={dev} bs=1M count=4 oflag=direct status=none"),
    );
    let blk = e.status_until(|b| b["attachments"][0]["reattached"].as_u64() >= Some(1));
    assert_eq!(blk["attachments"][0]["connected"], true, "{blk}");
    assert!(
        blk["attachments"][0]["reattached"].as_u64().unwrap() >= 1,
        "{blk}"
    );
    assert!(
        blk["attachments"][0]["failed_disconnected"]
            .as_u64()
            .unwrap()
            >= 1,
        "{blk}"
    );
    step("re-exported: reads and writes go on on the same device", t0);
    // The client dies: the export drops its session.
    let blk = e.status_until(|b| b["exports"][0]["clients"] == 1);
    assert_eq!(blk["exports"][0]["clients"], 1, "{blk}");
    let apid = e.stats_pid(&format!(
        "blk-attach-{}-net{}.json",
        e.name,
        netns_of_domain(&e, 1)
    ));
    let killed = Instant::now();
    Command::new("kill")
        .args(["-9", &apid.to_string()])
        .status()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let blk = e.status();
        if blk["exports"][0]["clients"] == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the dead client's session stays: {blk}"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    step(
        &format!(
            "a SIGKILLed client's session reclaimed in {:?}",
            killed.elapsed()
        ),
        t0,
    );
}

/// A storage side that is alive but answers nothing (SIGSTOP): with `--io-timeout 2`, the
/// client's blocked I/O fails with an error within a few seconds instead of hanging; once the
/// storage side runs again (SIGCONT), the attach takes it up again and the same device reads
/// the same data.
fn stopped_storage_times_out_with_errors_then_resumes() {
    let t0 = Instant::now();
    let mut e = Env::new(4, 16);
    let data: Vec<u8> = (0..(16u32 << 20))
        .map(|i| (i.wrapping_mul(7919) >> 5) as u8)
        .collect();
    std::fs::write(&e.image, &data).expect("fill the image");
    e.export(false);
    let dev = e.attach_with(&["--io-timeout", "2"]);
    let pid = e.export_pid().to_string();
    let read = format!("dd if={dev} bs=1M iflag=direct status=none | sha256sum");
    let before = e.sh(1, 30, &read);
    let stopped = Instant::now();
    let kill = |sig: &str| Command::new("kill").args([sig, &pid]).status().unwrap();
    assert!(kill("-STOP").success());
    // Bounded at 20 s: a hang is a failure, not a wait.
    let r = e.exec(
        1,
        20,
        &[
            "dd",
            &format!("if={dev}"),
            "of=/dev/null",
            "bs=64k",
            "count=1",
            "skip=7",
            "iflag=direct",
        ],
    );
    let took = stopped.elapsed();
    assert!(kill("-CONT").success());
    assert!(
        !r.status.success(),
        "a read from stopped storage succeeded: {}",
        text(&r.stderr)
    );
    assert_ne!(
        r.status.code(),
        Some(124),
        "the read hung until the test's own timeout"
    );
    assert!(
        text(&r.stderr).contains("Input/output error"),
        "{}",
        text(&r.stderr)
    );
    assert!(took < Duration::from_secs(10), "the error took {took:?}");
    step(
        &format!("storage SIGSTOPped: the read failed after {took:?}"),
        t0,
    );
    let blk = e.status_until(|b| b["attachments"][0]["timed_out"].as_u64() >= Some(1));
    assert!(
        blk["attachments"][0]["timed_out"].as_u64() >= Some(1),
        "{blk}"
    );
    // Running again: the same device, the same bytes.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let r = e.exec(1, 15, &["sh", "-c", &read]);
        if r.status.success() && text(&r.stdout) == before {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no I/O 15 s after SIGCONT: {}",
            text(&r.stderr)
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    let blk = e.status_until(|b| b["attachments"][0]["connected"] == true);
    assert_eq!(blk["attachments"][0]["connected"], true, "{blk}");
    step("SIGCONT: the same device reads the same data", t0);
}

/// The attach service lives in a mount namespace of its own: a file system mounted on the
/// device by a program whose mount namespace then goes away (its last process exits, as a
/// container's does) is unmounted at once and written back through the service — which must
/// not be a member of that namespace, or it would keep the file system mounted until its own
/// exit, whose teardown would then write back through itself. Dirty data written by such a
/// program is all on the export after the program is gone, and detach works.
fn a_file_system_whose_namespace_goes_is_written_back_in_full() {
    let t0 = Instant::now();
    let mut e = Env::new(5, 64);
    e.export(false);
    // One command in domain 1 (its own mount namespace): attach — the service starts from
    // here —, ext4, a file left dirty, exit.
    let mnt = format!("/tmp/mlblk-ns-{}", std::process::id());
    let out = e.sh(
        1,
        60,
        &format!(
            "dev=$({BIN} blk attach {} --region {}); echo $dev
             mkfs.ext4 -q -F $dev; mkdir -p {mnt}; mount $dev {mnt}
             head -c 24000000 /dev/urandom > {mnt}/dirty
             sha256sum < {mnt}/dirty",
            e.name, e.region
        ),
    );
    let (dev, sum) = out.split_once('\n').expect("device and sum");
    assert!(dev.starts_with("/dev/loop"), "{out}");
    e.devices.push(dev.to_string());
    let sum = sum.to_string();
    step(
        "ext4 mounted in a namespace that is now gone, 24 MB left dirty",
        t0,
    );
    // Detach (bounded): the service must not hang on its way out.
    let o = e.exec(
        1,
        20,
        &[BIN, "blk", "detach", &e.name, "--region", &e.region],
    );
    assert!(
        o.status.success(),
        "detach: {} {}",
        o.status,
        text(&o.stderr)
    );
    e.devices.clear();
    step("detached", t0);
    // The data is on the export: attach again and read the file back.
    let dev = e.attach();
    let back = e.sh(
        1,
        60,
        &format!("mount -o ro {dev} {mnt}; sha256sum < {mnt}/dirty; umount {mnt}; rmdir {mnt}"),
    );
    assert_eq!(back, sum, "the file written before its namespace went");
    step("attached again: the file is all there", t0);
}

/// The network namespace number of domain `i` (as the attach service names its files).
fn netns_of_domain(e: &Env, i: u32) -> String {
    let o = e.exec(i, 10, &["readlink", "/proc/self/ns/net"]);
    text(&o.stdout).replace(|c: char| !c.is_ascii_digit(), "")
}
