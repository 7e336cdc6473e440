//! Generates `include/memloop_zc.h`, the C header of this crate's `extern "C"` API, with
//! cbindgen (settings in `cbindgen.toml`). The header is committed so that C users have it
//! without building; this script keeps that copy in step with the sources — except under CI
//! (`CI` set), where it leaves the source tree alone and the `header_is_up_to_date` test
//! compares the committed copy with the one generated here into `OUT_DIR`.

use std::path::{Path, PathBuf};

const HEADER: &str = "include/memloop_zc.h";

fn main() {
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=CI");
    // (A hand edit of the committed copy is undone, outside CI.)
    println!("cargo:rerun-if-changed={HEADER}");
    let dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets it"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml"))
        .unwrap_or_else(|e| panic!("reading cbindgen.toml: {e}"));
    let fresh = out.join("memloop_zc.h");
    cbindgen::Builder::new()
        .with_config(config)
        .with_src(dir.join("src/lib.rs"))
        .generate()
        .unwrap_or_else(|e| panic!("generating {HEADER}: {e}"))
        .write_to_file(&fresh);
    let ci = std::env::var_os("CI").is_some_and(|v| !v.is_empty());
    let committed = dir.join(HEADER);
    let same = std::fs::read(&fresh).ok() == std::fs::read(&committed).ok();
    if same {
        return;
    }
    if ci {
        println!("cargo:warning={HEADER} is out of date (the header_is_up_to_date test fails)");
    } else {
        place(&fresh, &committed);
    }
}

/// Copies `from` to `to` through a temporary file beside it (a reader never sees half).
fn place(from: &Path, to: &Path) {
    let dir = to.parent().expect("a directory");
    std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
    let tmp = dir.join(".memloop_zc.h.tmp");
    std::fs::copy(from, &tmp).unwrap_or_else(|e| panic!("writing {}: {e}", tmp.display()));
    std::fs::rename(&tmp, to).unwrap_or_else(|e| panic!("writing {}: {e}", to.display()));
}
