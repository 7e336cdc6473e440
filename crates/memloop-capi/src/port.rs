//! Listeners (`ml_listener`), ports (`ml_port`): connecting, sending loans and forwarding what
//! was received, receiving.

use crate::msg::ml_msg;
use crate::node::{ml_loan, ml_node};
use crate::status::{c_str, call, call_new, exclusive, guard, invalid, shared, take, Wait};
use crate::status::{ml_status, Fail, Res};
use memloop::zerocopy::{Loan, Message, Received, ZcListener, ZcPort};
use std::ffi::{c_char, c_int};

/// A bound service name: accepts the ports that connect to it. One thread at a time.
#[allow(non_camel_case_types)]
pub struct ml_listener {
    l: ZcListener,
}

/// One end of a zero-copy channel: sends descriptors of loans and of received bytes,
/// receives messages read in place. One thread at a time. Messages received through it stay
/// readable after it is freed.
#[allow(non_camel_case_types)]
pub struct ml_port {
    port: ZcPort,
    /// How long a send waits for room (`ml_port_set_send_timeout`).
    pub(crate) send_wait: Wait,
}

/// One part of a message sent with `ml_port_sendv`: either a loan of ours or a range of a
/// message we received (exactly one of `loan` and `msg` is not NULL).
#[repr(C)]
#[allow(non_camel_case_types)]
pub struct ml_part {
    /// A loan to send: its first `len` bytes (1 to its capacity; `seg` and `off` must be 0).
    /// The call consumes it.
    pub loan: *mut ml_loan,
    /// A received message to forward `len` bytes of (1 or more), from byte `off` of its
    /// segment `seg`, without copying. The call does not consume it: free it after the call
    /// (the receiver holds its own reference from then on).
    pub msg: *const ml_msg,
    /// The segment of `msg`.
    pub seg: usize,
    /// The first byte in that segment.
    pub off: usize,
    /// How many bytes.
    pub len: usize,
}

impl ml_port {
    fn new(port: ZcPort) -> ml_port {
        ml_port {
            port,
            send_wait: Wait::Forever,
        }
    }

    /// The port's next blocking call waits as `w` says.
    fn wait(&mut self, w: Wait) {
        self.port.set_nonblocking(w == Wait::Try);
        self.port.set_timeout(match w {
            Wait::For(d) => Some(d),
            Wait::Try | Wait::Forever => None,
        });
    }

    fn send(&mut self, m: Message<'_>) -> Res<ml_status> {
        self.wait(self.send_wait);
        self.port.send(m)?;
        Ok(ml_status::ML_OK)
    }
}

/// Binds the service `name` in the node's region: ports that connect to `name` are accepted
/// here. NULL on failure (`ML_ADDR_IN_USE` if another live member holds it).
///
/// # Safety
/// `node` is NULL or a live node handle; `name` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn ml_listener_bind(
    node: *const ml_node,
    name: *const c_char,
) -> *mut ml_listener {
    call_new(|| {
        // SAFETY: NULL or a live node handle (the caller's contract).
        let n = unsafe { shared(node, "node") }?;
        // SAFETY: NULL or NUL-terminated (the caller's contract).
        let name = service(unsafe { c_str(name, "name") }?)?;
        Ok(ml_listener {
            l: ZcListener::bind(&n.node, name)?,
        })
    })
}

/// Accepts the oldest port connecting to the listener's service, waiting up to `timeout_ms`
/// (negative: as long as it takes; 0: not at all, `ML_WOULDBLOCK`). NULL on failure.
///
/// # Safety
/// `listener` is NULL or a live listener handle used by no other thread during the call.
#[no_mangle]
pub unsafe extern "C" fn ml_listener_accept(
    listener: *mut ml_listener,
    timeout_ms: c_int,
) -> *mut ml_port {
    call_new(|| {
        // SAFETY: NULL or a live listener nobody else uses meanwhile (the caller's contract).
        let l = unsafe { exclusive(listener, "listener") }?;
        let wait = Wait::from_ms(timeout_ms);
        l.l.set_nonblocking(wait == Wait::Try);
        let port = match wait {
            Wait::Try => l.l.accept()?,
            wait => l.l.accept_timeout(wait.limit())?,
        };
        Ok(ml_port::new(port))
    })
}

/// Frees a listener (NULL: nothing): its service name is free again. Ports it accepted stay.
///
/// # Safety
/// `listener` is NULL or a listener handle not freed yet, used by no other thread during or
/// after the call.
#[no_mangle]
pub unsafe extern "C" fn ml_listener_free(listener: *mut ml_listener) {
    guard((), || {
        // SAFETY: NULL or a live handle given back once (the caller's contract).
        drop(unsafe { take(listener) });
    })
}

