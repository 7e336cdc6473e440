//! Finding the region inside a VM: QEMU's `ivshmem-plain` device (PCI 1af4:1110) exposes the
//! host's shared file as BAR 2, which Linux lets root map through sysfs `resource2` — no
//! driver needed, only the device's memory decoding switched on (`enable`).

use crate::error::Error;
use std::fs;
use std::path::{Path, PathBuf};

const VENDOR: &str = "0x1af4";
const DEVICE: &str = "0x1110";
const PCI_DEVICES: &str = "/sys/bus/pci/devices";

/// The `resource2` file of the ivshmem device at `bdf` (e.g. `0000:00:03.0`), or of the only
/// one present. Turns the device on if it is off.
pub fn find(bdf: Option<&str>) -> Result<PathBuf, Error> {
    find_in(Path::new(PCI_DEVICES), bdf)
}

fn find_in(root: &Path, bdf: Option<&str>) -> Result<PathBuf, Error> {
    let found: Vec<PathBuf> = match bdf {
        Some(b) => vec![root.join(b)],
        None => fs::read_dir(root)
            .map_err(|e| Error::NoDevice(format!("cannot list {}: {e}", root.display())))?
            .filter_map(|d| d.ok().map(|d| d.path()))
            .filter(|d| is_ivshmem(d))
            .collect(),
    };
    let dev = match found.as_slice() {
        [one] if is_ivshmem(one) => one.clone(),
        [one] => {
            return Err(Error::NoDevice(format!(
                "{} is not an ivshmem device (PCI {VENDOR}:{DEVICE})",
                one.display()
            )))
        }
        [] => {
            return Err(Error::NoDevice(format!(
                "no ivshmem device (PCI {VENDOR}:{DEVICE}) under {}",
                root.display()
            )))
        }
        many => {
            let names: Vec<String> = many.iter().map(|p| bdf_of(p)).collect();
            return Err(Error::NoDevice(format!(
                "{} ivshmem devices ({}): name one, e.g. ivshmem:{}",
                many.len(),
                names.join(", "),
                names[0]
            )));
        }
    };
    enable(&dev)?;
    Ok(dev.join("resource2"))
}

fn is_ivshmem(dev: &Path) -> bool {
    let read = |f: &str| fs::read_to_string(dev.join(f)).unwrap_or_default();
    read("vendor").trim() == VENDOR && read("device").trim() == DEVICE
}

fn bdf_of(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// A device nobody has bound a driver to has memory decoding off: its BAR reads as all ones.
fn enable(dev: &Path) -> Result<(), Error> {
    let path = dev.join("enable");
    match fs::read_to_string(&path) {
        Ok(s) if s.trim() != "0" => Ok(()),
        _ => fs::write(&path, "1").map_err(|e| {
            Error::NoDevice(format!("cannot enable {} (needs root): {e}", dev.display()))
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_device(root: &Path, bdf: &str, vendor: &str, device: &str, enabled: &str) {
        let d = root.join(bdf);
        fs::create_dir_all(&d).unwrap();
        fs::write(d.join("vendor"), format!("{vendor}\n")).unwrap();
        fs::write(d.join("device"), format!("{device}\n")).unwrap();
        fs::write(d.join("enable"), enabled).unwrap();
    }

    #[test]
    fn finds_enables_and_refuses_ambiguity() {
        let root = std::env::temp_dir().join(format!("memloop-ivshmem-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        fake_device(&root, "0000:00:02.0", "0x1af4", "0x1000", "1"); // virtio-net
        assert!(matches!(find_in(&root, None), Err(Error::NoDevice(_))));
        fake_device(&root, "0000:00:03.0", VENDOR, DEVICE, "0\n");
        let p = find_in(&root, None).unwrap();
        assert_eq!(p, root.join("0000:00:03.0/resource2"));
        assert_eq!(
            fs::read_to_string(root.join("0000:00:03.0/enable")).unwrap(),
            "1"
        );
        fake_device(&root, "0000:00:04.0", VENDOR, DEVICE, "1");
        let e = find_in(&root, None).unwrap_err().to_string();
        assert!(e.contains("2 ivshmem devices"), "{e}");
        assert!(find_in(&root, Some("0000:00:04.0")).is_ok());
        assert!(find_in(&root, Some("0000:00:02.0")).is_err());
        fs::remove_dir_all(&root).unwrap();
    }
}
