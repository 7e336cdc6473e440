//! After `exec`: sockets inherited from the previous program image that were ring
//! connections are found again by their 4-tuple in the registry and keep using their rings
//! (the new image would otherwise read the doorbell bytes as data).

use crate::agree::canonical;
use crate::conn::{Conn, ConnParts, RING};
use crate::engine;
use crate::listen::Listener;
use crate::real;
use crate::table::{self, Entry};
use memloop::registry::{ChannelState, ConnTuple, Side};

/// Inherited connected and listening inet stream sockets.
fn inherited_sockets() -> (Vec<i32>, Vec<i32>) {
    let (mut conns, mut listeners) = (Vec::new(), Vec::new());
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return (conns, listeners);
    };
    for e in dir.flatten() {
        let Some(fd) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let is_socket =
            std::fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy().starts_with("socket:"));
        if !is_socket {
            continue;
        }
        let domain = real::sockopt_int(fd, libc::SOL_SOCKET, libc::SO_DOMAIN);
        let stream =
            real::sockopt_int(fd, libc::SOL_SOCKET, libc::SO_TYPE) == Some(libc::SOCK_STREAM);
        if !stream || !matches!(domain, Some(libc::AF_INET) | Some(libc::AF_INET6)) {
            continue;
        }
        if real::sockopt_int(fd, libc::SOL_SOCKET, libc::SO_ACCEPTCONN) == Some(1) {
            listeners.push(fd);
        } else if real::peer_addr(fd).is_some() {
            conns.push(fd);
        }
    }
    (conns, listeners)
}

pub fn adopt_inherited() {
    if engine::disabled() {
        return;
    }
    let (conns, listeners) = inherited_sockets();
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
