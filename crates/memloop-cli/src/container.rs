//! Containers opted in without touching their images: an OCI `precreate` hook (podman, CRI-O)
//! that, for a container carrying the annotation `io.memloop.region=REGION`, bind-mounts the
//! host's region file, its wake-socket directory and the preload library into the container
//! and sets `LD_PRELOAD` and `MEMLOOP_REGION` for its processes.
//!
//! ```sh
//! memloop container install                  # the hook, in /usr/share/containers/oci/hooks.d
//! podman run --annotation io.memloop.region=default IMAGE CMD…
//! ```
//!
//! Never in the way: when the region or the library cannot be used the hook says why on stderr
//! and hands the container's configuration back unchanged — the container runs on the kernel
//! path.

use crate::error::{fail, CliResult, Context};
use memloop::{CreateRegion, Region, RegionSpec};
use serde_json::{json, Value};
use std::io::Read;
use std::path::{Path, PathBuf};

/// The annotation that opts a container in; its value names the region (as `--region` does).
pub const ANNOTATION: &str = "io.memloop.region";
/// Where the region, its wake sockets and the library appear inside a container.
const IN_REGION: &str = "/run/memloop/region";
const IN_WAKE: &str = "/run/memloop/region.wake";
const IN_DIR: &str = "/run/memloop";
/// Where podman and CRI-O look for hooks by default.
const DEFAULT_HOOKS_DIR: &str = "/usr/share/containers/oci/hooks.d";

#[derive(clap::Subcommand)]
pub enum ContainerCmd {
    /// Write the OCI hook description (`memloop.json`) that makes containers annotated
    /// `io.memloop.region=REGION` use memloop.
    Install {
        /// The engine's hooks directory (podman: `--hooks-dir`, or hooks_dir in
        /// containers.conf).
        #[arg(long, default_value = DEFAULT_HOOKS_DIR)]
        hooks_dir: PathBuf,
        /// The `memloop` the engine runs as the hook (default: this one), e.g. its path on the
        /// host when installing from inside a container or into a package's staging tree.
        #[arg(long)]
        exe: Option<PathBuf>,
    },
    /// The hook itself (`precreate` stage): an OCI runtime configuration on stdin, the same
    /// with memloop added on stdout.
    Hook,
}

pub fn run(cmd: ContainerCmd) -> CliResult<()> {
    match cmd {
        ContainerCmd::Install { hooks_dir, exe } => install(&hooks_dir, exe),
        ContainerCmd::Hook => hook(),
    }
}

fn install(dir: &Path, exe: Option<PathBuf>) -> CliResult<()> {
    let exe = match exe {
        Some(p) => p,
        None => std::env::current_exe()
            .and_then(|p| p.canonicalize())
            .context("locating this executable")?,
    };
    let desc = json!({
        "version": "1.0.0",
        "hook": { "path": exe, "args": ["memloop", "container", "hook"] },
        "when": { "annotations": { format!("^{}$", ANNOTATION.replace('.', "\\.")): ".+" } },
        "stages": ["precreate"],
    });
    std::fs::create_dir_all(dir).context(format!("creating {}", dir.display()))?;
    let path = dir.join("memloop.json");
    std::fs::write(&path, serde_json::to_string_pretty(&desc)? + "\n")
        .context(format!("writing {}", path.display()))?;
    println!(
        "installed {}: containers annotated {ANNOTATION}=REGION use memloop",
        path.display()
    );
    Ok(())
}

fn hook() -> CliResult<()> {
    let mut input = String::new();
    std::io::stdin()
        .read_to_string(&mut input)
        .context("reading the container's configuration")?;
    println!("{}", with_memloop(&input, "memloop hook")?);
    Ok(())
}

