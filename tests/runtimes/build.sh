#!/usr/bin/env bash
# Builds the runtime conformance suite's programs (tests/runtimes/README.md) into
# target/runtimes/ (the tokio one into target/release/, as a workspace binary), installing
# missing toolchains first. Rebuilds only what is older than its source.
#
#   tests/runtimes/build.sh              # install (when missing) and build
#   tests/runtimes/build.sh --no-install # build with what is there
set -euo pipefail
cd "$(dirname "$0")/../.."
src=tests/runtimes
out=${MEMLOOP_RUNTIMES_DIR:-target/runtimes}
mkdir -p "$out/java"

[ "${1:-}" = "--no-install" ] || "$src/install-deps.sh"

# newer OUT SRC...: true when OUT is missing or older than a source (or than this script).
stale() {
  local o=$1
  shift
  [ -e "$o" ] || return 0
  for s in "$@" "$0"; do [ "$s" -nt "$o" ] && return 0; done
  return 1
}

echo "runtimes: tokio (cargo, memloop-runtime-peers)"
cargo build --release -q -p memloop-runtime-peers

if stale "$out/uv_echo" "$src/libuv/uv_echo.c"; then
  echo "runtimes: libuv (gcc)"
  gcc -std=gnu11 -O2 -g -Wall -Wextra -Wshadow -Wformat=2 -Werror \
    -o "$out/uv_echo" "$src/libuv/uv_echo.c" -luv
fi

if stale "$out/asio_echo" "$src/asio/asio_echo.cpp"; then
  echo "runtimes: Boost.Asio (g++)"
  g++ -std=c++17 -O2 -g -Wall -Wextra -Wshadow -Werror -pthread \
    -o "$out/asio_echo" "$src/asio/asio_echo.cpp"
fi

if stale "$out/java/NioEcho.class" "$src/java/NioEcho.java"; then
  echo "runtimes: JDK NIO (javac)"
  javac -Xlint:all -Werror -d "$out/java" "$src/java/NioEcho.java"
fi

# Interpreted ones: a syntax check, so that a typo fails here rather than mid-suite.
python3 -c 'import ast, sys; ast.parse(open(sys.argv[1]).read(), sys.argv[1])' "$src/python/aio_echo.py"
node --check "$src/node/echo.js"

echo "runtimes: built in $out"
