//! `listener_dup`: closing a `dup` of a listening socket leaves it listening (the kernel
//! closes the socket only with its last fd), so later connections are accepted as before —
//! under the preload still on rings (the driver compares `rings N` with the server's log).

use crate::ensure;
use crate::sys;
use crate::util::{self, Ctx, Net, Opts, Res};
use std::os::fd::AsRawFd;
use std::time::Duration;

pub fn run(_o: &Opts) -> Res<()> {
    let net = Net::new()?;
    let first = net.pairs(1)?;
    drop(sys::dup(net.listener.as_raw_fd()).ctx("dup the listener")?);
    // A thread's clone of the listener, dropped when the thread ends (a common pattern).
    let clone = net.listener.try_clone().ctx("try_clone")?;
    std::thread::spawn(move || drop(clone))
        .join()
        .map_err(|_| "thread panicked")?;
    let later = net.pairs(3)?;
    for (c, s) in first.iter().chain(&later) {
        sys::send_all(s.as_raw_fd(), b"still here").ctx("send")?;
        let b = util::read_exact(c.as_raw_fd(), 10, Duration::from_secs(2))?;
        ensure!(b == b"still here", "read {b:?}");
    }
    Ok(())
}