/// An OCI runtime configuration (JSON text) with memloop added if the container is annotated;
/// unchanged (and why on stderr, as `who`) when the region or library cannot be used.
fn with_memloop(input: &str, who: &str) -> CliResult<String> {
    let mut config: Value = serde_json::from_str(input)
        .map_err(|e| fail(format!("the container's configuration is not JSON: {e}")))?;
    if let Some(region) = opted_in(&config) {
        if let Err(e) = opt_in(&mut config, &region) {
            // Never in the way: the container runs as it would have without us.
            eprintln!("{who}: {e}; the container runs without memloop (kernel path)");
            return Ok(input.to_string());
        }
    }
    Ok(serde_json::to_string(&config)?)
}

/// The region a container opts in to: its annotation, else the variable [`ENV_OPT_IN`] of its
/// process environment (for engines that cannot set annotations); `None` if neither.
fn opted_in(config: &Value) -> Option<String> {
    if let Some(region) = config["annotations"][ANNOTATION].as_str() {
        return Some(region.to_string());
    }
    let prefix = format!("{ENV_OPT_IN}=");
    config["process"]["env"]
        .as_array()?
        .iter()
        .find_map(|v| v.as_str()?.strip_prefix(&prefix))
        .filter(|region| !region.is_empty())
        .map(String::from)
}

/// The name under which this binary acts as an OCI runtime (a symlink to `memloop`): for
/// engines without `precreate` hooks (docker: `"runtimes": {"memloop": {"path":
/// ".../memloop-runc"}}` in daemon.json, then `docker run --runtime memloop --annotation
/// io.memloop.region=default …`, or `-e MEMLOOP_CONTAINER_REGION=default` where docker has no
/// `--annotation`).
pub const RUNTIME_NAME: &str = "memloop-runc";

/// The opt-in as a variable of the container's environment, for engines that cannot set OCI
/// annotations (docker before 24, e.g. Debian 12's `docker.io` 20.10: `docker run --runtime
/// memloop -e MEMLOOP_CONTAINER_REGION=default …`). Its value names the region as the
/// annotation's does; the annotation wins when both are set. Only the runtime wrapper sees it:
/// the hook is called for annotated containers only.
pub const ENV_OPT_IN: &str = "MEMLOOP_CONTAINER_REGION";

/// As an OCI runtime: on `create` (or `run`) of an annotated container, adds memloop to the
/// bundle's `config.json` exactly as the hook would; then becomes the real runtime
/// (`MEMLOOP_OCI_RUNTIME`, default `runc`) with the same arguments.
pub fn runtime(args: &[std::ffi::OsString]) -> CliResult<()> {
    use std::os::unix::process::CommandExt;
    if let Some(bundle) = created_bundle(args) {
        let path = bundle.join("config.json");
        let input =
            std::fs::read_to_string(&path).context(format!("reading {}", path.display()))?;
        let output = with_memloop(&input, RUNTIME_NAME)?;
        if output != input {
            std::fs::write(&path, output).context(format!("writing {}", path.display()))?;
        }
    }
    let real = std::env::var_os("MEMLOOP_OCI_RUNTIME").unwrap_or_else(|| "runc".into());
    let e = std::process::Command::new(&real).args(args).exec();
    Err(fail(format!(
        "{RUNTIME_NAME}: cannot execute the runtime {}: {e}",
        Path::new(&real).display()
    )))
}

/// The bundle of a `create`/`run` command line (`--bundle DIR`, `-b DIR`, `--bundle=DIR`;
/// the current directory by default), or `None` for any other command.
fn created_bundle(args: &[std::ffi::OsString]) -> Option<PathBuf> {
    let args: Vec<&str> = args.iter().filter_map(|a| a.to_str()).collect();
    let at = args.iter().position(|a| *a == "create" || *a == "run")?;
    let rest = &args[at + 1..];
    for (i, a) in rest.iter().enumerate() {
        if let Some(b) = a.strip_prefix("--bundle=") {
            return Some(b.into());
        }
        if (*a == "--bundle" || *a == "-b") && i + 1 < rest.len() {
            return Some(rest[i + 1].into());
        }
    }
    std::env::current_dir().ok()
}

