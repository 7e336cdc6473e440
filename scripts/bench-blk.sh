#!/usr/bin/env bash
# `memloop bench blk` for the committed results: the block device over the region (MMBlk,
# `memloop blk export` / `attach`) against NBD over TCP (nbdkit / nbdfuse) between two domains
# and against a loop device on a local file — fio 4 KiB random read and write at queue depth
# 32, 1 MiB sequential read and write at queue depth 8, every path a loop device with direct
# I/O in the client domain, then PostgreSQL (initdb, pgbench at 1 and 4 clients) on an ext4 on
# each — with ratios against the issue's targets (≥ 2× NBD, ≥ 0.5× the local file, ≥ 0.9× its
# TPS). Builds memloop and memloop-bench, installs fio, nbdkit, nbdfuse and PostgreSQL if
# missing (apt-get), then runs
#   memloop bench blk --json docs/results/$STEM.json "$@"
# and writes its output to docs/results/$STEM.txt (progress lines go to stderr); STEM is
# bench-blk unless set (e.g. STEM=bench-blk-disk with --dir /var/tmp --only pgbench).
#   sudo scripts/bench-blk.sh [--repeat N] [--duration SECS] [--size 256M] [--only randread,write]
#                             [--dir DIR]
# Needs root (network namespaces, FUSE, loop devices). Run it on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "bench-blk.sh: needs root (network namespaces, FUSE, loop devices)" >&2; exit 2; }
cargo build --release -q -p memloop-cli -p memloop-bench

# binary → Debian package
declare -A need=([fio]=fio [losetup]=mount [nbdkit]=nbdkit [nbdfuse]=nbdfuse [fusermount3]=fuse3 [ip]=iproute2
  [pgbench]=postgresql-contrib [pg_ctlcluster]=postgresql [mkfs.ext4]=e2fsprogs [setpriv]=util-linux)
missing=()
for bin in "${!need[@]}"; do
  command -v "$bin" >/dev/null 2>&1 || missing+=("${need[$bin]}")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "bench-blk.sh: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

mkdir -p docs/results
stem=${STEM:-bench-blk}
out=docs/results/$stem.txt
tmp=$(mktemp /tmp/bench-blk.XXXXXX)
trap 'rm -f "$tmp"' EXIT
target/release/memloop bench blk --json "docs/results/$stem.json" "$@" | tee "$tmp"
# `results written to …` names the JSON file: keep it in the text, as the other results do.
cp "$tmp" "$out"
echo "bench-blk.sh: wrote $out and docs/results/$stem.json" >&2
