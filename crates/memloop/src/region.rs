//! Opening, creating and destroying regions by name or path.
//!
//! Creation race: the file is created with O_EXCL, so exactly one process sizes and initialises
//! it, holding an exclusive `flock` meanwhile. Everyone else opens the file, takes a shared lock
//! (which waits for the initialiser) and attaches. If the initialiser died before writing the
//! magic, the next opener finds the lock free and the magic absent, and initialises it itself.
//! Devices (an ivshmem BAR inside a guest) cannot be created or locked across kernels: they are
//! initialised by the host and only attached here, unless explicitly initialised.

use crate::error::Error;
use memloop_registry::{RegionParams, Registry, RegistryError};
use memloop_shm::{Backend, CreateOptions, Mapping, MappingError};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Where a region lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegionSpec {
    /// `/dev/shm/memloop-NAME` (the default back-end).
    Named(String),
    /// A regular file at this path (e.g. on another tmpfs).
    File(PathBuf),
    /// A file on a hugetlbfs mount.
    Hugetlbfs(PathBuf),
    /// Any mappable file or device, e.g. `/sys/bus/pci/devices/0000:00:04.0/resource2`.
    Device(PathBuf),
    /// Inside a VM: the ivshmem PCI device at this address, or the only one (see [`crate::ivshmem`]).
    Ivshmem(Option<String>),
}

impl RegionSpec {
    /// The region named by `MEMLOOP_REGION` (a name, or a path if it contains '/'), else the
    /// default region: "default" for root and for every user who may open it (the `memloop`
    /// group of the package, mode 660), "default-UID" for a user who may not — so that two
    /// users never collide on one file only one of them can use.
    pub fn from_env() -> Self {
        match std::env::var("MEMLOOP_REGION") {
            Ok(v) => Self::parse(&v),
            Err(_) => Self::Named(default_name()),
        }
    }

    /// `ivshmem` or `ivshmem:BDF` (a VM's ivshmem device), a name, or a path if it contains '/':
    /// a path on hugetlbfs is [`Self::Hugetlbfs`], a path under /sys or /dev (except /dev/shm)
    /// is a [`Self::Device`], anything else a [`Self::File`].
    pub fn parse(s: &str) -> Self {
        if s == "ivshmem" {
            return Self::Ivshmem(None);
        }
        if let Some(bdf) = s.strip_prefix("ivshmem:") {
            return Self::Ivshmem(Some(bdf.to_string()));
        }
        if !s.contains('/') {
            return Self::Named(s.to_string());
        }
        let p = PathBuf::from(s);
        if is_hugetlbfs(&p) {
            Self::Hugetlbfs(p)
        } else if p.starts_with("/sys") || (p.starts_with("/dev") && !p.starts_with("/dev/shm")) {
            Self::Device(p)
        } else {
            Self::File(p)
        }
    }

    pub fn path(&self) -> PathBuf {
        match self {
            Self::Named(n) => PathBuf::from(format!("/dev/shm/memloop-{n}")),
            Self::File(p) | Self::Hugetlbfs(p) | Self::Device(p) => p.clone(),
            Self::Ivshmem(bdf) => PathBuf::from(format!(
                "/sys/bus/pci/devices/{}/resource2",
                bdf.as_deref().unwrap_or("<ivshmem>")
            )),
        }
    }

    /// The spec with an ivshmem device looked up: a [`Self::Device`].
    pub fn resolve(&self) -> Result<Self, Error> {
        match self {
            Self::Ivshmem(bdf) => Ok(Self::Device(crate::ivshmem::find(bdf.as_deref())?)),
            other => Ok(other.clone()),
        }
    }

    fn backend(&self) -> Backend {
        match self {
            Self::Named(_) | Self::File(_) => Backend::File,
            Self::Hugetlbfs(_) => Backend::Hugetlbfs,
            Self::Device(_) | Self::Ivshmem(_) => Backend::Device,
        }
    }
}

/// The directory of a region's wake sockets (`<region file>.wake`): the library's per-member
/// sockets live there, `destroy` removes it, a container gets it mounted.
pub fn wake_dir(region: &Path) -> PathBuf {
    let mut dir = region.as_os_str().to_owned();
    dir.push(".wake");
    dir.into()
}

/// Makes a wake directory (if missing), open to every user as `/tmp` is: members may run as
/// different users, and only a socket's owner may remove it.
pub fn make_wake_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    match std::fs::DirBuilder::new().mode(0o1777).create(dir) {
        // (The umask narrowed the mode.)
        Ok(()) => std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o1777)),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e),
    }
}

