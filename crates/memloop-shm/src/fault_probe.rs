//! A write the MMU must refuse: tests use it to show that a read-only view (a reader's
//! mapping of a zero-copy pool, [`crate::PoolMapping`]) really is read-only, from a process
//! or inside a VM guest. Nothing else has a use for it.
//!
//! It lives here so that the crates above keep `forbid`/`deny(unsafe_code)`: their tests and
//! test programs call [`write_into`] instead of casting a received buffer's pointer
//! themselves.

/// Writes `value` into the first byte of `bytes` — which must lie in a read-only mapping —
/// with a volatile store, so the caller, which expects to die of `SIGSEGV` here, can show that
/// the MMU stops a reader that writes into a buffer it received. Returns only if the store
/// landed (then the mapping was not read-only after all: the caller's check failed).
///
/// Refused (an error, nothing written) unless `/proc/self/maps` shows the first byte in a
/// mapping without write permission: a shared slice of writable memory is never written.
pub fn write_into(bytes: &[u8], value: u8) -> std::io::Result<()> {
    let addr = bytes.as_ptr() as usize;
    let refuse = |why: &str| std::io::Error::new(std::io::ErrorKind::InvalidInput, why.to_string());
    if bytes.is_empty() {
        return Err(refuse("write_into: an empty slice"));
    }
    let maps = std::fs::read_to_string("/proc/self/maps")?;
    let perms = maps.lines().find_map(|l| {
        let (range, rest) = l.split_once(' ')?;
        let (start, end) = range.split_once('-')?;
        let start = usize::from_str_radix(start, 16).ok()?;
        let end = usize::from_str_radix(end, 16).ok()?;
        (start..end)
            .contains(&addr)
            .then(|| rest.get(..4).unwrap_or("").to_string())
    });
    match perms {
        Some(p) if p.starts_with("r-") => {}
        Some(p) => {
            return Err(refuse(&format!(
                "write_into: {addr:#x} lies in a mapping with permissions {p}, not read-only"
            )))
        }
        None => return Err(refuse(&format!("write_into: {addr:#x} is in no mapping"))),
    }
    let p = bytes.as_ptr().cast_mut();
    // SAFETY: none is claimed for the store itself: it is the experiment. `p` points at the
    // first byte of a live slice, which /proc/self/maps just showed in a mapping without
    // write permission, so the MMU must stop the store with SIGSEGV before anything is
    // written and this process dies (the default action; std's stack-overflow handler hands
    // a fault outside a guard page back to it). Had the store landed, the byte would be a
    // plain `u8` of shared memory, which other processes may change under any reader anyway.
    unsafe { p.write_volatile(value) };
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn writable_memory_is_refused_and_left_alone() {
        let v = vec![7u8; 16];
        let e = super::write_into(&v, 1).unwrap_err();
        assert!(e.to_string().contains("not read-only"), "{e}");
        assert_eq!(v[0], 7);
        assert!(super::write_into(&[], 1).is_err());
    }
}
