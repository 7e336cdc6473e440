//! What the cross-process test binaries share: a region of their own, destroyed at the end.

use memloop::{CreateRegion, Node, Region, RegionSpec};

/// A fresh region `test-TAG-PID` with tables sized for `size` bytes.
pub struct TestRegion {
    pub name: String,
    #[allow(dead_code)] // (some test binaries only hand the name to their children)
    pub region: Region,
}

impl TestRegion {
    pub fn new(tag: &str, size: u64) -> Self {
        let name = format!("test-{tag}-{}", std::process::id());
        let spec = RegionSpec::Named(name.clone());
        let _ = Region::destroy(&spec);
        let opts = CreateRegion {
            params: memloop::registry::RegionParams::for_size(size),
            ..CreateRegion::default()
        };
        let region = Region::open_or_create(&spec, &opts).unwrap();
        Self { name, region }
    }

    /// A member of the region under `name` (a second attach, as another process would).
    #[allow(dead_code)] // (not every test binary joins from the test process)
    pub fn node(&self, name: &str) -> Node {
        let region = Region::open(&RegionSpec::Named(self.name.clone())).unwrap();
        Node::join(region, name).unwrap()
    }
}

impl Drop for TestRegion {
    fn drop(&mut self) {
        let _ = Region::destroy(&RegionSpec::Named(self.name.clone()));
    }
}
