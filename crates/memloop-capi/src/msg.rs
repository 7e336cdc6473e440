//! Received messages (`ml_msg`): their segments, read in place.

use crate::status::{call_value, guard, shared, take};
use memloop::zerocopy::Received;

/// A received message: its segments are read in place (read-only: a write faults) and held
/// (their buffers stay out of their pools) until `ml_msg_free`. May be read by several threads
/// at once; freed once.
#[allow(non_camel_case_types)]
pub struct ml_msg {
    pub(crate) msg: Received,
}

/// The number of segments of `msg` (0 for NULL).
///
/// # Safety
/// `msg` is NULL or a live message handle.
#[no_mangle]
pub unsafe extern "C" fn ml_msg_segments(msg: *const ml_msg) -> usize {
    call_value(0, || {
        // SAFETY: NULL or a live message handle (the caller's contract).
        Ok(unsafe { shared(msg, "msg") }?.msg.segment_count())
    })
}

/// Segment `i` of `msg`: its first byte, and (if `len` is not NULL) its length. Valid until
/// `ml_msg_free(msg)`; read-only. NULL (and a length of 0) for a NULL message or a segment
/// out of range.
///
/// # Safety
/// `msg` is NULL or a live message handle; `len` is NULL or points to a writable `size_t`.
#[no_mangle]
pub unsafe extern "C" fn ml_msg_segment(
    msg: *const ml_msg,
    i: usize,
    len: *mut usize,
) -> *const u8 {
    let (bytes, n) = call_value((std::ptr::null(), 0), || {
        // SAFETY: NULL or a live message handle (the caller's contract).
        let m = unsafe { shared(msg, "msg") }?;
        match m.msg.segments().nth(i) {
            Some(s) => Ok((s.as_ptr(), s.len())),
            None => crate::status::invalid(format!(
                "segment {i} of a message of {}",
                m.msg.segment_count()
            )),
        }
    });
    if !len.is_null() {
        // SAFETY: non-NULL, so it points to a writable `size_t` (the caller's contract).
        unsafe { len.write(n) };
    }
    bytes
}

/// The total length of `msg`'s segments (0 for NULL).
///
/// # Safety
/// `msg` is NULL or a live message handle.
#[no_mangle]
pub unsafe extern "C" fn ml_msg_len(msg: *const ml_msg) -> usize {
    call_value(0, || {
        // SAFETY: NULL or a live message handle (the caller's contract).
        Ok(unsafe { shared(msg, "msg") }?.msg.len())
    })
}

/// The sender's word (`user` of the send; a whole forward keeps it). 0 for NULL.
///
/// # Safety
/// `msg` is NULL or a live message handle.
#[no_mangle]
pub unsafe extern "C" fn ml_msg_user(msg: *const ml_msg) -> u32 {
    call_value(0, || {
        // SAFETY: NULL or a live message handle (the caller's contract).
        Ok(unsafe { shared(msg, "msg") }?.msg.user())
    })
}

/// Frees a message (NULL: nothing): our hold on its buffers ends, and each goes back to its
/// owner's pool once no other holder in the pipeline names it.
///
/// # Safety
/// `msg` is NULL or a message handle not freed yet, used by no other thread during or after
/// the call (its segment pointers are invalid from then on).
#[no_mangle]
pub unsafe extern "C" fn ml_msg_free(msg: *mut ml_msg) {
    guard((), || {
        // SAFETY: NULL or a live handle given back once (the caller's contract).
        drop(unsafe { take(msg) });
    })
}
