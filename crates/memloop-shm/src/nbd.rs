//! The kernel's NBD client driven through its `ioctl`s: a `/dev/nbdN` device is given one end
//! of a socket (`NBD_SET_SOCK`), its geometry and flags, and then serves block I/O over that
//! socket while a thread sits in `NBD_DO_IT`. This module only wraps the `ioctl`s (the unsafe
//! part); the protocol spoken on the socket lives with its user.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::path::{Path, PathBuf};

// `_IO(0xab, n)` of linux/nbd.h.
const NBD_SET_SOCK: libc::c_ulong = 0xab00;
const NBD_SET_BLKSIZE: libc::c_ulong = 0xab01;
const NBD_DO_IT: libc::c_ulong = 0xab03;
const NBD_CLEAR_SOCK: libc::c_ulong = 0xab04;
const NBD_CLEAR_QUE: libc::c_ulong = 0xab05;
const NBD_SET_SIZE_BLOCKS: libc::c_ulong = 0xab07;
const NBD_DISCONNECT: libc::c_ulong = 0xab08;
const NBD_SET_TIMEOUT: libc::c_ulong = 0xab09;
const NBD_SET_FLAGS: libc::c_ulong = 0xab0a;

/// Transmission flags (`NBD_FLAG_*`), as the server would announce them.
pub mod flags {
    pub const HAS_FLAGS: u64 = 1 << 0;
    pub const READ_ONLY: u64 = 1 << 1;
    pub const SEND_FLUSH: u64 = 1 << 2;
    pub const SEND_FUA: u64 = 1 << 3;
    pub const SEND_TRIM: u64 = 1 << 5;
}

/// An NBD device we opened.
pub struct NbdDevice {
    file: File,
    path: PathBuf,
}

/// How the device is set up.
#[derive(Clone, Copy, Debug)]
pub struct NbdGeometry {
    pub block_size: u32,
    pub size: u64,
    /// [`flags`].
    pub flags: u64,
}

impl NbdDevice {
    /// Opens `path` (`/dev/nbdN`).
    pub fn open(path: &Path) -> io::Result<NbdDevice> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        Ok(NbdDevice {
            file,
            path: path.into(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Gives the device `sock` (it takes its own reference) and the geometry. `EBUSY` if
    /// the device already has a socket.
    pub fn configure(&self, sock: BorrowedFd<'_>, g: NbdGeometry) -> io::Result<()> {
        if g.block_size == 0 || g.size % u64::from(g.block_size) != 0 {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        }
        self.call(NBD_SET_SOCK, sock.as_raw_fd() as libc::c_ulong)?;
        let set = || -> io::Result<()> {
            self.call(NBD_SET_BLKSIZE, libc::c_ulong::from(g.block_size))?;
            let blocks = g.size / u64::from(g.block_size);
            self.call(NBD_SET_SIZE_BLOCKS, blocks as libc::c_ulong)?;
            // Our own I/O timeout governs; the kernel's would tear the socket down.
            self.call(NBD_SET_TIMEOUT, 0)?;
            self.call(NBD_SET_FLAGS, g.flags as libc::c_ulong)
                .map(|_| ())
        };
        set().inspect_err(|_| {
            let _ = self.call(NBD_CLEAR_SOCK, 0);
        })
    }

    /// Serves the device until the socket closes or [`NbdDevice::disconnect`]: blocks the
    /// calling thread. Clears the device's queue and socket on the way out.
    pub fn run(&self) -> io::Result<()> {
        let r = self.call(NBD_DO_IT, 0);
        let _ = self.call(NBD_CLEAR_QUE, 0);
        let _ = self.call(NBD_CLEAR_SOCK, 0);
        r.map(|_| ())
    }

    /// Asks the device to disconnect: it sends `NBD_CMD_DISC` on the socket, and
    /// [`NbdDevice::run`] returns once the socket closes.
    pub fn disconnect(&self) -> io::Result<()> {
        self.call(NBD_DISCONNECT, 0).map(|_| ())
    }

    fn call(&self, req: libc::c_ulong, arg: libc::c_ulong) -> io::Result<libc::c_int> {
        let fd = self.file.as_fd().as_raw_fd();
        // SAFETY: every NBD ioctl used here takes its argument by value (an integer or a
        // descriptor number), never through a pointer; `fd` is open while `self` lives.
        let ret = unsafe { libc::ioctl(fd, req as _, arg) };
        if ret < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(ret)
        }
    }
}

/// The NBD devices of this kernel (`/dev/nbd0`, …) that have no server now (no `pid` in
/// sysfs), in order; empty without the `nbd` module.
pub fn free_devices() -> Vec<PathBuf> {
    let mut v: Vec<(u32, PathBuf)> = std::fs::read_dir("/sys/block")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let n = name.strip_prefix("nbd")?.parse::<u32>().ok()?;
            let busy = e.path().join("pid").exists();
            let dev = PathBuf::from(format!("/dev/{name}"));
            (!busy && dev.exists()).then_some((n, dev))
        })
        .collect();
    v.sort();
    v.into_iter().map(|x| x.1).collect()
}
