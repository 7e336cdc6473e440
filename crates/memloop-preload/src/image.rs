//! Will a program image about to be exec'd load this library? Then its ring connections can
//! stay on their rings (the new image adopts them, `inherit.rs`); otherwise they move to TCP
//! before the exec, as nothing would read what is in their rings.
//!
//! The new image loads the library when its environment preloads it, the dynamic loader runs
//! at all (the file names an ELF interpreter, or is a script), and it is not a secure
//! execution (setuid or setgid file: the loader ignores `LD_PRELOAD` paths then).

use std::ffi::{CStr, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

const PT_INTERP: u32 = 3;

/// Whether exec'ing `file` (a path, or a name searched in `PATH` when `search`) with the
/// environment `env` keeps this library loaded.
pub fn keeps_library(file: &CStr, search: bool, env: &[&[u8]]) -> bool {
    let preloads = env.iter().any(|v| {
        v.strip_prefix(b"LD_PRELOAD=")
            .is_some_and(|l| l.windows(7).any(|w| w == b"memloop"))
    });
    if !preloads {
        return false;
    }
    let Some(path) = resolve(file, search, env) else {
        return false;
    };
    let Ok(meta) = std::fs::metadata(&path) else {
        return false;
    };
    if meta.mode() & (libc::S_ISUID | libc::S_ISGID) != 0 {
        return false;
    }
    dynamic(&path)
}

fn resolve(file: &CStr, search: bool, env: &[&[u8]]) -> Option<PathBuf> {
    let name = OsStr::from_bytes(file.to_bytes());
    if !search || file.to_bytes().contains(&b'/') {
        return Some(PathBuf::from(name));
    }
    let path = env
        .iter()
        .find_map(|v| v.strip_prefix(b"PATH="))
        .unwrap_or(b"/usr/local/bin:/usr/bin:/bin");
    path.split(|&b| b == b':')
        .map(|d| Path::new(OsStr::from_bytes(d)).join(name))
        .find(|p| p.is_file())
}

/// A script (its interpreter loads the library) or an ELF with an interpreter.
fn dynamic(path: &Path) -> bool {
    let Ok(bytes) = read_head(path) else {
        return false;
    };
    if bytes.starts_with(b"#!") {
        return true;
    }
    elf_has_interp(&bytes)
}

fn read_head(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut f = std::fs::File::open(path)?;
    let mut buf = vec![0u8; 4096];
    let n = f.read(&mut buf)?;
    buf.truncate(n);
    Ok(buf)
}

/// A 64-bit little-endian ELF whose program headers (within the first page) name an
/// interpreter. Anything else reads as static: the safe answer (the connection moves to TCP).
fn elf_has_interp(b: &[u8]) -> bool {
    if b.len() < 64 || &b[..4] != b"\x7fELF" || b[4] != 2 || b[5] != 1 {
        return false;
    }
    let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]) as usize;
    let phoff = u64::from_le_bytes(b[0x20..0x28].try_into().unwrap_or([0; 8])) as usize;
    let (size, num) = (u16_at(0x36), u16_at(0x38));
    (0..num).any(|i| {
        let o = phoff + i * size;
        o + 4 <= b.len() && u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]) == PT_INTERP
    })
}

/// The process's environment, as exec without an explicit one passes it on.
pub fn current_env() -> Vec<Vec<u8>> {
    std::env::vars_os()
        .map(|(k, v)| {
            let mut e = k.as_bytes().to_vec();
            e.push(b'=');
            e.extend_from_slice(v.as_bytes());
            e
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dynamic_and_static_images_and_the_environment() {
        let env: Vec<&[u8]> = vec![
            b"LD_PRELOAD=/x/libmemloop_preload.so",
            b"PATH=/usr/bin:/bin",
        ];
        let sh = c"sh";
        assert!(keeps_library(sh, true, &env), "sh is dynamic and preloaded");
        assert!(
            !keeps_library(sh, true, &[b"PATH=/usr/bin:/bin"]),
            "no LD_PRELOAD"
        );
        assert!(!keeps_library(c"/nonexistent", false, &env));
        if Path::new("/usr/bin/su").exists() {
            assert!(!keeps_library(c"/usr/bin/su", false, &env), "setuid");
        }
        assert!(!elf_has_interp(b"\x7fELF"), "truncated");
    }
}
