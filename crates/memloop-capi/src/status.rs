//! Status codes, the thread's last error, and what every entry point shares: no panic leaves
//! through the C ABI, and a NULL handle is an error, never a dereference.

use memloop::registry::RegistryError;
use memloop::Error;
use std::cell::RefCell;
use std::ffi::{c_char, c_int, CStr, CString};
use std::fmt::Display;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

/// What an `ml_*` function returns (as an `int`): `ML_OK` (0), `ML_EOF` (positive: not an
/// error), or a negative error. A failing function also records a message for
/// `ml_last_error()`. Later versions may add codes: treat an unknown negative one as
/// `ML_ERROR`.
#[repr(C)]
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ml_status {
    /// Success.
    ML_OK = 0,
    /// `ml_port_recv`: the peer shut down its sending side and everything it sent was
    /// received (no message is returned).
    ML_EOF = 1,
    /// Nothing now, and the call was asked not to wait (a timeout of 0).
    ML_WOULDBLOCK = -1,
    /// The wait ran out (a positive timeout, or a connect the peer did not accept in time).
    ML_TIMEDOUT = -2,
    /// The peer died, left, or closed its receiving side.
    ML_PEER_GONE = -3,
    /// The peer sent a descriptor that names no buffer it may name (the message was released
    /// and refused; the port still works).
    ML_FORGED = -4,
    /// No live member has bound that service name.
    ML_NO_SERVICE = -5,
    /// Another live member has bound that service name.
    ML_ADDR_IN_USE = -6,
    /// No region there (or no ivshmem device).
    ML_NO_REGION = -7,
    /// A table of the region (members, endpoints, channels, pools, ring memory) is full.
    ML_REGION_FULL = -8,
    /// A NULL handle or pointer, or an argument out of range.
    ML_INVALID = -9,
    /// Anything else (I/O, a corrupt region, an internal error).
    ML_ERROR = -10,
}

impl ml_status {
    pub(crate) const fn code(self) -> c_int {
        self as c_int
    }

    /// The code a `memloop::Error` is reported as.
    pub fn of(e: &Error) -> ml_status {
        use ml_status::*;
        match e {
            Error::WouldBlock => ML_WOULDBLOCK,
            Error::TimedOut | Error::ConnectTimeout => ML_TIMEDOUT,
            Error::PeerDead | Error::BrokenPipe | Error::WriteShutdown => ML_PEER_GONE,
            Error::Forged(_) => ML_FORGED,
            Error::NoService(_) => ML_NO_SERVICE,
            Error::AddrInUse(_) => ML_ADDR_IN_USE,
            Error::NoRegion(_) | Error::NoDevice(_) => ML_NO_REGION,
            Error::Registry(RegistryError::RegionFull { .. }) => ML_REGION_FULL,
            Error::Io(io) if io.kind() == std::io::ErrorKind::InvalidInput => ML_INVALID,
            _ => ML_ERROR,
        }
    }

    fn name(self) -> &'static CStr {
        use ml_status::*;
        match self {
            ML_OK => c"ML_OK",
            ML_EOF => c"ML_EOF",
            ML_WOULDBLOCK => c"ML_WOULDBLOCK",
            ML_TIMEDOUT => c"ML_TIMEDOUT",
            ML_PEER_GONE => c"ML_PEER_GONE",
            ML_FORGED => c"ML_FORGED",
            ML_NO_SERVICE => c"ML_NO_SERVICE",
            ML_ADDR_IN_USE => c"ML_ADDR_IN_USE",
            ML_NO_REGION => c"ML_NO_REGION",
            ML_REGION_FULL => c"ML_REGION_FULL",
            ML_INVALID => c"ML_INVALID",
            ML_ERROR => c"ML_ERROR",
        }
    }

    fn from_code(code: c_int) -> Option<ml_status> {
        use ml_status::*;
        [
            ML_OK,
            ML_EOF,
            ML_WOULDBLOCK,
            ML_TIMEDOUT,
            ML_PEER_GONE,
            ML_FORGED,
            ML_NO_SERVICE,
            ML_ADDR_IN_USE,
            ML_NO_REGION,
            ML_REGION_FULL,
            ML_INVALID,
            ML_ERROR,
        ]
        .into_iter()
        .find(|s| s.code() == code)
    }
}