/// Connects to the service `name`, bound by a listener of another member (or of this one).
/// NULL on failure: `ML_NO_SERVICE` if nobody (alive) has bound it yet.
///
/// # Safety
/// `node` is NULL or a live node handle; `name` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn ml_port_connect(
    node: *const ml_node,
    name: *const c_char,
) -> *mut ml_port {
    call_new(|| {
        // SAFETY: NULL or a live node handle (the caller's contract).
        let n = unsafe { shared(node, "node") }?;
        // SAFETY: NULL or NUL-terminated (the caller's contract).
        let name = service(unsafe { c_str(name, "name") }?)?;
        Ok(ml_port::new(ZcPort::connect(&n.node, name)?))
    })
}

fn service(name: Option<&str>) -> Res<&str> {
    match name {
        None => Err(Fail::Null("name")),
        Some("") => invalid("an empty service name"),
        Some(n) => Ok(n),
    }
}

/// Frees a port (NULL: nothing): its sending side is shut down (the peer receives what was
/// sent, then `ML_EOF`). Messages received through it stay readable until freed.
///
/// # Safety
/// `port` is NULL or a port handle not freed yet, used by no other thread during or after the
/// call.
#[no_mangle]
pub unsafe extern "C" fn ml_port_free(port: *mut ml_port) {
    guard((), || {
        // SAFETY: NULL or a live handle given back once (the caller's contract).
        drop(unsafe { take(port) });
    })
}

/// No more sends on `port`: the peer receives what was sent, then `ML_EOF`. Receiving goes
/// on.
///
/// # Safety
/// `port` is NULL or a live port handle used by no other thread during the call.
#[no_mangle]
pub unsafe extern "C" fn ml_port_shutdown_send(port: *mut ml_port) -> c_int {
    call(|| {
        // SAFETY: NULL or a live port nobody else uses meanwhile (the caller's contract).
        let p = unsafe { exclusive(port, "port") }?;
        p.port.shutdown_send();
        Ok(ml_status::ML_OK)
    })
}

/// Sets how long sends on `port` wait for room in the ring: negative (the default) as long as
/// it takes, 0 not at all (`ML_WOULDBLOCK`), else at most that many milliseconds
/// (`ML_TIMEDOUT`).
///
/// # Safety
/// `port` is NULL or a live port handle used by no other thread during the call.
#[no_mangle]
pub unsafe extern "C" fn ml_port_set_send_timeout(port: *mut ml_port, timeout_ms: c_int) -> c_int {
    call(|| {
        // SAFETY: NULL or a live port nobody else uses meanwhile (the caller's contract).
        let p = unsafe { exclusive(port, "port") }?;
        p.send_wait = Wait::from_ms(timeout_ms);
        Ok(ml_status::ML_OK)
    })
}

/// Sends the first `len` bytes (1 to the loan's capacity) of `loan` as a one-segment message
/// carrying the word `user`. The loan is consumed whatever the result (on failure its buffer
/// goes back to the pool): never use or free it after the call.
///
/// # Safety
/// `port` is NULL or a live port handle used by no other thread during the call; `loan` is
/// NULL or a live loan handle, used by no other thread during or after the call.
#[no_mangle]
pub unsafe extern "C" fn ml_port_send_loan(
    port: *mut ml_port,
    loan: *mut ml_loan,
    len: usize,
    user: u32,
) -> c_int {
    call(|| {
        // SAFETY: NULL or a live loan handle given to us (the caller's contract).
        let loan = unsafe { take(loan) }.ok_or(Fail::Null("loan"))?.loan;
        // SAFETY: NULL or a live port nobody else uses meanwhile (the caller's contract).
        let p = unsafe { exclusive(port, "port") }?;
        let loan = sized(loan, len, 0)?;
        p.send(Message::new().loan(loan).user(user))
    })
}

/// Forwards a received message whole (every segment, and its user word) without copying.
/// `msg` is not consumed: free it when done (the next receiver holds its own reference).
///
/// # Safety
/// `port` is NULL or a live port handle used by no other thread during the call; `msg` is
/// NULL or a live message handle.
#[no_mangle]
pub unsafe extern "C" fn ml_port_forward(port: *mut ml_port, msg: *const ml_msg) -> c_int {
    call(|| {
        // SAFETY: NULL or a live port nobody else uses meanwhile (the caller's contract).
        let p = unsafe { exclusive(port, "port") }?;
        // SAFETY: NULL or a live message handle (the caller's contract).
        let m = unsafe { shared(msg, "msg") }?;
        p.send(Message::from(&m.msg))
    })
}

