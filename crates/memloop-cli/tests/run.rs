//! `memloop run`: where it finds the preload library, what it puts in the environment, how it
//! fails. A stand-in file plays the library (ld.so says it cannot preload it and goes on), so
//! these tests need neither the real library nor root.

use memloop::{Region, RegionSpec};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_memloop");

/// A scratch directory and region names unique to this test; both removed on drop.
struct Scratch {
    dir: PathBuf,
    regions: Vec<String>,
}

impl Scratch {
    fn new(tag: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("memloop-run-test-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch {
            dir,
            regions: Vec::new(),
        }
    }
    /// A region name that does not exist yet.
    fn region(&mut self, tag: &str) -> String {
        let name = format!("run-test-{}-{tag}", std::process::id());
        let _ = Region::destroy(&RegionSpec::parse(&name));
        self.regions.push(name.clone());
        name
    }
    /// A file standing in for the library.
    fn fake_lib(&self, rel: &str) -> PathBuf {
        let p = self.dir.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, b"not an ELF file").unwrap();
        p
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        for r in &self.regions {
            let _ = Region::destroy(&RegionSpec::parse(r));
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `BIN run ARGS` with a clean memloop environment plus `env`.
fn run(bin: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(bin);
    c.arg("run")
        .args(args)
        .env_remove("MEMLOOP_REGION")
        .env_remove("MEMLOOP_PRELOAD_LIB")
        .env_remove("LD_PRELOAD");
    for (k, v) in env {
        c.env(k, v);
    }
    // A binary copied moments ago can be "busy" while a parallel test's fork still holds the
    // copy's write fd (until that child execs): try again.
    for _ in 0..50 {
        match c.output() {
            Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy => {
                std::thread::sleep(std::time::Duration::from_millis(20))
            }
            r => return r.expect("run memloop"),
        }
    }
    c.output().expect("run memloop")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

const SHOW: &str = "echo \"$LD_PRELOAD|$MEMLOOP_REGION|${MEMLOOP_DISABLE:-}\"";

#[test]
fn run_sets_ld_preload_and_region_and_creates_the_region() {
    let mut s = Scratch::new("env");
    let lib = s.fake_lib("lib/libmemloop_preload.so");
    let region = s.region("env");
    let lib_s = lib.to_str().unwrap();
    let o = run(
        Path::new(BIN),
        &["--region", &region, "--", "sh", "-c", SHOW],
        &[("MEMLOOP_PRELOAD_LIB", lib_s)],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(text(&o.stdout).trim(), format!("{lib_s}|{region}|"));
    // The region was created with default parameters.
    let r = Region::open(&RegionSpec::parse(&region)).expect("region exists");
    assert_eq!(r.size(), 2 << 30);
}

#[test]
fn run_keeps_existing_preloads_and_passes_the_environment_through() {
    let mut s = Scratch::new("keep");
    let lib = s.fake_lib("libmemloop_preload.so");
    let other = s.fake_lib("libother.so");
    let region = s.region("keep");
    let (lib_s, other_s) = (lib.to_str().unwrap(), other.to_str().unwrap());
    // Already present: not repeated. MEMLOOP_DISABLE is the library's business: passed as is.
    let existing = format!("{other_s} {lib_s}");
    let o = run(
        Path::new(BIN),
        &["--region", &region, "--", "sh", "-c", SHOW],
        &[
            ("MEMLOOP_PRELOAD_LIB", lib_s),
            ("LD_PRELOAD", &existing),
            ("MEMLOOP_DISABLE", "1"),
        ],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(
        text(&o.stdout).trim(),
        format!("{lib_s}:{other_s}|{region}|1")
    );
}

#[test]
fn run_defaults_to_memloop_region_and_resolves_paths() {
    let mut s = Scratch::new("paths");
    let lib = s.fake_lib("libmemloop_preload.so");
    let region = s.region("paths");
    let lib_s = lib.to_str().unwrap();
    let o = run(
        Path::new(BIN),
        &["--", "sh", "-c", SHOW],
        &[("MEMLOOP_PRELOAD_LIB", lib_s), ("MEMLOOP_REGION", &region)],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(text(&o.stdout).trim(), format!("{lib_s}|{region}|"));

    // A region given by a relative path reaches the program as an absolute one.
    let o = Command::new(BIN)
        .args(["run", "--region", "./region-file", "--", "sh", "-c", SHOW])
        .current_dir(&s.dir)
        .env("MEMLOOP_PRELOAD_LIB", lib_s)
        .env_remove("LD_PRELOAD")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let want = s.dir.canonicalize().unwrap().join("region-file");
    assert_eq!(
        text(&o.stdout).trim(),
        format!("{lib_s}|{}|", want.display())
    );
    assert!(want.is_file());
}

#[test]
fn run_finds_the_library_next_to_the_executable_or_in_lib() {
    let mut s = Scratch::new("lookup");
    let region = s.region("lookup");
    // A copy of memloop in DIR/bin: the library is looked for in DIR/bin, then DIR/lib.
    let bin = s.dir.join("bin/memloop");
    std::fs::create_dir_all(bin.parent().unwrap()).unwrap();
    std::fs::copy(BIN, &bin).unwrap();

    let o = run(&bin, &["--strict", "--region", &region, "--", "true"], &[]);
    assert_eq!(o.status.code(), Some(125), "no library anywhere");
    let err = text(&o.stderr);
    assert!(
        err.contains("libmemloop.so not found") && err.contains("MEMLOOP_PRELOAD_LIB"),
        "{err}"
    );

    // The shim without its engine beside it: said, and nothing preloaded.
    let in_lib = s.fake_lib("lib/libmemloop.so");
    let o = run(&bin, &["--strict", "--region", &region, "--", "true"], &[]);
    assert_eq!(o.status.code(), Some(125), "no engine beside the shim");
    let err = text(&o.stderr);
    assert!(
        err.contains("libmemloop_preload.so not found beside"),
        "{err}"
    );

    s.fake_lib("lib/libmemloop_preload.so");
    let o = run(&bin, &["--region", &region, "--", "sh", "-c", SHOW], &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(
        text(&o.stdout).trim(),
        format!("{}|{region}|", in_lib.canonicalize().unwrap().display())
    );

    let next_to = s.fake_lib("bin/libmemloop.so");
    s.fake_lib("bin/libmemloop_preload.so");
    let o = run(&bin, &["--region", &region, "--", "sh", "-c", SHOW], &[]);
    assert_eq!(
        text(&o.stdout).trim(),
        format!("{}|{region}|", next_to.canonicalize().unwrap().display())
    );
}

#[test]
fn run_failures_are_clear_and_have_distinct_exit_codes() {
    let mut s = Scratch::new("fail");
    let lib = s.fake_lib("libmemloop_preload.so");
    let lib_s = lib.to_str().unwrap();
    let region = s.region("fail");

    // The library named by MEMLOOP_PRELOAD_LIB does not exist: under --strict 125, nothing
    // runs.
    let o = run(
        Path::new(BIN),
        &[
            "--strict", "--region", &region, "--", "sh", "-c", "echo ran",
        ],
        &[("MEMLOOP_PRELOAD_LIB", "/nonexistent/libmemloop_preload.so")],
    );
    assert_eq!(o.status.code(), Some(125));
    assert!(text(&o.stderr).contains("/nonexistent/libmemloop_preload.so"));
    assert!(text(&o.stdout).is_empty());

    // --strict --no-create and no region: 125 with the usual hint; the region is not created.
    let o = run(
        Path::new(BIN),
        &["--strict", "--region", &region, "--no-create", "--", "true"],
        &[("MEMLOOP_PRELOAD_LIB", lib_s)],
    );
    assert_eq!(o.status.code(), Some(125));
    assert!(
        text(&o.stderr).contains("memloop region create"),
        "{}",
        text(&o.stderr)
    );
    assert!(Region::open(&RegionSpec::parse(&region)).is_err());

    // A command that cannot be executed: 127 and its name.
    let o = run(
        Path::new(BIN),
        &["--region", &region, "--", "/nonexistent/program", "arg"],
        &[("MEMLOOP_PRELOAD_LIB", lib_s)],
    );
    assert_eq!(o.status.code(), Some(127));
    let err = text(&o.stderr);
    assert!(err.contains("cannot execute /nonexistent/program"), "{err}");

    // The command's own exit code comes through.
    let o = run(
        Path::new(BIN),
        &["--region", &region, "--", "sh", "-c", "exit 7"],
        &[("MEMLOOP_PRELOAD_LIB", lib_s)],
    );
    assert_eq!(o.status.code(), Some(7));

    // No command at all is a usage error.
    let o = run(Path::new(BIN), &["--region", &region], &[]);
    assert!(!o.status.success());
}

/// Without `--strict`, nothing memloop needs stops the program: the library missing, the region
/// missing under `--no-create`, a file at the region's path that is no region. Each time one
/// line on stderr says why, CMD runs untouched (no `LD_PRELOAD`, no `MEMLOOP_REGION` added)
/// and its exit status is ours.
#[test]
fn run_steps_aside_when_memloop_cannot_be_used() {
    let mut s = Scratch::new("aside");
    let lib = s.fake_lib("libmemloop_preload.so");
    let lib_s = lib.to_str().unwrap();
    let region = s.region("aside");
    let show = "echo \"${LD_PRELOAD:-none}|${MEMLOOP_REGION:-none}\"; exit 3";
    let garbage = s.dir.join("not-a-region");
    std::fs::write(&garbage, vec![0x5a; 1 << 16]).unwrap();
    let garbage = garbage.to_str().unwrap().to_owned();
    let cases: [(&str, Vec<&str>, (&str, &str)); 3] = [
        (
            "no library",
            vec!["--region", &region],
            ("MEMLOOP_PRELOAD_LIB", "/nonexistent/libmemloop_preload.so"),
        ),
        (
            "no region",
            vec!["--region", &region, "--no-create"],
            ("MEMLOOP_PRELOAD_LIB", lib_s),
        ),
        (
            "not a region",
            vec!["--region", &garbage],
            ("MEMLOOP_PRELOAD_LIB", lib_s),
        ),
    ];
    for (what, mut args, env) in cases {
        args.extend(["--", "sh", "-c", show]);
        let o = run(Path::new(BIN), &args, &[env]);
        let err = text(&o.stderr);
        assert_eq!(o.status.code(), Some(3), "{what}: {err}");
        assert_eq!(text(&o.stdout).trim(), "none|none", "{what}");
        assert_eq!(err.lines().count(), 1, "{what}: one line, got {err}");
        assert!(err.contains("without memloop"), "{what}: {err}");
    }
    assert!(Region::open(&RegionSpec::parse(&region)).is_err());
}
