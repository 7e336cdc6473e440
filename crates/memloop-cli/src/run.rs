//! `memloop run [--region R] [--no-create] -- CMD ARGS…`: runs an unmodified program with the
//! preload library (`libmemloop.so`, which loads the engine `libmemloop_preload.so` beside it
//! when the process first needs it) so that its TCP connections to peers in the same region go
//! through shared-memory rings.
//!
//! It finds the library, makes sure the region exists, sets `MEMLOOP_REGION` and prepends the
//! library to `LD_PRELOAD` (keeping what was there), then replaces itself with CMD. Everything
//! else in the environment passes through: `MEMLOOP_DISABLE=1` is read by the library itself.
//!
//! Never in the way: when the library or the region cannot be used (not found, no permission,
//! `/dev/shm` full, a region of another layout), it says why in one line on stderr and runs
//! CMD untouched, on the kernel path. `--strict` fails instead.
//!
//! Exit codes, as `env` and `timeout` do: CMD's own once it runs, 125 if memloop fails before
//! that under `--strict`, 127 if CMD cannot be executed.

use crate::error::{fail, CliResult, Context};
use crate::region_cmd::{self, RegionArg};
use memloop::{CreateRegion, Region, RegionSpec};
use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The library's file name: the shim `memloop-preload`'s build compiles (`shim/`).
pub const PRELOAD_LIB: &str = "libmemloop.so";
/// The engine it loads from its own directory (the cdylib of crate `memloop-preload`, which
/// also works preloaded by itself, e.g. through `MEMLOOP_PRELOAD_LIB`).
pub const ENGINE_LIB: &str = "libmemloop_preload.so";
/// Overrides where the library is looked for.
pub const PRELOAD_LIB_ENV: &str = "MEMLOOP_PRELOAD_LIB";
/// Exit code when memloop itself fails before running CMD.
const EXIT_SETUP_FAILED: i32 = 125;
/// Exit code when CMD cannot be executed.
const EXIT_EXEC_FAILED: i32 = 127;

#[derive(clap::Args)]
pub struct RunArgs {
    #[command(flatten)]
    region: RegionArg,
    /// Do not create the region if it does not exist (CMD then runs without memloop, or
    /// fails with --strict).
    #[arg(long)]
    no_create: bool,
    /// Fail (exit 125) when the library or the region cannot be used, instead of running
    /// CMD without memloop.
    #[arg(long)]
    strict: bool,
    /// The command and its arguments (after `--`).
    #[arg(last = true, required = true)]
    cmd: Vec<OsString>,
}

/// Never returns on success: the process becomes CMD.
pub fn run(a: &RunArgs) -> CliResult<()> {
    let mut cmd = Command::new(&a.cmd[0]);
    cmd.args(&a.cmd[1..]);
    match prepare(a) {
        Ok(env) => {
            cmd.env("MEMLOOP_REGION", &env.region)
                .env("LD_PRELOAD", &env.ld_preload);
        }
        Err(e) if a.strict => {
            eprintln!("memloop: error: {e}");
            std::process::exit(EXIT_SETUP_FAILED);
        }
        Err(e) => eprintln!("memloop: {e}; running the command without memloop (kernel path)"),
    }
    let e = cmd.exec();
    eprintln!(
        "memloop: error: cannot execute {}: {e}",
        Path::new(&a.cmd[0]).display()
    );
    std::process::exit(EXIT_EXEC_FAILED);
}

/// What CMD gets on top of our environment.
#[derive(Debug)]
struct RunEnv {
    region: OsString,
    ld_preload: OsString,
}

fn prepare(a: &RunArgs) -> CliResult<RunEnv> {
    let lib = find_library()?;
    let spec = a.region.spec();
    let region = if a.no_create {
        region_cmd::open(&spec)?
    } else {
        Region::open_or_create(&spec, &CreateRegion::default())
            .context(format!("opening region {}", spec.path().display()))?
    };
    let (region, ld_preload) = preload_env(
        &lib,
        region.spec(),
        std::env::var_os("LD_PRELOAD").as_deref(),
    )?;
    Ok(RunEnv { region, ld_preload })
}

/// The values of `MEMLOOP_REGION` and `LD_PRELOAD` that run a program with library `lib` (from
/// [`find_library`]) in region `spec`: what `memloop run` sets. `existing` is the `LD_PRELOAD`
/// to keep after the library (`None` for the library alone).
pub fn preload_env(
    lib: &Path,
    spec: &RegionSpec,
    existing: Option<&std::ffi::OsStr>,
) -> CliResult<(OsString, OsString)> {
    Ok((region_env_value(spec)?, prepend_preload(lib, existing)?))
}

