#!/usr/bin/env bash
# `memloop bench link` for the committed results: the network link over the region (MMNet,
# `memloop link`) against veth+bridge between two domains — one TCP flow (iperf3), 64 B TCP
# round trips, ping, the idle link's CPU — with ratios against the issue's targets (stream
# ≥ 2×, round trip ≤ 0.7×, idle < 1 %). Builds memloop and memloop-bench, installs iperf3 and
# ping if missing (apt-get; sockperf too, for comparisons by hand), then runs
#   memloop bench link --json docs/results/bench-link.json "$@"
# and writes its output to docs/results/bench-link.txt (progress lines go to stderr).
#   sudo scripts/bench-link.sh [--repeat N] [--duration SECS] [--spin-us US] [--only stream,rr]
# Needs root (network namespaces, TUN devices). Run it on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "bench-link.sh: needs root (network namespaces, TUN devices)" >&2; exit 2; }
cargo build --release -q -p memloop-cli -p memloop-bench

# binary → Debian package
declare -A need=([iperf3]=iperf3 [sockperf]=sockperf [ping]=iputils-ping [ip]=iproute2)
missing=()
for bin in "${!need[@]}"; do
  command -v "$bin" >/dev/null 2>&1 || missing+=("${need[$bin]}")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "bench-link.sh: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

mkdir -p docs/results
out=docs/results/bench-link.txt
tmp=$(mktemp /tmp/bench-link.XXXXXX)
trap 'rm -f "$tmp"' EXIT
target/release/memloop bench link --json docs/results/bench-link.json "$@" | tee "$tmp"
# `results written to …` names the JSON file: keep it in the text, as the other results do.
cp "$tmp" "$out"
echo "bench-link.sh: wrote $out and docs/results/bench-link.json" >&2
