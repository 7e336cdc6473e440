//! Membership (`ml_node`), buffer pools (`ml_pool`) and loans (`ml_loan`).

use crate::status::{c_str, call_new, exclusive, invalid, shared, take, Wait};
use memloop::zerocopy::{Loan, Pool};
use memloop::{CreateRegion, Node, Region, RegionSpec};
use std::ffi::{c_char, c_int};

/// A process's membership in a region. May be used by several threads at once. Pools,
/// listeners and ports made from it keep the membership alive: the handle itself may be freed
/// as soon as they are made.
#[allow(non_camel_case_types)]
pub struct ml_node {
    pub(crate) node: Node,
}

/// A pool of fixed-size buffers this member owns and loans out. May be used by several
/// threads at once. Loans of it stay valid after `ml_pool_free`; the pool goes once no loan,
/// no message and no descriptor names its buffers any more.
#[allow(non_camel_case_types)]
pub struct ml_pool {
    pool: Pool,
}

/// A buffer on loan from a pool: write into it (`ml_loan_data`), then send it (which consumes
/// the handle) or give it back unsent (`ml_loan_free`). One thread at a time.
#[allow(non_camel_case_types)]
pub struct ml_loan {
    pub(crate) loan: Loan,
}

/// Joins a region as a member named `name` (NULL or "": the process name).
///
/// `region` names the region as `MEMLOOP_REGION` does (a name for `/dev/shm/memloop-NAME`,
/// a path, `ivshmem` or `ivshmem:BDF`); NULL or "" means `$MEMLOOP_REGION`, else the default
/// region. The region is created (with default parameters) if it does not exist.
///
/// Call it after `fork()`, not before: a member is one process. Returns NULL on failure
/// (`ml_last_error_code()`: e.g. `ML_NO_REGION`, `ML_REGION_FULL`).
///
/// # Safety
/// `region` and `name` are NULL or NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn ml_node_join(region: *const c_char, name: *const c_char) -> *mut ml_node {
    call_new(|| {
        // SAFETY: NULL or NUL-terminated (the caller's contract).
        let region = unsafe { c_str(region, "region") }?.filter(|r| !r.is_empty());
        // SAFETY: as above.
        let name = unsafe { c_str(name, "name") }?.unwrap_or("");
        let node = match region {
            None => Node::join_default(name)?,
            Some(r) => {
                let spec = RegionSpec::parse(r);
                Node::join(
                    Region::open_or_create(&spec, &CreateRegion::default())?,
                    name,
                )?
            }
        };
        Ok(ml_node { node })
    })
}

/// Frees a node handle (NULL: nothing). The membership ends when the last pool, listener,
/// port, loan and message made from it is freed too.
///
/// # Safety
/// `node` is NULL or a node handle not freed yet, used by no other thread during or after the
/// call.
#[no_mangle]
pub unsafe extern "C" fn ml_node_free(node: *mut ml_node) {
    crate::status::guard((), || {
        // SAFETY: NULL or a live handle given back once (the caller's contract).
        drop(unsafe { take(node) });
    })
}

/// Creates a pool of `buffers` buffers of `buf_size` bytes each (rounded up to 64) in the
/// node's region, writable by this process only (receivers map it read-only). NULL on
/// failure.
///
/// # Safety
/// `node` is NULL or a live node handle.
#[no_mangle]
pub unsafe extern "C" fn ml_pool_create(
    node: *const ml_node,
    buf_size: u32,
    buffers: u32,
) -> *mut ml_pool {
    call_new(|| {
        // SAFETY: NULL or a live node handle (the caller's contract).
        let n = unsafe { shared(node, "node") }?;
        if buf_size == 0 || buffers == 0 {
            return invalid("a pool needs buf_size > 0 and buffers > 0");
        }
        Ok(ml_pool {
            pool: Pool::create(&n.node, buf_size, buffers)?,
        })
    })
}

/// Frees a pool handle (NULL: nothing). Its loans stay valid, and what was sent stays
/// readable by its receivers; the pool goes with the last of them.
///
/// # Safety
/// `pool` is NULL or a pool handle not freed yet, used by no other thread during or after the
/// call.
#[no_mangle]
pub unsafe extern "C" fn ml_pool_free(pool: *mut ml_pool) {
    crate::status::guard((), || {
        // SAFETY: NULL or a live handle given back once (the caller's contract).
        drop(unsafe { take(pool) });
    })
}

/// Loans a buffer of the pool, waiting up to `timeout_ms` for one to come back (-1 or any
/// negative: as long as it takes; 0: not at all). A buffer comes back when the last holder in
/// the whole pipeline has freed the message naming it. NULL on failure:
/// `ml_last_error_code()` is `ML_WOULDBLOCK` (timeout 0), `ML_TIMEDOUT`, ...
///
/// # Safety
/// `pool` is NULL or a live pool handle.
#[no_mangle]
pub unsafe extern "C" fn ml_pool_loan(pool: *const ml_pool, timeout_ms: c_int) -> *mut ml_loan {
    call_new(|| {
        // SAFETY: NULL or a live pool handle (the caller's contract).
        let p = unsafe { shared(pool, "pool") }?;
        let loan = match Wait::from_ms(timeout_ms) {
            Wait::Try => p.pool.try_loan()?,
            wait => p.pool.loan_timeout(wait.limit())?,
        };
        Ok(ml_loan { loan })
    })
}

/// The loan's bytes, writable, and (if `capacity` is not NULL) their number, the pool's
/// buffer size. Valid until the loan is sent or freed. NULL (and a capacity of 0) for a NULL
/// loan.
///
/// # Safety
/// `loan` is NULL or a live loan handle used by no other thread during the call; `capacity`
/// is NULL or points to a writable `size_t`.
#[no_mangle]
pub unsafe extern "C" fn ml_loan_data(loan: *mut ml_loan, capacity: *mut usize) -> *mut u8 {
    let (data, cap) = crate::status::call_value((std::ptr::null_mut(), 0), || {
        // SAFETY: NULL or a live loan handle nobody else uses meanwhile (the caller's
        // contract).
        let l = unsafe { exclusive(loan, "loan") }?;
        let cap = l.loan.capacity();
        let bytes: &mut [u8] = &mut l.loan;
        Ok((bytes.as_mut_ptr(), cap))
    });
    if !capacity.is_null() {
        // SAFETY: non-NULL, so it points to a writable `size_t` (the caller's contract).
        unsafe { capacity.write(cap) };
    }
    data
}

/// Gives a loan back unsent (NULL: nothing). Sending a loan frees its handle: never free it
/// after that.
///
/// # Safety
/// `loan` is NULL or a loan handle not sent or freed yet, used by no other thread during or
/// after the call.
#[no_mangle]
pub unsafe extern "C" fn ml_loan_free(loan: *mut ml_loan) {
    crate::status::guard((), || {
        // SAFETY: NULL or a live handle given back once (the caller's contract).
        drop(unsafe { take(loan) });
    })
}
