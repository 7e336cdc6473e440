//! The kernel paths memloop is compared with: a Unix stream socket and loopback TCP, each to a
//! peer process (as memloop's peer is), both ends blocking as a plain application would be.

use super::proto::Conn;
use super::sys::{wait_for, Peer};
use super::Link;
use crate::error::{CliResult, Context};
use std::io;
use std::net::{TcpListener, TcpStream};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};

/// Abstract-namespace name of the Unix socket: no file to clean up.
pub fn unix_name() -> String {
    format!("memloop-bench-{}", std::process::id())
}

pub fn unix_addr(name: &str) -> io::Result<SocketAddr> {
    SocketAddr::from_abstract_name(name.as_bytes())
}

/// A connected AF_UNIX stream pair: the same kernel path as a socketpair, across two processes.
pub fn unix(peer_args: &[String]) -> CliResult<Link> {
    let name = unix_name();
    let listener =
        UnixListener::bind_addr(&unix_addr(&name)?).context("binding the Unix socket")?;
    listener.set_nonblocking(true)?;
    let mut args = vec!["--path".into(), "unix".into(), "--addr".into(), name];
    args.extend_from_slice(peer_args);
    let mut peer = Peer::spawn(&args)?;
    let conn = wait_for(&mut peer, "the Unix peer to connect", || {
        accept(listener.accept())
    })?;
    conn.set_nonblocking(false)?;
    Ok(Link::new("unix", Box::new(conn), peer))
}

pub fn tcp(peer_args: &[String]) -> CliResult<Link> {
    let listener = TcpListener::bind("127.0.0.1:0").context("binding loopback TCP")?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?.to_string();
    let mut args = vec!["--path".into(), "tcp".into(), "--addr".into(), addr];
    args.extend_from_slice(peer_args);
    let mut peer = Peer::spawn(&args)?;
    let conn = wait_for(&mut peer, "the TCP peer to connect", || {
        accept(listener.accept())
    })?;
    conn.set_nonblocking(false)?;
    conn.set_nodelay(true)?;
    Ok(Link::new("tcp-loopback", Box::new(conn), peer))
}

fn accept<S, A>(r: io::Result<(S, A)>) -> CliResult<Option<S>> {
    match r {
        Ok((s, _)) => Ok(Some(s)),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// The peer's end of a baseline path.
pub fn connect(path: &str, addr: &str) -> CliResult<Box<dyn Conn>> {
    if path == "unix" {
        let s =
            UnixStream::connect_addr(&unix_addr(addr)?).context("connecting the Unix socket")?;
        return Ok(Box::new(s));
    }
    let s = TcpStream::connect(addr).context(format!("connecting to {addr}"))?;
    s.set_nodelay(true)?;
    Ok(Box::new(s))
}
