//! The one place the benchmark calls libc itself: `sendmsg` and `recvmsg` with `SCM_RIGHTS`,
//! which std does not offer on stable Rust. They must be libc's (not raw system calls), so that
//! the preload library sees them as it would any program's.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

/// A socket pair of our own, ready to carry one fd to ourselves. The copy received is taken out
/// with [`SelfPass::claim`], or closed with the pair.
pub struct SelfPass {
    tx: UnixStream,
    rx: UnixStream,
}

const FD_LEN: u32 = std::mem::size_of::<RawFd>() as u32;

/// A one-byte message with room for one fd of control data: the buffers it points into
/// (`byte`, `control`) must outlive every use of it.
fn one_fd_msg(byte: &mut [u8; 1], iov: &mut libc::iovec, control: &mut Vec<u64>) -> libc::msghdr {
    *iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: byte.len(),
    };
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(FD_LEN) } as usize;
    // u64s: the control buffer must be aligned for a cmsghdr.
    *control = vec![0u64; space.div_ceil(8)];
    // SAFETY: msghdr is plain data; all-zero is a valid (empty) value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    msg
}

impl SelfPass {
    pub fn new() -> io::Result<SelfPass> {
        let (tx, rx) = UnixStream::pair()?;
        Ok(SelfPass { tx, rx })
    }

    /// Sends `fd` (one byte of data with it) to the other end of the pair.
    pub fn send(&self, fd: RawFd) -> io::Result<()> {
        let (mut byte, mut control) = ([b'x'], Vec::new());
        let mut iov = libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        };
        let msg = one_fd_msg(&mut byte, &mut iov, &mut control);
        // SAFETY: msg points at a control buffer of CMSG_SPACE(FD_LEN) bytes, so the first
        // header is non-null and has room for one fd of data after it.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(FD_LEN) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>(), fd);
        }
        // SAFETY: msg and everything it points to (iov, byte, control) live across the call.
        let n = unsafe { libc::sendmsg(self.tx.as_raw_fd(), &msg, 0) };
        match n {
            1 => Ok(()),
            -1 => Err(io::Error::last_os_error()),
            n => Err(io::Error::other(format!("sendmsg sent {n} bytes, not 1"))),
        }
    }

    /// Takes the fd sent out of the pair (a `recvmsg` with room for one fd, which the preload
    /// sees as a receiver claiming it: the sender's in-flight hold is given back). `None` if
    /// the message carried no fd.
    pub fn claim(&self) -> io::Result<Option<OwnedFd>> {
        let (mut byte, mut control) = ([0u8], Vec::new());
        let mut iov = libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        };
        let mut msg = one_fd_msg(&mut byte, &mut iov, &mut control);
        // SAFETY: msg and everything it points to live across the call.
        let n = unsafe { libc::recvmsg(self.rx.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the kernel filled msg's control buffer; CMSG_FIRSTHDR checks its length.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            if cmsg.is_null()
                || (*cmsg).cmsg_level != libc::SOL_SOCKET
                || (*cmsg).cmsg_type != libc::SCM_RIGHTS
            {
                return Ok(None);
            }
            let fd = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>());
            // The kernel installed it for us: ours to close.
            Ok(Some(OwnedFd::from_raw_fd(fd)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    #[test]
    fn a_passed_socket_stays_usable_here() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let pass = SelfPass::new().unwrap();
        pass.send(a.as_raw_fd()).unwrap();
        a.write_all(b"ok").unwrap();
        let mut got = [0u8; 2];
        b.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"ok");
        // The copy claimed is the same socket.
        let copy = UnixStream::from(pass.claim().unwrap().expect("an fd"));
        (&copy).write_all(b"2").unwrap();
        b.read_exact(&mut got[..1]).unwrap();
        assert_eq!(got[0], b'2');
    }
}
