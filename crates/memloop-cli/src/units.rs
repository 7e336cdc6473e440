//! Parsing and printing sizes.

use crate::error::{fail, CliResult};

/// "4096", "64K", "64M", "1G", "256KiB" → bytes (binary multiples).
pub fn parse_size(s: &str) -> CliResult<u64> {
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, suffix) = t.split_at(digits);
    let n: u64 = num
        .parse()
        .map_err(|_| fail(format!("bad size {s:?}: expected e.g. 4096, 64K, 64M, 1G")))?;
    let shift = match suffix
        .trim()
        .to_ascii_uppercase()
        .trim_end_matches("IB")
        .trim_end_matches('B')
    {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        _ => return Err(fail(format!("bad size suffix in {s:?}: use K, M or G"))),
    };
    n.checked_mul(1 << shift)
        .ok_or_else(|| fail(format!("size {s:?} is too large")))
}

/// Bytes as "64 B", "1 KiB", "64 MiB" (exact binary multiples) or plain bytes.
pub fn fmt_size(n: u64) -> String {
    for (shift, unit) in [(30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if n >= 1 << shift && n.trailing_zeros() >= shift {
            return format!("{} {unit}", n >> shift);
        }
    }
    format!("{n} B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_round_trip() {
        assert_eq!(parse_size("64M").unwrap(), 64 << 20);
        assert_eq!(parse_size("64k").unwrap(), 64 << 10);
        assert_eq!(parse_size("256KiB").unwrap(), 256 << 10);
        assert_eq!(parse_size("100").unwrap(), 100);
        assert!(parse_size("12X").is_err());
        assert!(parse_size("").is_err());
        assert_eq!(fmt_size(65536), "64 KiB");
        assert_eq!(fmt_size(100), "100 B");
    }
}
