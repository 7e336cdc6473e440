#!/usr/bin/env bash
# The zero-copy pipeline demo (issue 17): three processes in C on memloop's zero-copy API —
# source → middle → sink — in a fresh region. The source fills each buffer once; the middle
# inspects and forwards (its own header + a sub-range of what it received, or the message
# whole) without copying; the sink checks every payload byte end to end. Each stage reports
# the payload bytes it copied (0 after the source). Then, unless --no-bench, the pipeline and
# latency figures of `memloop bench zerocopy --quick` (zero-copy vs memloop's copying streams).
#   scripts/zc-pipeline.sh [--no-bench] [MESSAGES]
set -euo pipefail
cd "$(dirname "$0")/.."
bench=1
if [ "${1:-}" = "--no-bench" ]; then bench=0; shift; fi
messages="${1:-1000}"
command -v cc >/dev/null || { apt-get update -qq && apt-get install -y -qq gcc >/dev/null; }
cargo build --release -q -p memloop-capi -p memloop-cli -p memloop-bench
lib="$PWD/target/release"
exe="$(mktemp -d)/zc_pipeline"
cc -std=c11 -Wall -Wextra -Werror -O2 -Icrates/memloop-capi/include \
  crates/memloop-capi/examples/c/zc_pipeline.c -L"$lib" -lmemloop_zc -Wl,-rpath,"$lib" -o "$exe"
region="zc-demo-$$"
trap 'target/release/memloop region destroy --region "$region" >/dev/null 2>&1 || true; rm -rf "$(dirname "$exe")"' EXIT
target/release/memloop region create --region "$region" --size 256M >/dev/null
echo "== a three-process zero-copy pipeline in C ($messages messages)"
LD_LIBRARY_PATH="$lib" "$exe" "$region" "$messages"
if [ "$bench" = 1 ]; then
  echo "== memloop bench zerocopy --quick"
  target/release/memloop bench zerocopy --quick
fi
