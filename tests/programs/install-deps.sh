#!/usr/bin/env bash
# Installs the programs the real-program suite runs (Debian/Ubuntu packages). Idempotent: when
# every binary is already there it does nothing, so the suite calls it on every run.
set -euo pipefail

# binary → package providing it
declare -A need=(
  [/usr/bin/python3]=python3
  [curl]=curl
  [nginx]=nginx
  [lighttpd]=lighttpd
  [redis-server]=redis-server
  [redis-cli]=redis-tools
  [redis-benchmark]=redis-tools
  [iperf3]=iperf3
  [sockperf]=sockperf
  [dnsmasq]=dnsmasq-base
  [dig]=bind9-dnsutils
  [inetd]=openbsd-inetd
  [in.tftpd]=tftpd-hpa
  [tftp]=tftp-hpa
  [psql]=postgresql-client
  [pgbench]=postgresql-contrib
  [jq]=jq
  [go]=golang-go
  [ping]=iputils-ping
  [file]=file
  [ab]=apache2-utils
  [ip]=iproute2
  [ss]=iproute2
  [setpriv]=util-linux
  [timeout]=coreutils
  [sha256sum]=coreutils
  [losetup]=mount
  [mkfs.ext4]=e2fsprogs
  [fsck.ext4]=e2fsprogs
  [fio]=fio
  [nbdkit]=nbdkit
  [nbdfuse]=nbdfuse
  [fusermount3]=fuse3
)

# The server binaries of PostgreSQL live outside $PATH.
have_postgres() {
  compgen -G '/usr/lib/postgresql/*/bin/postgres' >/dev/null &&
    compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null
}

missing=()
for bin in "${!need[@]}"; do
  command -v "$bin" >/dev/null 2>&1 || missing+=("${need[$bin]}")
done
have_postgres || missing+=(postgresql postgresql-contrib)

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
mapfile -t pkgs < <(printf '%s\n' "${missing[@]}" | sort -u)
echo "install-deps: installing ${pkgs[*]}"
if [ "$(id -u)" != 0 ]; then
  echo "install-deps: need root to install packages" >&2
  exit 1
fi
command -v apt-get >/dev/null || { echo "install-deps: no apt-get; install ${pkgs[*]} by hand" >&2; exit 1; }
export DEBIAN_FRONTEND=noninteractive
# Package scripts must not start the system's own redis/nginx/postgres services.
policy=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' >"$policy"
  chmod +x "$policy"
  created_policy=1
fi
cleanup() { if [ $created_policy = 1 ]; then rm -f "$policy"; fi; }
trap cleanup EXIT
timeout 600 apt-get update -qq
timeout 1200 apt-get install -y -qq --no-install-recommends "${pkgs[@]}"
