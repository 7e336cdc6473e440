#!/usr/bin/env bash
# `memloop bench zerocopy` with its iceoryx2 baseline: builds memloop-bench with the
# `iceoryx2` feature (off by default: it adds a few dozen crates to the build) into the normal
# target directory, then runs the benchmark with the arguments given.
#   scripts/bench-zerocopy.sh [--quick] [--json FILE] [--sizes 64,4K,64K,1M,4M] ...
# Needs no root and no setup beyond memloop's own: iceoryx2's files (shared memory in
# /dev/shm, a directory under $TMPDIR) carry the run's tag and are removed at its end.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p memloop-bench --features iceoryx2
exec target/release/memloop-bench zerocopy "$@"
