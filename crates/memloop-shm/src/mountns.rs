//! A private mount namespace for the calling process: its mounts from then on are its own,
//! and the mounts others make later are not in it.
//!
//! Why a service wants one: a FUSE server that shares its mount namespace with the users of
//! its file system may end up the last process of that namespace. Its exit then tears the
//! namespace down, unmounting whatever was mounted on top of its file (an ext4 on a loop
//! device on it), and that unmount's writeback waits for the server that is exiting: both
//! stay in D state. In a namespace of its own the server never tears down anyone else's
//! mounts.

use std::io;

/// Moves the calling process into a new mount namespace whose mounts do not propagate back
/// (`unshare(CLONE_NEWNS)`, then `/` made recursively private). Call it before any other
/// thread starts: the kernel refuses it (`EINVAL`) in a process whose threads share their
/// file-system context. Needs `CAP_SYS_ADMIN`.
pub fn enter_private() -> io::Result<()> {
    // SAFETY: `unshare` with only CLONE_NEWNS takes no pointers and touches no memory of
    // ours; it changes which mounts this process sees, nothing any thread holds.
    if unsafe { libc::unshare(libc::CLONE_NEWNS) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the pointers are NUL-terminated static strings or null, as mount(2) allows for a
    // propagation change (source, type and data are ignored).
    let r = unsafe {
        libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
