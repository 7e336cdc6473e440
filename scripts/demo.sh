#!/usr/bin/env bash
# The README's main job: memloop beside the kernel paths, side by side in one run.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v cargo >/dev/null || { curl -sSf https://sh.rustup.rs | sh -s -- -y; . "$HOME/.cargo/env"; }
cargo build --release -q -p memloop-cli
exec target/release/memloop bench native "$@"