/// What the hook adds to `config` for a container of `region`.
fn opt_in(config: &mut Value, region: &str) -> CliResult<()> {
    let lib = crate::run::find_library()?;
    let engine = crate::run::engine_of(&lib)?;
    let spec = RegionSpec::parse(region);
    if matches!(spec, RegionSpec::Device(_) | RegionSpec::Ivshmem(_)) {
        return Err(fail(format!(
            "region {region} is a device: only a region file can be mounted into a container"
        )));
    }
    let region = Region::open_or_create(&spec, &CreateRegion::default())
        .context(format!("opening region {}", spec.path().display()))?;
    let host = region.path().to_path_buf();
    let wake = memloop::region::wake_dir(&host);
    memloop::region::make_wake_dir(&wake).context(format!("creating {}", wake.display()))?;
    // The library under its own name (the shim finds its engine beside it).
    let in_lib = |p: &Path| {
        format!(
            "{IN_DIR}/{}",
            p.file_name().unwrap_or_default().to_string_lossy()
        )
    };
    let lib_in = in_lib(&lib);
    let mut mounts = vec![
        (IN_REGION.to_string(), host, "rw"),
        (IN_WAKE.to_string(), wake, "rw"),
        (lib_in.clone(), lib.clone(), "ro"),
    ];
    if let Some(e) = engine {
        mounts.push((in_lib(&e), e, "ro"));
    }
    let list = config["mounts"]
        .as_array_mut()
        .ok_or_else(|| fail("the configuration has no mount list"))?;
    for (dest, src, mode) in mounts {
        list.push(json!({
            "destination": dest, "type": "bind", "source": src,
            "options": ["bind", mode, "nosuid", "nodev"],
        }));
    }
    let env = config["process"]["env"]
        .as_array_mut()
        .ok_or_else(|| fail("the configuration has no process environment"))?;
    set_env(env, "MEMLOOP_REGION", |_| IN_REGION.to_string());
    set_env(env, "LD_PRELOAD", |old| match old {
        Some(o) if !o.is_empty() => format!("{lib_in}:{o}"),
        _ => lib_in.clone(),
    });
    Ok(())
}

/// Sets `NAME=value(old)` in an OCI environment list (`"NAME=VALUE"` strings).
fn set_env(env: &mut Vec<Value>, name: &str, value: impl FnOnce(Option<&str>) -> String) {
    let prefix = format!("{name}=");
    let at = env
        .iter()
        .position(|v| v.as_str().is_some_and(|s| s.starts_with(&prefix)));
    let old = at.and_then(|i| env[i].as_str().map(|s| s[prefix.len()..].to_string()));
    let new = Value::String(format!("{prefix}{}", value(old.as_deref())));
    match at {
        Some(i) => env[i] = new,
        None => env.push(new),
    }
}

/// Which container a pid namespace of our kernel belongs to: the id in the cgroup path of a
/// process in it (`libpod-ID`, `docker-ID`/`docker/ID`, `crio-ID`), as engines show it
/// (12 characters). Looked up once per namespace.
#[derive(Default)]
pub struct Containers(std::collections::HashMap<u64, Option<String>>);

impl Containers {
    pub fn of_pid_ns(&mut self, pid_ns: u64) -> Option<String> {
        self.0.entry(pid_ns).or_insert_with(|| find(pid_ns)).clone()
    }
}

fn find(pid_ns: u64) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let procs = std::fs::read_dir("/proc").ok()?;
    let pid = procs
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
        })
        .find(|e| std::fs::metadata(e.path().join("ns/pid")).is_ok_and(|m| m.ino() == pid_ns))?;
    let cgroup = std::fs::read_to_string(pid.path().join("cgroup")).ok()?;
    container_id(&cgroup)
}