/// The default region's name for this process (see [`RegionSpec::from_env`]).
fn default_name() -> String {
    use rustix::fs::{accessat, Access, AtFlags, CWD};
    let uid = rustix::process::geteuid();
    let shared = RegionSpec::Named("default".into()).path();
    let may = accessat(
        CWD,
        &shared,
        Access::READ_OK | Access::WRITE_OK,
        AtFlags::EACCESS,
    );
    default_for(uid.is_root(), may, uid.as_raw())
}

/// "default" unless a user other than root may not open an existing one.
fn default_for(root: bool, may: rustix::io::Result<()>, uid: u32) -> String {
    match may {
        _ if root => "default".into(),
        Ok(()) | Err(rustix::io::Errno::NOENT) => "default".into(),
        Err(_) => format!("default-{uid}"),
    }
}

fn is_hugetlbfs(p: &Path) -> bool {
    let dir = p.parent().unwrap_or(p);
    rustix::fs::statfs(dir)
        .map(|s| s.f_type == 0x958458f6)
        .unwrap_or(false)
}

/// Options for creating a region.
#[derive(Debug, Clone)]
pub struct CreateRegion {
    pub params: RegionParams,
    pub mode: u32,
    pub gid: Option<u32>,
}

impl Default for CreateRegion {
    fn default() -> Self {
        Self {
            params: RegionParams::default(),
            mode: 0o660,
            gid: None,
        }
    }
}

/// An attached region: the mapping and the registry inside it.
#[derive(Clone)]
pub struct Region {
    spec: RegionSpec,
    mapping: Arc<Mapping>,
    registry: Registry,
}

/// How long an opener waits for a concurrent creator to size and initialise the file.
const INIT_WAIT: Duration = Duration::from_secs(5);

impl Region {
    /// Opens an existing region; fails with [`Error::NoRegion`] if there is none.
    pub fn open(spec: &RegionSpec) -> Result<Self, Error> {
        let spec = &spec.resolve()?;
        let mapping = Self::map_existing(spec)?;
        let registry = if spec.backend() == Backend::Device {
            Registry::attach(mapping.view())?
        } else {
            attach_or_finish_init(&mapping, None)?
        };
        Ok(Self {
            spec: spec.clone(),
            mapping,
            registry,
        })
    }