/// Sends one message of `nparts` segments in order (loans of ours and ranges of messages we
/// received, mixed as needed: say, a header of our own, then part of what we received),
/// carrying the word `user`. No payload byte is copied. Every loan in `parts` is consumed
/// whatever the result (on failure their buffers go back to their pool); the messages are not.
/// `ML_INVALID` for a part that names neither or both, a range outside its segment, a length
/// beyond a loan's capacity, no parts, or the same loan twice.
///
/// # Safety
/// `port` is NULL or a live port handle used by no other thread during the call; `parts` is
/// NULL or points to `nparts` parts, each of whose `loan` is NULL or a live loan handle (used
/// by no other thread during or after the call) and whose `msg` is NULL or a live message
/// handle.
#[no_mangle]
pub unsafe extern "C" fn ml_port_sendv(
    port: *mut ml_port,
    parts: *const ml_part,
    nparts: usize,
    user: u32,
) -> c_int {
    call(|| {
        let parts: &[ml_part] = match parts.is_null() {
            true => &[],
            // SAFETY: `nparts` parts at `parts` (the caller's contract).
            false => unsafe { std::slice::from_raw_parts(parts, nparts) },
        };
        // Every loan is ours first (each once), so that all are consumed whatever happens.
        let mut seen: Vec<*mut ml_loan> = Vec::new();
        let mut twice = false;
        let mut loans: Vec<Option<Loan>> = Vec::with_capacity(parts.len());
        for part in parts {
            if part.loan.is_null() || seen.contains(&part.loan) {
                twice |= !part.loan.is_null();
                loans.push(None);
                continue;
            }
            seen.push(part.loan);
            // SAFETY: a live loan handle given to us (the caller's contract), taken once.
            loans.push(unsafe { take(part.loan) }.map(|l| l.loan));
        }
        if twice {
            return invalid("the same loan in two parts");
        }
        // SAFETY: NULL or a live port nobody else uses meanwhile (the caller's contract).
        let p = unsafe { exclusive(port, "port") }?;
        if parts.is_empty() {
            return match nparts {
                0 => invalid("a message of no parts"),
                _ => Err(Fail::Null("parts")),
            };
        }
        let mut m = Message::new().user(user);
        for (i, (part, loan)) in parts.iter().zip(loans).enumerate() {
            m = match (loan, part.msg.is_null()) {
                (Some(_), true) if part.seg != 0 || part.off != 0 => {
                    return invalid(format!("part {i}: a loan with a segment or an offset"));
                }
                (Some(l), true) => m.loan(sized(l, part.len, i)?),
                (None, false) => {
                    // SAFETY: a live message handle (the caller's contract).
                    let r = &unsafe { shared(part.msg, "msg") }?.msg;
                    in_segment(r, part, i)?;
                    m.forward_range(r, part.seg, part.off, part.len)?
                }
                (Some(_), false) => return invalid(format!("part {i}: both a loan and a msg")),
                (None, true) => return invalid(format!("part {i}: neither a loan nor a msg")),
            };
        }
        p.send(m)
    })
}

/// The loan cut to `len` bytes, if that is 1 to its capacity.
fn sized(mut l: Loan, len: usize, part: usize) -> Res<Loan> {
    if len == 0 || len > l.capacity() {
        return invalid(format!(
            "part {part}: {len} bytes of a loan of {}",
            l.capacity()
        ));
    }
    l.truncate(len);
    Ok(l)
}

/// Whether `part`'s range lies in a segment of `r`.
fn in_segment(r: &Received, part: &ml_part, i: usize) -> Res<()> {
    let Some(seg) = r.segments().nth(part.seg) else {
        return invalid(format!(
            "part {i}: segment {} of a message of {}",
            part.seg,
            r.segment_count()
        ));
    };
    let end = part.off.checked_add(part.len);
    if part.len == 0 || !end.is_some_and(|e| e <= seg.len()) {
        return invalid(format!(
            "part {i}: {} bytes from {} of a segment of {}",
            part.len,
            part.off,
            seg.len()
        ));
    }
    Ok(())
}

/// Receives the next message into `*out`, waiting up to `timeout_ms` (negative: as long as it
/// takes; 0: not at all). Returns `ML_OK` with `*out` set; `ML_EOF` once the peer shut down
/// its sending side and everything was received; or an error (`ML_WOULDBLOCK`,
/// `ML_TIMEDOUT`, `ML_PEER_GONE`, `ML_FORGED`: that message was refused, the next may be
/// received). `*out` is NULL unless `ML_OK`. The message's bytes are read in place, read-only,
/// and held until `ml_msg_free`.
///
/// # Safety
/// `port` is NULL or a live port handle used by no other thread during the call; `out` is
/// NULL or points to a writable `ml_msg *`.
#[no_mangle]
pub unsafe extern "C" fn ml_port_recv(
    port: *mut ml_port,
    timeout_ms: c_int,
    out: *mut *mut ml_msg,
) -> c_int {
    call(|| {
        if out.is_null() {
            return Err(Fail::Null("out"));
        }
        // SAFETY: non-NULL, so writable (the caller's contract).
        unsafe { out.write(std::ptr::null_mut()) };
        // SAFETY: NULL or a live port nobody else uses meanwhile (the caller's contract).
        let p = unsafe { exclusive(port, "port") }?;
        p.wait(Wait::from_ms(timeout_ms));
        match p.port.recv()? {
            None => Ok(ml_status::ML_EOF),
            Some(msg) => {
                let m = Box::into_raw(Box::new(ml_msg { msg }));
                // SAFETY: as above.
                unsafe { out.write(m) };
                Ok(ml_status::ML_OK)
            }
        }
    })
}
