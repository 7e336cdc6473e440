//! After `exec`: sockets inherited from the previous program image that were ring
//! connections are found again by their 4-tuple in the registry and keep using their rings
//! (the new image would otherwise read the doorbell bytes as data). Inherited epoll sets are
//! registered too, so waits on them filter our tagged registrations.

use crate::agree::canonical;
use crate::conn::{side_of_socket, Conn, ConnParts};
use crate::engine;
use crate::epoll::Target;
use crate::listen::Listener;
use crate::real;
use crate::table::{self, Entry};
use memloop::registry::ChannelState;

/// Inherited fds: connected and listening inet stream sockets, and epoll sets.
#[derive(Default)]
struct Inherited {
    conns: Vec<i32>,
    listeners: Vec<i32>,
    epolls: Vec<i32>,
}

fn inherited() -> Inherited {
    let mut found = Inherited::default();
    let dir = match std::fs::read_dir("/proc/self/fd") {
        Ok(d) => d,
        Err(e) => {
            tracing::debug!(%e, "no /proc/self/fd: inherited connections stay on TCP");
            return found;
        }
    };
    // Entries that vanish or do not name an fd are fds closed meanwhile: nothing to adopt.
    for e in dir.flatten() {
        let Some(fd) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        // The file type first (one fstat): most fds are files, pipes or terminals, and a
        // readlink of /proc costs several times more. Only type-less (anonymous) inodes may be
        // epoll sets.
        match fd_kind(fd) {
            FdKind::Socket => {}
            FdKind::Anon => {
                let link = std::fs::read_link(e.path()).unwrap_or_default();
                if link.as_os_str() == "anon_inode:[eventpoll]" {
                    found.epolls.push(fd);
                }
                continue;
            }
            FdKind::Other => continue,
        }
        let domain = real::sockopt_int(fd, libc::SOL_SOCKET, libc::SO_DOMAIN);
        let stream =
            real::sockopt_int(fd, libc::SOL_SOCKET, libc::SO_TYPE) == Some(libc::SOCK_STREAM);
        if !stream || !matches!(domain, Some(libc::AF_INET) | Some(libc::AF_INET6)) {
            continue;
        }
        if real::sockopt_int(fd, libc::SOL_SOCKET, libc::SO_ACCEPTCONN) == Some(1) {
            found.listeners.push(fd);
        } else if real::peer_addr(fd).is_some() {
            found.conns.push(fd);
        }
    }
    found
}

enum FdKind {
    Socket,
    /// An anonymous inode (epoll, eventfd, timerfd, signalfd, …): no file type.
    Anon,
    Other,
}

fn fd_kind(fd: i32) -> FdKind {
    let Some(st) = real::fstat_mode(fd) else {
        return FdKind::Other;
    };
    match st & libc::S_IFMT {
        libc::S_IFSOCK => FdKind::Socket,
        0 => FdKind::Anon,
        _ => FdKind::Other,
    }
}

/// Epoll sets inherited across exec: known from now on, and their registrations of ring
/// connections (and of nested sets) taken over with the events and data the program gave —
/// a hooked `exec` put those back in the kernel. A tag of the previous image means it exec'd
/// another way: that registration's program data is lost, so it is removed and logged rather
/// than reported with a data word the program never gave.
fn adopt_epolls(epolls: &[i32]) {
    epolls
        .iter()
        .for_each(|&fd| crate::dispatch::after_epoll_create(fd));
    for &epfd in epolls {
        let Ok(info) = std::fs::read_to_string(format!("/proc/self/fdinfo/{epfd}")) else {
            continue;
        };
        info.lines()
            .filter_map(registration)
            .for_each(|(tfd, events, data)| adopt_registration(epfd, tfd, events, data));
    }
}

/// `tfd: N events: X data: D ...` of an epoll fd's fdinfo (hexadecimal events and data);
/// `None` for the file's other lines (pos, flags, ...).
fn registration(line: &str) -> Option<(i32, u32, u64)> {
    let mut words = line.split_whitespace();
    if words.next()? != "tfd:" {
        return None;
    }
    let tfd = words.next()?.parse().ok()?;
    if words.next()? != "events:" {
        return None;
    }
    let events = u32::from_str_radix(words.next()?, 16).ok()?;
    if words.next()? != "data:" {
        return None;
    }
    let data = u64::from_str_radix(words.next()?, 16).ok()?;
    Some((tfd, events, data))
}

fn adopt_registration(epfd: i32, tfd: i32, events: u32, data: u64) {
    let target = match table::get(tfd).as_deref() {
        Some(Entry::Conn(c)) => Target::Conn(c.clone()),
        Some(Entry::Epoll(s)) => Target::Set(s.clone()),
        _ => return,
    };
    let Some(set) = crate::dispatch::epoll_of(epfd) else {
        return;
    };
    if crate::epoll::is_old_tag(data) {
        tracing::warn!(
            epfd,
            tfd,
            "an epoll registration inherited across exec is dropped"
        );
        crate::epoll::forget_inherited(epfd, tfd);
        return;
    }
    set.adopt(epfd, tfd, target, events, data);
}

pub fn adopt_inherited() {
    if engine::disabled() {
        return;
    }
    let Inherited {
        conns,
        listeners,
        epolls,
    } = inherited();
    adopt_sockets(conns, listeners);
    adopt_epolls(&epolls);
}

/// Inherited listeners and ring connections, found again in the registry.
fn adopt_sockets(conns: Vec<i32>, listeners: Vec<i32>) {
    if conns.is_empty() && listeners.is_empty() {
        return;
    }
    let Some(engine) = engine::get() else {
        // No region yet: the listeners are published when the process joins one.
        let scope = memloop::identity::net_scope();
        for fd in listeners {
            if let Some(l) = Listener::dormant(scope, fd) {
                table::insert(fd, Entry::Listener(l));
            }
        }
        return;
    };
    for fd in listeners {
        if let Some(l) = Listener::register(&engine, fd) {
            table::insert(fd, Entry::Listener(l));
        }
    }
    let channels = engine.registry().channels();
    for fd in conns {
        let (Some(local), Some(peer)) = (real::local_addr(fd), real::peer_addr(fd)) else {
            continue;
        };
        let (local, peer) = (canonical(local), canonical(peer));
        let found = channels.iter().find_map(|c| {
            // A channel whose connection switched to TCP has dead rings: the socket is plain.
            let switched = engine
                .registry()
                .switch_word(c.id)
                .map_or(true, |w| w.requested());
            if c.state != ChannelState::Accepted || switched {
                return None;
            }
            Some((c.id, side_of_socket(c, local, peer)?, c.tuple?))
        });
        let Some((ch, side, tuple)) = found else {
            // Perhaps a switched connection the previous image handed on.
            crate::conn::adopt_after_exec(fd);
            continue;
        };
        let parts = ConnParts::found(&engine, ch, side, tuple, fd);
        if let Ok(conn) = Conn::new(parts) {
            conn.mark_shared();
            tracing::debug!(fd, ?ch, "inherited ring connection adopted after exec");
            table::insert(fd, Entry::Conn(conn));
        }
    }
}