    /// Creates the region if it does not exist (exactly one concurrent caller initialises it),
    /// else opens it. For devices, initialises the memory if it holds no region yet.
    pub fn open_or_create(spec: &RegionSpec, opts: &CreateRegion) -> Result<Self, Error> {
        opts.params.validate()?;
        let spec = &spec.resolve()?;
        if spec.backend() == Backend::Device {
            return Self::init_device(spec, opts, false);
        }
        let path = spec.path();
        let copts = CreateOptions {
            size: opts.params.size,
            mode: opts.mode,
            gid: opts.gid,
            locked: true,
        };
        match Mapping::create_new(&path, spec.backend(), &copts) {
            Ok(mapping) => {
                let registry = init_locked(&mapping, &opts.params).inspect_err(|_| {
                    // Ours alone (made exclusively, still locked): nobody may find it half-made.
                    let _ = std::fs::remove_file(&path);
                })?;
                tracing::debug!(path = %path.display(), "created region");
                Ok(Self {
                    spec: spec.clone(),
                    mapping,
                    registry,
                })
            }
            Err(MappingError::Exists { .. }) => {
                let mapping = Self::map_existing(spec)?;
                let registry = attach_or_finish_init(&mapping, Some(&opts.params))?;
                Ok(Self {
                    spec: spec.clone(),
                    mapping,
                    registry,
                })
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Initialises a device-backed region; with `force`, even over an existing one.
    pub fn init_device(spec: &RegionSpec, opts: &CreateRegion, force: bool) -> Result<Self, Error> {
        let spec = &spec.resolve()?;
        let mapping = Mapping::open(&spec.path(), Backend::Device, true)?;
        let registry = match Registry::attach(mapping.view()) {
            Ok(r) if !force => r,
            _ => {
                let params = opts.params.resized(mapping.len() as u64);
                mapping.view().fill(0, mapping.len() as u64, 0)?;
                Registry::init(mapping.view(), &params)?
            }
        };
        Ok(Self {
            spec: spec.clone(),
            mapping,
            registry,
        })
    }

    fn map_existing(spec: &RegionSpec) -> Result<Arc<Mapping>, Error> {
        let path = spec.path();
        let deadline = Instant::now() + INIT_WAIT;
        loop {
            match Mapping::open(&path, spec.backend(), true) {
                // A creator has made the file but not sized it yet.
                Err(MappingError::Empty { .. }) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(1))
                }
                Err(MappingError::NotFound { .. }) => return Err(Error::NoRegion(path)),
                other => return Ok(other?),
            }
        }
    }

    /// Removes the region's file. Members that have it mapped keep their mapping until they exit.
    pub fn destroy(spec: &RegionSpec) -> Result<(), Error> {
        let spec = &spec.resolve()?;
        if spec.backend() == Backend::Device {
            let mapping = Mapping::open(&spec.path(), Backend::Device, true)?;
            mapping.view().fill(0, mapping.len() as u64, 0)?;
            return Ok(());
        }
        std::fs::remove_file(spec.path()).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => Error::NoRegion(spec.path()),
            _ => Error::Io(e),
        })?;
        // The members' wake sockets, if any were made: names only.
        let _ = std::fs::remove_dir_all(wake_dir(&spec.path()));
        Ok(())
    }

    /// The mapping of the whole region (zero-copy pools are mapped from its file).
    pub(crate) fn mapping(&self) -> &Arc<Mapping> {
        &self.mapping
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }
    pub fn spec(&self) -> &RegionSpec {
        &self.spec
    }
    pub fn path(&self) -> &Path {
        self.mapping.path()
    }
    pub fn size(&self) -> u64 {
        self.mapping.len() as u64
    }
    /// The open region file, where members hold their liveness locks (not on a device: a
    /// region shared with other kernels is judged by heartbeats there).
    pub(crate) fn lock_file(&self) -> Option<&std::fs::File> {
        (self.spec.backend() != Backend::Device).then(|| self.mapping.file())
    }

    /// Whether futexes work on this memory: not on a device mapping (an ivshmem BAR is not
    /// page-backed, so the kernel refuses futexes there even between processes of one guest).
    pub fn futex_usable(&self) -> bool {
        self.spec.backend() != Backend::Device
    }

    /// The region is a device mapping (the ivshmem BAR in a guest): no pages behind it, so
    /// kernel paths that pin user pages (FUSE's device, O_DIRECT) cannot use its memory.
    pub fn device_backed(&self) -> bool {
        self.spec.backend() == Backend::Device
    }
}

/// Initialises a freshly created file; it was created locked, so openers wait for us.
fn init_locked(mapping: &Arc<Mapping>, params: &RegionParams) -> Result<Registry, Error> {
    let r = Registry::init(mapping.view(), params);
    mapping.unlock();
    Ok(r?)
}

/// Attaches to a region some other process created; waits for its initialiser (via the lock)
/// and takes over initialisation if that process died first (lock free, magic absent).
fn attach_or_finish_init(
    mapping: &Arc<Mapping>,
    params: Option<&RegionParams>,
) -> Result<Registry, Error> {
    match Registry::attach(mapping.view()) {
        Err(RegistryError::NotInitialised) => {}
        other => return Ok(other?),
    }
    mapping.lock(false)?;
    let result = match Registry::attach(mapping.view()) {
        Err(RegistryError::NotInitialised) => {
            tracing::debug!(path = %mapping.path().display(), "initialiser died: finishing init");
            let size = mapping.len() as u64;
            let params = params.copied().unwrap_or_default().resized(size);
            // `init` clears the header and tables; the ring heap is not touched (a sparse
            // file of gigabytes: zeroing it would take that much memory).
            Ok(Registry::init(mapping.view(), &params)?)
        }
        other => other.map_err(Error::from),
    };
    mapping.unlock();
    result
}

#[cfg(test)]
mod tests {
    use super::default_for;
    use rustix::io::Errno;

    #[test]
    fn the_default_region_is_shared_unless_a_user_may_not_open_it() {
        assert_eq!(default_for(true, Err(Errno::ACCESS), 0), "default");
        assert_eq!(default_for(false, Ok(()), 1000), "default");
        assert_eq!(default_for(false, Err(Errno::NOENT), 1000), "default");
        assert_eq!(default_for(false, Err(Errno::ACCESS), 1000), "default-1000");
        assert_eq!(default_for(false, Err(Errno::PERM), 65534), "default-65534");
    }
}
