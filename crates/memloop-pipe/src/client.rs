//! A client of the pipe service: hand it a source, a sink and a length; learn when the bytes
//! have moved. Blocking ([`Client::pipe`]) or not ([`Client::submit`] or
//! [`Client::submit_at`], then [`Client::completion`] when [`Client::as_fd`] polls readable).

use crate::transfer::Primitive;
use crate::wire::{self, ToClient, ToService};
use crate::{socket, PipeError};
use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;

/// A connection to the service, as one tenant.
pub struct Client {
    sock: OwnedFd,
    tenant: String,
    weight: u16,
    next_id: u64,
    /// Completions read while waiting for another one.
    early: VecDeque<Completion>,
}

/// The end of a submitted transfer.
#[derive(Debug)]
pub struct Completion {
    pub id: u64,
    /// Bytes written to the sink (also when it failed part way).
    pub moved: u64,
    pub result: Result<(), PipeError>,
    /// The primitive it ended with (none if it never started).
    pub primitive: Option<Primitive>,
}

impl Client {
    /// Connects to the service at `socket` as tenant `tenant` (`None`: the service names it
    /// after our control group), asking for `weight` (the service may override it).
    pub fn connect(socket: &Path, tenant: Option<&str>, weight: u16) -> Result<Client, PipeError> {
        let sock = socket::connect(socket)?;
        let hello = ToService::Hello {
            version: wire::VERSION,
            weight,
            name: tenant.unwrap_or_default().into(),
        };
        socket::send(sock.as_fd(), &hello.encode(), &[])?;
        match read(sock.as_fd())? {
            ToClient::Welcome {
                version: wire::VERSION,
                weight,
                tenant,
            } => Ok(Client {
                sock,
                tenant,
                weight,
                next_id: 0,
                early: VecDeque::new(),
            }),
            ToClient::Refused { reason } => Err(PipeError::Refused(reason)),
            m => Err(PipeError::Protocol(format!("a reply to hello of {m:?}"))),
        }
    }

    /// Bounds every wait for the service's answers (`None`: wait as long as it takes);
    /// a wait that runs out is an `Io` error of kind `WouldBlock`.
    pub fn set_timeout(&mut self, t: Option<std::time::Duration>) -> Result<(), PipeError> {
        rustix::net::sockopt::set_socket_timeout(
            &self.sock,
            rustix::net::sockopt::Timeout::Recv,
            t,
        )?;
        Ok(())
    }

    /// The tenant the service charges us to, and its weight.
    pub fn tenant(&self) -> (&str, u16) {
        (&self.tenant, self.weight)
    }

    /// Moves `len` bytes (`None`: until the source ends) from `src` to `dst` and waits. The
    /// descriptors' file positions advance as with `sendfile`. Returns the bytes moved.
    pub fn pipe(
        &mut self,
        src: BorrowedFd<'_>,
        dst: BorrowedFd<'_>,
        len: Option<u64>,
    ) -> Result<u64, PipeError> {
        let id = self.submit(src, dst, len)?;
        let c = self.wait_for(id)?;
        c.result.map(|()| c.moved)
    }

    /// Starts a transfer; its [`Completion`] comes later. Blocks only if the service has
    /// this client's maximum in flight already (push-back).
    pub fn submit(
        &mut self,
        src: BorrowedFd<'_>,
        dst: BorrowedFd<'_>,
        len: Option<u64>,
    ) -> Result<u64, PipeError> {
        self.submit_at(src, dst, len, None)
    }

    /// [`Client::submit`] reading the source at `src_off` (`sendfile` with an offset): the
    /// source must then be a regular file, and its file position is left where it was — the
    /// transfer's end is `src_off` + the bytes moved. `None`: at the file's own position,
    /// which advances.
    pub fn submit_at(
        &mut self,
        src: BorrowedFd<'_>,
        dst: BorrowedFd<'_>,
        len: Option<u64>,
        src_off: Option<u64>,
    ) -> Result<u64, PipeError> {
        if len == Some(0) {
            return Err(PipeError::BadLength(0));
        }
        if src_off.is_some_and(|o| o > i64::MAX as u64) {
            return Err(PipeError::Io(rustix::io::Errno::INVAL.into()));
        }
        self.next_id += 1;
        let id = self.next_id;
        let m = ToService::Submit { id, len, src_off };
        socket::send(self.sock.as_fd(), &m.encode(), &[src, dst])?;
        Ok(id)
    }

