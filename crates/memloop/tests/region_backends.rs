//! Region back-ends and the creation race, against real files, devices paths and hugetlbfs.

use memloop::{CreateRegion, Error, Listener, Node, Region, RegionSpec, Stream};
use std::path::PathBuf;
use std::sync::{Arc, Barrier};

fn main() -> std::process::ExitCode {
    use memloop_testkit::test;
    memloop_testkit::run(vec![
        test!(concurrent_creators_end_with_one_initialised_region),
        test!(an_initialiser_that_died_is_replaced),
        test!(missing_and_garbage_regions_give_clear_errors),
        test!(mode_is_applied_at_creation),
        test!(device_path_backend_is_initialised_then_attached),
        test!(hugetlbfs_backend_works_when_available).needs(needs_hugetlbfs()),
    ])
}

/// Reserving huge pages and mounting hugetlbfs: root and a kernel with hugetlbfs.
fn needs_hugetlbfs() -> memloop_testkit::Need {
    memloop_testkit::root()?;
    let fs = std::fs::read_to_string("/proc/filesystems").unwrap_or_default();
    if !fs
        .lines()
        .any(|l| l.split_whitespace().last() == Some("hugetlbfs"))
    {
        return Err("needs hugetlbfs in the kernel (not in /proc/filesystems)".into());
    }
    memloop_testkit::tool("mount", &["--version"])
}

fn unique(tag: &str) -> String {
    format!("test-{tag}-{}", std::process::id())
}

fn small() -> CreateRegion {
    CreateRegion {
        params: memloop::registry::RegionParams::for_size(4 << 20),
        ..CreateRegion::default()
    }
}

/// Connects a stream inside `region` and moves a few bytes both ways.
fn round_trip(region: &Region) {
    let a = Node::join(region.clone(), "a").unwrap();
    let b = Node::join(region.clone(), "b").unwrap();
    // Members advertise the addresses of their network namespace when first needed (a
    // process that only talks over loopback never reads them).
    assert!(region
        .registry()
        .member(a.id())
        .unwrap()
        .addresses
        .is_empty());
    a.advertise();
    let me = region.registry().member(a.id()).unwrap();
    assert!(
        me.addresses.contains(&"127.0.0.1".parse().unwrap()),
        "{:?}",
        me.addresses
    );
    let l = Listener::bind(&a, "svc").unwrap();
    let mut c = Stream::connect(&b, "svc").unwrap();
    let mut s = l.accept().unwrap();
    c.send_all(b"ping").unwrap();
    let mut buf = [0u8; 4];
    assert_eq!(s.recv(&mut buf).unwrap(), 4);
    assert_eq!(&buf, b"ping");
    s.send_all(b"pong").unwrap();
    assert_eq!(c.recv(&mut buf).unwrap(), 4);
    assert_eq!(&buf, b"pong");
}

fn concurrent_creators_end_with_one_initialised_region() {
    let spec = RegionSpec::Named(unique("race"));
    for _round in 0..20 {
        let _ = Region::destroy(&spec);
        let barrier = Arc::new(Barrier::new(6));
        let handles: Vec<_> = (0..6)
            .map(|_| {
                let (spec, barrier) = (spec.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    Region::open_or_create(&spec, &small()).map(|r| r.registry().generation())
                })
            })
            .collect();
        let gens: Vec<u64> = handles
            .into_iter()
            .map(|h| h.join().unwrap().unwrap())
            .collect();
        assert!(
            gens.windows(2).all(|w| w[0] == w[1]),
            "different generations: {gens:?}"
        );
    }
    round_trip(&Region::open(&spec).unwrap());
    Region::destroy(&spec).unwrap();
}

fn an_initialiser_that_died_is_replaced() {
    // A creator that made and sized the file but died before writing the header.
    let spec = RegionSpec::Named(unique("half"));
    let _ = Region::destroy(&spec);
    let opts = memloop_shm::CreateOptions {
        size: 4 << 20,
        mode: 0o600,
        gid: None,
        locked: false,
    };
    drop(
        memloop_shm::Mapping::create_new(&spec.path(), memloop_shm::Backend::File, &opts).unwrap(),
    );
    let r = Region::open_or_create(&spec, &small()).unwrap();
    round_trip(&r);
    Region::destroy(&spec).unwrap();
}

fn missing_and_garbage_regions_give_clear_errors() {
    let spec = RegionSpec::Named(unique("missing"));
    let _ = Region::destroy(&spec);
    assert!(matches!(Region::open(&spec), Err(Error::NoRegion(_))));
    std::fs::write(spec.path(), vec![0xA5u8; 1 << 16]).unwrap();
    let err = Region::open(&spec)
        .err()
        .expect("garbage must not attach")
        .to_string();
    assert!(err.contains("magic"), "unhelpful error: {err}");
    Region::destroy(&spec).unwrap();
}

fn mode_is_applied_at_creation() {
    use std::os::unix::fs::PermissionsExt;
    let spec = RegionSpec::Named(unique("mode"));
    let _ = Region::destroy(&spec);
    let opts = CreateRegion {
        mode: 0o640,
        ..small()
    };
    Region::open_or_create(&spec, &opts).unwrap();
    let mode = std::fs::metadata(spec.path()).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o640);
    Region::destroy(&spec).unwrap();
}

fn device_path_backend_is_initialised_then_attached() {
    // Stands in for the ivshmem BAR: a fixed-size mappable file we may not create or resize.
    let path = PathBuf::from(format!("/tmp/memloop-{}.bar", unique("dev")));
    std::fs::write(&path, vec![0u8; 4 << 20]).unwrap();
    let spec = RegionSpec::Device(path.clone());
    assert!(
        Region::open(&spec).is_err(),
        "uninitialised device must not attach"
    );
    Region::init_device(&spec, &small(), false).unwrap();
    let r = Region::open(&spec).unwrap();
    assert_eq!(r.size(), 4 << 20);
    round_trip(&r);
    std::fs::remove_file(&path).unwrap();
}

fn hugetlbfs_backend_works_when_available() {
    let mnt = HugeMount::new().expect("reserving huge pages and mounting hugetlbfs as root");
    let spec = RegionSpec::parse(mnt.dir.join("region").to_str().unwrap());
    assert!(matches!(spec, RegionSpec::Hugetlbfs(_)), "{spec:?}");
    let r = Region::open_or_create(&spec, &small()).unwrap();
    round_trip(&r);
    Region::destroy(&spec).unwrap();
}

/// A private hugetlbfs mount with a few reserved pages, undone on drop.
struct HugeMount {
    dir: PathBuf,
    old_pages: String,
}

impl HugeMount {
    fn new() -> Option<Self> {
        let knob = "/proc/sys/vm/nr_hugepages";
        let old_pages = std::fs::read_to_string(knob).ok()?;
        if old_pages.trim().parse::<u64>().ok()? < 4 {
            std::fs::write(knob, "4").ok()?;
        }
        let dir = std::env::temp_dir().join(unique("huge"));
        std::fs::create_dir_all(&dir).ok()?;
        let ok = std::process::Command::new("mount")
            .args(["-t", "hugetlbfs", "none"])
            .arg(&dir)
            .status()
            .is_ok_and(|s| s.success());
        let m = Self { dir, old_pages };
        ok.then_some(m)
    }
}

impl Drop for HugeMount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.dir).status();
        let _ = std::fs::remove_dir(&self.dir);
        let _ = std::fs::write("/proc/sys/vm/nr_hugepages", self.old_pages.trim());
    }
}
