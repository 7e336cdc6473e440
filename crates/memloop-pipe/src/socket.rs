//! Packets with descriptors over a Unix `SOCK_SEQPACKET` socket: one message per packet, so no
//! framing, and a dead peer reads as end of file.

use crate::PipeError;
use rustix::net::{
    self, AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketAddrUnix, SocketFlags, SocketType,
};
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;

/// Most descriptors a packet may carry (a submission has two).
pub const MAX_FDS: usize = 2;

/// A connected socket to the service at `path`.
pub fn connect(path: &Path) -> Result<OwnedFd, PipeError> {
    let no_service = |e: std::io::Error| PipeError::NoService {
        path: path.display().to_string(),
        source: e,
    };
    let addr = SocketAddrUnix::new(path).map_err(|e| no_service(e.into()))?;
    let fd = seqpacket()?;
    net::connect(&fd, &addr).map_err(|e| no_service(e.into()))?;
    Ok(fd)
}

/// A listening socket at `path` (an old socket file there is replaced).
pub fn listen(path: &Path) -> Result<OwnedFd, PipeError> {
    let _ = std::fs::remove_file(path);
    let addr = SocketAddrUnix::new(path)?;
    let fd = seqpacket()?;
    net::bind(&fd, &addr)?;
    net::listen(&fd, 128)?;
    Ok(fd)
}

fn seqpacket() -> rustix::io::Result<OwnedFd> {
    net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )
}

/// Sends one packet with `fds` attached. `MSG_NOSIGNAL`: a dead peer is an error, not a
/// signal.
pub fn send(sock: BorrowedFd<'_>, packet: &[u8], fds: &[BorrowedFd<'_>]) -> Result<(), PipeError> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(PipeError::Protocol(format!(
            "{} descriptors in one packet",
            fds.len()
        )));
    }
    let n = net::sendmsg(
        sock,
        &[IoSlice::new(packet)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    match n == packet.len() {
        true => Ok(()),
        false => Err(PipeError::Protocol(format!(
            "sent {n} of a {}-byte packet",
            packet.len()
        ))),
    }
}

/// A received packet and the descriptors that came with it; `None` at end of file.
pub struct Packet {
    pub bytes: Vec<u8>,
    pub fds: Vec<OwnedFd>,
}

/// Receives one packet of at most `max` bytes, waiting for it; `None` at end of file.
pub fn recv(sock: BorrowedFd<'_>, max: usize) -> Result<Option<Packet>, PipeError> {
    recv_flags(sock, max, RecvFlags::CMSG_CLOEXEC)
}

/// [`recv`] that does not wait: `Err(Io(WouldBlock))` when nothing is there.
pub fn recv_now(sock: BorrowedFd<'_>, max: usize) -> Result<Option<Packet>, PipeError> {
    recv_flags(sock, max, RecvFlags::CMSG_CLOEXEC | RecvFlags::DONTWAIT)
}

fn recv_flags(
    sock: BorrowedFd<'_>,
    max: usize,
    flags: RecvFlags,
) -> Result<Option<Packet>, PipeError> {
    let mut buf = vec![0u8; max];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = loop {
        match net::recvmsg(
            sock.as_fd(),
            &mut [IoSliceMut::new(&mut buf)],
            &mut control,
            flags,
        ) {
            Err(rustix::io::Errno::INTR) => continue,
            r => break r?,
        }
    };
    // Descriptors first: they are ours to close whatever the packet says.
    let mut fds = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(it) = m {
            fds.extend(it);
        }
    }
    if got.flags.contains(net::ReturnFlags::CTRUNC) {
        return Err(PipeError::Protocol(
            "more descriptors than a packet may carry".into(),
        ));
    }
    if got.flags.contains(net::ReturnFlags::TRUNC) {
        return Err(PipeError::Protocol(
            "a packet larger than the protocol allows".into(),
        ));
    }
    if got.bytes == 0 && fds.is_empty() {
        return Ok(None);
    }
    buf.truncate(got.bytes);
    Ok(Some(Packet { bytes: buf, fds }))
}