/// Why a call failed, before it is recorded.
pub(crate) enum Fail {
    /// A NULL handle or pointer: the argument's name.
    Null(&'static str),
    /// An argument out of range.
    Invalid(String),
    Ml(Error),
}

impl From<Error> for Fail {
    fn from(e: Error) -> Self {
        Fail::Ml(e)
    }
}

pub(crate) type Res<T> = Result<T, Fail>;

impl Fail {
    /// Records the failure as this thread's last error; its code.
    pub(crate) fn record(self) -> c_int {
        match self {
            Fail::Null(what) => set_last(ml_status::ML_INVALID, format_args!("{what} is NULL")),
            Fail::Invalid(why) => set_last(ml_status::ML_INVALID, why),
            Fail::Ml(e) => set_last(ml_status::of(&e), e),
        }
    }
}

pub(crate) fn invalid<T>(why: impl Into<String>) -> Res<T> {
    Err(Fail::Invalid(why.into()))
}

struct Last {
    code: c_int,
    msg: CString,
}

thread_local! {
    static LAST: RefCell<Last> = RefCell::new(Last { code: 0, msg: CString::default() });
}

/// Records `code` and `msg` as this thread's last error; returns `code`.
pub(crate) fn set_last(code: ml_status, msg: impl Display) -> c_int {
    let text = msg.to_string().replace('\0', " ");
    let msg = CString::new(text).unwrap_or_default();
    // (During thread exit the slot may be gone: the code is still returned.)
    let _ = LAST.try_with(|l| {
        if let Ok(mut l) = l.try_borrow_mut() {
            *l = Last {
                code: code.code(),
                msg,
            };
        }
    });
    code.code()
}

/// Runs an entry point's body: a panic inside is caught, recorded as `ML_ERROR` and answered
/// with `on_panic`.
pub(crate) fn guard<T>(on_panic: T, body: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(v) => v,
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "(no message)".into());
            // (A payload whose drop panics must not get out either.)
            let _ = catch_unwind(AssertUnwindSafe(move || drop(payload)));
            set_last(
                ml_status::ML_ERROR,
                format_args!("internal error (panic): {what}"),
            );
            on_panic
        }
    }
}

/// An entry point returning a status.
pub(crate) fn call(body: impl FnOnce() -> Res<ml_status>) -> c_int {
    guard(ml_status::ML_ERROR.code(), || match body() {
        Ok(s) => s.code(),
        Err(f) => f.record(),
    })
}

/// An entry point returning a new handle, or NULL with the error recorded.
pub(crate) fn call_new<T>(body: impl FnOnce() -> Res<T>) -> *mut T {
    guard(std::ptr::null_mut(), || match body() {
        Ok(v) => Box::into_raw(Box::new(v)),
        Err(f) => {
            f.record();
            std::ptr::null_mut()
        }
    })
}

/// An entry point returning a plain value (`fallback` on failure, the error recorded).
pub(crate) fn call_value<T: Copy>(fallback: T, body: impl FnOnce() -> Res<T>) -> T {
    guard(fallback, || match body() {
        Ok(v) => v,
        Err(f) => {
            f.record();
            fallback
        }
    })
}

/// The handle behind `p`, shared.
///
/// # Safety
/// `p` is NULL or points to a live handle of type `T` made by this library and not freed,
/// which no other thread frees or uses mutably while the borrow lasts.
pub(crate) unsafe fn shared<'a, T>(p: *const T, what: &'static str) -> Res<&'a T> {
    // SAFETY: NULL is refused by `as_ref`; anything else is a live, unaliased-by-writers `T`
    // (the caller's contract).
    unsafe { p.as_ref() }.ok_or(Fail::Null(what))
}

/// The handle behind `p`, exclusively.
///
/// # Safety
/// As [`shared`], and no other thread uses the handle at all while the borrow lasts.
pub(crate) unsafe fn exclusive<'a, T>(p: *mut T, what: &'static str) -> Res<&'a mut T> {
    // SAFETY: NULL is refused by `as_mut`; anything else is a live `T` nobody else uses
    // meanwhile (the caller's contract).
    unsafe { p.as_mut() }.ok_or(Fail::Null(what))
}

/// Takes back a handle this library gave out (NULL: `None`).
///
/// # Safety
/// `p` is NULL or a handle of type `T` made by this library and not freed; nobody uses it
/// after this call.
pub(crate) unsafe fn take<T>(p: *mut T) -> Option<Box<T>> {
    // SAFETY: every handle was made by `Box::into_raw` (`call_new`) and is given back once
    // (the caller's contract).
    (!p.is_null()).then(|| unsafe { Box::from_raw(p) })
}