    /// Asks the service to stop transfer `id` (its completion says `Cancelled`, or how it
    /// ended if it was already done).
    pub fn cancel(&mut self, id: u64) -> Result<(), PipeError> {
        socket::send(self.sock.as_fd(), &ToService::Cancel { id }.encode(), &[])
    }

    /// The next completion: waits for one if `wait`, else `None` when there is none yet.
    pub fn completion(&mut self, wait: bool) -> Result<Option<Completion>, PipeError> {
        if let Some(c) = self.early.pop_front() {
            return Ok(Some(c));
        }
        let p = match wait {
            true => socket::recv(self.sock.as_fd(), wire::MAX_PACKET),
            false => match socket::recv_now(self.sock.as_fd(), wire::MAX_PACKET) {
                Err(PipeError::Io(e)) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    return Ok(None)
                }
                r => r,
            },
        }?;
        let Some(p) = p else {
            return Err(gone());
        };
        match ToClient::decode(&p.bytes)? {
            ToClient::Done(d) => Ok(Some(completion_of(d))),
            m => Err(PipeError::Protocol(format!(
                "expected a completion, got {m:?}"
            ))),
        }
    }

    /// Waits for transfer `id`'s completion (keeping others for [`Client::completion`]).
    pub fn wait_for(&mut self, id: u64) -> Result<Completion, PipeError> {
        if let Some(i) = self.early.iter().position(|c| c.id == id) {
            return Ok(self.early.remove(i).expect("found"));
        }
        loop {
            let p = socket::recv(self.sock.as_fd(), wire::MAX_PACKET)?.ok_or_else(gone)?;
            match ToClient::decode(&p.bytes)? {
                ToClient::Done(d) if d.id == id => return Ok(completion_of(d)),
                ToClient::Done(d) => self.early.push_back(completion_of(d)),
                m => return Err(PipeError::Protocol(format!("unexpected {m:?}"))),
            }
        }
    }

    /// The service's statistics (JSON). Waits for them, keeping completions that arrive
    /// first.
    pub fn stats(&mut self) -> Result<String, PipeError> {
        socket::send(self.sock.as_fd(), &ToService::Stats.encode(), &[])?;
        loop {
            let p = socket::recv(self.sock.as_fd(), wire::MAX_PACKET)?.ok_or_else(gone)?;
            match ToClient::decode(&p.bytes)? {
                ToClient::StatsReply { json } => return Ok(json),
                ToClient::Done(d) => self.early.push_back(completion_of(d)),
                m => return Err(PipeError::Protocol(format!("unexpected {m:?}"))),
            }
        }
    }
}

impl AsFd for Client {
    /// Readable when a completion (or the service's end) is there.
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.sock.as_fd()
    }
}

fn read(sock: BorrowedFd<'_>) -> Result<ToClient, PipeError> {
    let p = socket::recv(sock, wire::MAX_PACKET)?.ok_or_else(gone)?;
    ToClient::decode(&p.bytes)
}

fn gone() -> PipeError {
    PipeError::Io(std::io::Error::new(
        std::io::ErrorKind::ConnectionAborted,
        "the pipe service went away",
    ))
}

fn completion_of(d: wire::Done) -> Completion {
    let result = match d.errno {
        0 => Ok(()),
        e if e == rustix::io::Errno::CANCELED.raw_os_error() => Err(PipeError::Cancelled),
        e => Err(PipeError::Io(std::io::Error::from_raw_os_error(e))),
    };
    Completion {
        id: d.id,
        moved: d.moved,
        result,
        primitive: d.primitive,
    }
}