/// `$MEMLOOP_PRELOAD_LIB` (which must exist), else the library next to this executable, else
/// in `../lib/` or `../lib/memloop/` from it (installed layouts). Always an absolute, canonical
/// path.
pub fn find_library() -> CliResult<PathBuf> {
    if let Some(p) = std::env::var_os(PRELOAD_LIB_ENV).filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        return p.canonicalize().map_err(|e| {
            fail(format!(
                "{PRELOAD_LIB_ENV}={}: {e} (unset it to use the library next to memloop)",
                p.display()
            ))
        });
    }
    let exe = std::env::current_exe().context("locating the memloop executable")?;
    let dir = exe.parent().unwrap_or(Path::new("/"));
    let candidates = [
        dir.join(PRELOAD_LIB),
        dir.join("../lib").join(PRELOAD_LIB),
        dir.join("../lib/memloop").join(PRELOAD_LIB),
    ];
    let found = candidates
        .iter()
        .find(|p| p.is_file())
        .map(|p| {
            p.canonicalize()
                .context(format!("resolving {}", p.display()))
        })
        .unwrap_or_else(|| {
            Err(fail(format!(
                "{PRELOAD_LIB} not found (looked at {}): build it with \
                 `cargo build --release -p memloop-preload`, or set {PRELOAD_LIB_ENV}",
                candidates
                    .iter()
                    .map(|c| c.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )))
        })?;
    engine_of(&found)?;
    Ok(found)
}

/// The engine `lib` loads (beside it), or `None` when `lib` is not the shim (the engine
/// preloaded by itself). An error when the shim's engine is missing: the shim would run every
/// program on the kernel path.
pub fn engine_of(lib: &Path) -> CliResult<Option<PathBuf>> {
    if lib.file_name() != Some(std::ffi::OsStr::new(PRELOAD_LIB)) {
        return Ok(None);
    }
    let engine = lib.with_file_name(ENGINE_LIB);
    if !engine.is_file() {
        return Err(fail(format!(
            "{} not found beside {} (build both with `cargo build --release -p memloop-preload`)",
            engine.display(),
            lib.display()
        )));
    }
    Ok(Some(engine))
}

/// The value of `MEMLOOP_REGION` naming this region for CMD: the name, or an absolute path (CMD
/// may change directory before it opens the region).
fn region_env_value(spec: &RegionSpec) -> CliResult<OsString> {
    match spec {
        RegionSpec::Named(n) => Ok(n.into()),
        other => {
            let p = other.path();
            let abs = p.canonicalize().or_else(|_| std::path::absolute(&p));
            Ok(abs.context(format!("resolving {}", p.display()))?.into())
        }
    }
}

/// `lib` first, then the entries already in `existing` (minus `lib` itself: nested runs do not
/// stack it twice). ld.so splits the list on spaces and colons, so `lib` may contain neither.
fn prepend_preload(lib: &Path, existing: Option<&std::ffi::OsStr>) -> CliResult<OsString> {
    let lib_str = lib
        .to_str()
        .filter(|s| !s.contains([' ', ':']))
        .ok_or_else(|| {
            fail(format!(
                "{}: LD_PRELOAD cannot hold a path with spaces, colons or non-UTF-8 bytes",
                lib.display()
            ))
        })?;
    let existing = existing.map(|e| e.to_string_lossy().into_owned());
    let rest = existing
        .iter()
        .flat_map(|e| e.split([' ', ':']))
        .filter(|s| !s.is_empty() && *s != lib_str);
    let all: Vec<&str> = std::iter::once(lib_str).chain(rest).collect();
    Ok(all.join(":").into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pre(existing: Option<&str>) -> String {
        let lib = Path::new("/opt/ml/libmemloop.so");
        prepend_preload(lib, existing.map(std::ffi::OsStr::new))
            .unwrap()
            .into_string()
            .unwrap()
    }

    #[test]
    fn preload_is_prepended_and_not_repeated() {
        assert_eq!(pre(None), "/opt/ml/libmemloop.so");
        assert_eq!(pre(Some("")), "/opt/ml/libmemloop.so");
        assert_eq!(
            pre(Some("/a.so /b.so:/c.so")),
            "/opt/ml/libmemloop.so:/a.so:/b.so:/c.so"
        );
        assert_eq!(
            pre(Some("/a.so:/opt/ml/libmemloop.so")),
            "/opt/ml/libmemloop.so:/a.so"
        );
    }

    #[test]
    fn preload_path_must_be_splittable() {
        assert!(prepend_preload(Path::new("/my libs/x.so"), None).is_err());
        assert!(prepend_preload(Path::new("/a:b/x.so"), None).is_err());
    }

    #[test]
    fn region_value_is_a_name_or_an_absolute_path() {
        let named = region_env_value(&RegionSpec::parse("demo")).unwrap();
        assert_eq!(named, "demo");
        let rel = region_env_value(&RegionSpec::File("some/region".into())).unwrap();
        assert!(Path::new(&rel).is_absolute(), "{rel:?}");
        assert!(Path::new(&rel).ends_with("some/region"), "{rel:?}");
    }
}