/// A C string argument: `None` for NULL.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string that stays unchanged during the call.
pub(crate) unsafe fn c_str<'a>(p: *const c_char, what: &'static str) -> Res<Option<&'a str>> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: non-NULL and NUL-terminated (the caller's contract).
    let s = unsafe { CStr::from_ptr(p) };
    match s.to_str() {
        Ok(s) => Ok(Some(s)),
        Err(_) => invalid(format!("{what} is not UTF-8")),
    }
}

/// How long a call may wait, from a C `timeout_ms`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Wait {
    /// 0: do not wait (`ML_WOULDBLOCK`).
    Try,
    /// Negative: wait as long as it takes.
    Forever,
    /// Positive: at most this long (`ML_TIMEDOUT`).
    For(Duration),
}

impl Wait {
    pub(crate) fn from_ms(ms: c_int) -> Wait {
        match ms {
            0 => Wait::Try,
            ..0 => Wait::Forever,
            ms => Wait::For(Duration::from_millis(ms as u64)),
        }
    }

    /// The timeout of a blocking wait (`None` for ever; `Try` waits for nothing).
    pub(crate) fn limit(self) -> Option<Duration> {
        match self {
            Wait::Try => Some(Duration::ZERO),
            Wait::Forever => None,
            Wait::For(d) => Some(d),
        }
    }
}

/// The message of the last error recorded on the calling thread: valid until the next failing
/// `ml_*` call on this thread; "" if none failed yet. Successful calls leave it alone (like
/// `errno`), so read it only right after a failure.
#[no_mangle]
pub extern "C" fn ml_last_error() -> *const c_char {
    guard(c"".as_ptr(), || {
        LAST.try_with(|l| l.try_borrow().map(|l| l.msg.as_ptr()).ok())
            .ok()
            .flatten()
            .unwrap_or(c"".as_ptr())
    })
}

/// The code of the last error recorded on the calling thread (`ML_OK` if none yet): what a
/// function that returns NULL failed with.
#[no_mangle]
pub extern "C" fn ml_last_error_code() -> c_int {
    guard(ml_status::ML_ERROR.code(), || {
        LAST.try_with(|l| l.try_borrow().map(|l| l.code).unwrap_or(0))
            .unwrap_or(0)
    })
}

/// The name of a status code (`"ML_TIMEDOUT"`), or `"ML_UNKNOWN"`; a static string.
#[no_mangle]
pub extern "C" fn ml_strerror(code: c_int) -> *const c_char {
    guard(c"ML_UNKNOWN".as_ptr(), || {
        ml_status::from_code(code)
            .map_or(c"ML_UNKNOWN", ml_status::name)
            .as_ptr()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_is_caught_and_recorded() {
        let r = call(|| panic!("boom {}", 7));
        assert_eq!(r, ml_status::ML_ERROR.code());
        assert_eq!(ml_last_error_code(), ml_status::ML_ERROR.code());
        // SAFETY: `ml_last_error` returns a NUL-terminated string valid until the next
        // failure on this thread.
        let msg = unsafe { CStr::from_ptr(ml_last_error()) };
        assert!(msg.to_str().unwrap().contains("boom 7"), "{msg:?}");
        let p: *mut u8 = call_new(|| -> Res<u8> { panic!("again") });
        assert!(p.is_null());
    }

    #[test]
    fn errors_map_to_their_codes() {
        use ml_status::*;
        assert_eq!(ml_status::of(&Error::WouldBlock), ML_WOULDBLOCK);
        assert_eq!(ml_status::of(&Error::PeerDead), ML_PEER_GONE);
        assert_eq!(ml_status::of(&Error::Forged("x")), ML_FORGED);
        assert_eq!(ml_status::of(&Error::NoService("s".into())), ML_NO_SERVICE);
        let full = Error::Registry(RegistryError::RegionFull { what: "pool" });
        assert_eq!(ml_status::of(&full), ML_REGION_FULL);
        for code in -10..=1 {
            let s = ml_status::from_code(code).unwrap();
            assert_eq!(s.code(), code);
            // SAFETY: `ml_strerror` returns a static NUL-terminated string.
            let name = unsafe { CStr::from_ptr(ml_strerror(code)) };
            assert_eq!(name, s.name());
        }
        assert!(ml_status::from_code(-11).is_none());
    }

    #[test]
    fn timeouts() {
        assert_eq!(Wait::from_ms(0), Wait::Try);
        assert_eq!(Wait::from_ms(-1), Wait::Forever);
        assert_eq!(Wait::from_ms(-7), Wait::Forever);
        assert_eq!(Wait::from_ms(25), Wait::For(Duration::from_millis(25)));
    }
}
