#!/usr/bin/env bash
# Installs what the runtime conformance suite builds and runs (Debian/Ubuntu packages, and
# uvloop from PyPI). Idempotent: when everything is there it does nothing.
set -euo pipefail

# file or binary → package providing it
declare -A need=(
  [gcc]=gcc
  [g++]=g++
  [/usr/include/uv.h]=libuv1-dev
  [/usr/include/boost/asio.hpp]=libboost-dev
  [javac]=openjdk-17-jdk-headless
  [java]=openjdk-17-jre-headless
  [node]=nodejs
  [python3]=python3
  [timeout]=coreutils
)

missing=()
for what in "${!need[@]}"; do
  case "$what" in
    /*) [ -e "$what" ] || missing+=("${need[$what]}") ;;
    *) command -v "$what" >/dev/null 2>&1 || missing+=("${need[$what]}") ;;
  esac
done

if [ ${#missing[@]} -gt 0 ]; then
  mapfile -t pkgs < <(printf '%s\n' "${missing[@]}" | sort -u)
  echo "runtimes/install-deps: installing ${pkgs[*]}"
  if [ "$(id -u)" != 0 ]; then
    echo "runtimes/install-deps: need root to install ${pkgs[*]}" >&2
    exit 1
  fi
  command -v apt-get >/dev/null || { echo "runtimes/install-deps: no apt-get; install ${pkgs[*]} by hand" >&2; exit 1; }
  export DEBIAN_FRONTEND=noninteractive
  timeout 600 apt-get update -qq
  timeout 1200 apt-get install -y -qq --no-install-recommends "${pkgs[@]}"
fi

# uvloop is optional for the suite's own sake (a failed install leaves its tests failing under
# CI, skipped elsewhere, with the reason), but install it when pip can.
if ! python3 -c 'import uvloop' >/dev/null 2>&1; then
  echo "runtimes/install-deps: pip install uvloop"
  timeout 600 python3 -m pip install -q --disable-pip-version-check uvloop 2>&1 | grep -v 'Running pip as the' ||
    echo "runtimes/install-deps: uvloop did not install (its tests will say so)" >&2
fi
