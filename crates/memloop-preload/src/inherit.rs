//! After `exec`: sockets inherited from the previous program image that were ring
//! connections are found again by their 4-tuple in the registry and keep using their rings
//! (the new image would otherwise read the doorbell bytes as data). Inherited epoll sets are
//! registered too, so waits on them filter our tagged registrations.

use crate::agree::canonical;
use crate::conn::{Conn, ConnParts, RING};
use crate::engine;
use crate::listen::Listener;
use crate::real;
use crate::table::{self, Entry};
use memloop::registry::{ChannelState, ConnTuple, Side};

/// Inherited fds: connected and listening inet stream sockets, and epoll sets.
#[derive(Default)]
struct Inherited {
    conns: Vec<i32>,
    listeners: Vec<i32>,
    epolls: Vec<i32>,
}

fn inherited() -> Inherited {
    let mut found = Inherited::default();
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return found;
    };
    for e in dir.flatten() {
        let Some(fd) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(link) = std::fs::read_link(e.path()) else {
            continue;
        };
        let link = link.to_string_lossy();
        if link == "anon_inode:[eventpoll]" {
            found.epolls.push(fd);
            continue;
        }
        if !link.starts_with("socket:") {
            continue;
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

/// An epoll set inherited across exec: known from now on. Registrations the previous image
/// made through memloop carry our tag, and the program data they stood for died with that
/// image: they are removed (and logged) rather than reported with a data word the program
/// never gave.
fn adopt_epoll(epfd: i32) {
    crate::dispatch::after_epoll_create(epfd);
    let Ok(info) = std::fs::read_to_string(format!("/proc/self/fdinfo/{epfd}")) else {
        return;
    };
    for line in info.lines().filter(|l| l.starts_with("tfd:")) {
        let mut words = line.split_whitespace();
        let tfd = words.nth(1).and_then(|w| w.parse::<i32>().ok());
        let data = words
            .skip_while(|w| *w != "data:")
            .nth(1)
            .and_then(|w| u64::from_str_radix(w, 16).ok());
        if let (Some(tfd), Some(data)) = (tfd, data) {
            if crate::epoll::is_ours(data) {
                tracing::warn!(
                    epfd,
                    tfd,
                    "an epoll registration inherited across exec is dropped"
                );
                crate::epoll::forget_inherited(epfd, tfd);
            }
        }
    }
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
    epolls.into_iter().for_each(adopt_epoll);
    if conns.is_empty() && listeners.is_empty() {
        return;
    }
    let Some(engine) = engine::get() else { return };
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
            let t = c.tuple?;
            if c.state != ChannelState::Accepted {
                return None;
            }
            if t == (ConnTuple {
                client: local,
                server: peer,
            }) && !c.client_closed
            {
                Some((c.id, Side::Client, t))
            } else if t
                == (ConnTuple {
                    client: peer,
                    server: local,
                })
                && !c.server_closed
            {
                Some((c.id, Side::Server, t))
            } else {
                None
            }
        });
        let Some((ch, side, tuple)) = found else {
            continue;
        };
        let parts = ConnParts {
            engine: engine.clone(),
            ch,
            side,
            tuple,
            fd,
            path: RING,
            same_kernel: true,
            decide_wait: std::time::Duration::ZERO,
        };
        if let Ok(conn) = Conn::new(parts) {
            conn.mark_shared();
            tracing::debug!(fd, ?ch, "inherited ring connection adopted after exec");
            table::insert(fd, Entry::Conn(conn));
        }
    }
}
