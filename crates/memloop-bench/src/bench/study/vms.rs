//! Experiment 10: the VM paths. Two QEMU guests (software emulation) and the host on one
//! ivshmem region, measured by the repository's VM test (`tests/vm/memloop.sh`): 64 B round
//! trips and 64 KB streams through memloop (native API and transparent ring) and through
//! virtio-net, guest to guest and guest to host.

use super::lab::Lab;
use super::plot::Figure;
use super::Rec;
use crate::error::{fail, CliResult, Context};
use indicatif::ProgressBar;
use serde::Deserialize;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};

/// One row of the VM test's `--json` output.
#[derive(Deserialize)]
struct Row {
    peer: String,
    path: String,
    test: String,
    value: f64,
}

/// `tests/vm/memloop.sh` of the source tree this binary was built in (target/*/memloop).
fn vm_test() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let root = exe.parent()?.parent()?.parent()?;
    let script = root.join("tests/vm/memloop.sh");
    script.is_file().then_some(script)
}

pub fn exp10(l: &mut Lab, bar: &ProgressBar, out: &mut Vec<Rec>) -> CliResult<()> {
    if l.quick {
        return Err(fail(
            "unavailable: two QEMU guests take about a minute (not in --quick)",
        ));
    }
    let Some(script) = vm_test() else {
        return Err(fail(
            "unavailable: tests/vm/memloop.sh not found next to this build (run from a source tree)",
        ));
    };
    bar.set_message("10. two QEMU guests on one ivshmem region (about a minute)");
    // One pair of files per round: a failed round's log must survive the next round.
    static ROUND: AtomicU32 = AtomicU32::new(0);
    let tag = format!("{}-{}", std::process::id(), ROUND.fetch_add(1, Relaxed) + 1);
    let json = std::env::temp_dir().join(format!("memloop-study-vm-{tag}.json"));
    let log = std::env::temp_dir().join(format!("memloop-study-vm-{tag}.log"));
    let status = Command::new("bash")
        .arg(&script)
        .arg("--json")
        .arg(&json)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&log).context("creating the VM test's log")?)
        .stderr(Stdio::null())
        .status()
        .context(format!("running {}", script.display()))?;
    let rows = std::fs::read_to_string(&json)
        .map_err(|e| {
            fail(format!(
                "{e}: the VM test wrote no figures (log: {})",
                log.display()
            ))
        })
        .and_then(|s| Ok(serde_json::from_str::<Vec<Row>>(&s)?));
    let _ = std::fs::remove_file(&json);
    for r in rows? {
        let (size, unit) = match r.test.as_str() {
            "rr" => (64, "round trip p50 µs"),
            _ => (65536, "Gbit/s"),
        };
        out.push(
            Rec::new(10, &r.test, &path_name(&r.path), size, unit, r.value).variant(
                match r.peer.as_str() {
                    "host" => "guest ↔ host",
                    _ => "guest ↔ guest",
                },
            ),
        );
    }
    bar.inc(1);
    if !status.success() {
        return Err(fail(format!(
            "the VM test failed (its checks, not only the figures; log: {})",
            log.display()
        )));
    }
    let _ = std::fs::remove_file(&log);
    Ok(())
}

fn path_name(p: &str) -> String {
    match p {
        "native" => "memloop native",
        "ring" => "memloop",
        "virtio" => "virtio-net",
        "outside" => "outside the region (TCP)",
        other => other,
    }
    .into()
}

pub fn fig10(r: &[Rec]) -> Vec<Figure> {
    let panel = |test: &'static str, title: &str, y: &str| {
        super::exps::bars(
            title,
            y,
            r,
            |x| x.test == test,
            |x| x.variant.clone().unwrap_or_default(),
            |x| x.path.clone(),
        )
    };
    vec![
        panel(
            "rr",
            "10. VMs: 64 B round trip, median (lower is better)",
            "µs",
        ),
        panel("stream", "10. VMs: stream of 64 KB messages", "Gbit/s"),
    ]
}