/// The container id in a `/proc/PID/cgroup` text, if any.
fn container_id(cgroup: &str) -> Option<String> {
    cgroup.lines().find_map(|line| {
        let path = line.splitn(3, ':').nth(2)?;
        path.split('/').find_map(|part| {
            let id = ["libpod-", "docker-", "crio-", "cri-containerd-"]
                .iter()
                .find_map(|p| part.strip_prefix(p))
                .map(|id| id.trim_end_matches(".scope"))
                .or_else(|| path.contains("/docker/").then_some(part))?;
            (id.len() >= 12 && id.bytes().all(|b| b.is_ascii_hexdigit()))
                .then(|| id[..12].to_string())
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bundle_of_a_create_is_found_in_any_spelling() {
        let args = |v: &[&str]| v.iter().map(std::ffi::OsString::from).collect::<Vec<_>>();
        let b = |v: &[&str]| created_bundle(&args(v));
        assert_eq!(
            b(&["--root", "/r", "create", "--bundle", "/b", "id"]),
            Some("/b".into())
        );
        assert_eq!(b(&["create", "-b", "/c", "id"]), Some("/c".into()));
        assert_eq!(b(&["run", "--bundle=/d", "id"]), Some("/d".into()));
        assert_eq!(b(&["--root", "/r", "start", "id"]), None);
        assert_eq!(b(&["delete", "id"]), None);
    }

    #[test]
    fn container_ids_are_read_from_engine_cgroup_paths() {
        let podman = "9:name=systemd:/libpod_parent/libpod-e2c284c1e4a39c3153de9e9e42b7db3d0e8cde2d5d6460ebabf61fab5fd0c191\n";
        assert_eq!(container_id(podman).as_deref(), Some("e2c284c1e4a3"));
        let docker = "0::/system.slice/docker-0123456789abcdef0123456789abcdef.scope\n";
        assert_eq!(container_id(docker).as_deref(), Some("0123456789ab"));
        let docker_v1 = "4:pids:/docker/fedcba9876543210fedcba9876543210\n";
        assert_eq!(container_id(docker_v1).as_deref(), Some("fedcba987654"));
        assert_eq!(container_id("0::/user.slice/session-3.scope\n"), None);
    }

    #[test]
    fn a_container_opts_in_by_annotation_or_by_its_environment() {
        let c = |v: Value| opted_in(&v);
        let env = |e: &[&str]| json!({ "process": { "env": e } });
        assert_eq!(
            c(json!({ "annotations": { ANNOTATION: "a" } })),
            Some("a".into())
        );
        assert_eq!(
            c(env(&["PATH=/bin", "MEMLOOP_CONTAINER_REGION=b"])),
            Some("b".into())
        );
        let mut both = env(&["MEMLOOP_CONTAINER_REGION=b"]);
        both["annotations"] = json!({ ANNOTATION: "a" });
        assert_eq!(c(both), Some("a".into()));
        assert_eq!(c(env(&["MEMLOOP_CONTAINER_REGION="])), None);
        assert_eq!(c(env(&["MEMLOOP_CONTAINER_REGIONS=x", "PATH=/bin"])), None);
        assert_eq!(c(json!({ "annotations": { "other": "a" } })), None);
    }

    #[test]
    fn set_env_prepends_to_an_existing_preload_and_adds_a_missing_name() {
        let mut env = vec![json!("PATH=/bin"), json!("LD_PRELOAD=/x.so")];
        set_env(&mut env, "LD_PRELOAD", |o| format!("/a.so:{}", o.unwrap()));
        set_env(&mut env, "MEMLOOP_REGION", |o| {
            assert!(o.is_none());
            "/r".into()
        });
        assert_eq!(
            env,
            vec![
                json!("PATH=/bin"),
                json!("LD_PRELOAD=/a.so:/x.so"),
                json!("MEMLOOP_REGION=/r")
            ]
        );
    }
}
