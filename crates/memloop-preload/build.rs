//! Builds `libmemloop.so`, the small C library `memloop run` preloads (`shim/memloop_shim.c`),
//! and puts it beside this crate's own shared object (the engine it loads when a process first
//! needs it), in the profile's output directory: `target/release/libmemloop.so`.
//!
//! It is C because it must carry no runtime of its own: a Rust shared object brings the
//! unwinder (`libgcc_s`) and the standard library's start-up, the costs it exists to spare
//! processes that never open a socket.

use std::path::{Path, PathBuf};
use std::process::Command;

const SOURCE: &str = "shim/memloop_shim.c";
/// The engine's unwinder entry points, forwarded to libgcc_s loaded on first use.
const UNWIND: &str = "shim/unwind_forward.c";

fn main() {
    println!("cargo:rerun-if-changed={SOURCE}");
    println!("cargo:rerun-if-changed={UNWIND}");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=CC");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let built = out.join("libmemloop.so");
    compile(&built);
    archive_unwind(&out);
    // OUT_DIR is <target>/<profile>/build/<crate>-<hash>/out: three levels up is where cargo
    // puts the engine (and the binaries that look for both there).
    if let Some(profile_dir) = out.ancestors().nth(3) {
        let dest = profile_dir.join("libmemloop.so");
        // (Written beside, then renamed: a test running meanwhile never maps half a file.)
        let tmp = profile_dir.join(".libmemloop.so.tmp");
        std::fs::copy(&built, &tmp).expect("copying libmemloop.so to the output directory");
        std::fs::rename(&tmp, &dest).expect("placing libmemloop.so in the output directory");
    }
}

/// `libmemloop_unwind.a`, linked into this crate ahead of the standard library's `-lgcc_s`
/// (this crate's own native libraries come first), so the linker's `--as-needed` drops
/// libgcc_s from the engine's dependencies.
fn archive_unwind(out: &Path) {
    let obj = out.join("unwind_forward.o");
    cc(UNWIND, &["-c", "-fvisibility=hidden", "-o"], &obj, &[]);
    let lib = out.join("libmemloop_unwind.a");
    let _ = std::fs::remove_file(&lib);
    let status = Command::new("ar")
        .arg("rcs")
        .arg(&lib)
        .arg(&obj)
        .status()
        .unwrap_or_else(|e| panic!("running ar for {UNWIND}: {e}"));
    assert!(status.success(), "ar failed on {UNWIND}");
    println!("cargo:rustc-link-search=native={}", out.display());
    println!("cargo:rustc-link-lib=static=memloop_unwind");
}

/// The C compiler (`$CC`, else `cc`) on `source` with the flags both objects share, then
/// `flags`, the output `out`, then `libs`.
fn cc(source: &str, flags: &[&str], out: &Path, libs: &[&str]) {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let common = [
        "-std=gnu11",
        "-O2",
        "-g",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-fPIC",
    ];
    let status = Command::new(&cc)
        .args(common)
        .args(flags)
        .arg(out)
        .arg(source)
        .args(libs)
        .status()
        .unwrap_or_else(|e| panic!("running {cc} for {source}: {e}"));
    assert!(status.success(), "{cc} failed on {source}");
}

fn compile(out: &Path) {
    let flags = [
        "-shared",
        "-fvisibility=hidden",
        // It defines the checked variants (`__read_chk`, …) itself.
        "-U_FORTIFY_SOURCE",
        "-D_FORTIFY_SOURCE=0",
        // (Lazy binding: most of its own imports — dlopen, dlsym, … — a process that
        // never needs the engine never calls, and each costs a lookup at load.)
        // Two mappings (code, data) instead of four: each is copied by every fork and
        // torn down by every exit of every process it is loaded in. (Its data holds
        // function pointers written at run time anyway; read-only relocations would
        // protect little.)
        "-Wl,-z,noseparate-code",
        "-Wl,-z,norelro",
        "-o",
    ];
    cc(SOURCE, &flags, out, &["-ldl"]);
}
