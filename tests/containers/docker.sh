#!/usr/bin/env bash
# memloop between real docker containers. Docker has no precreate hooks: the containers opt in
# through the OCI runtime wrapper (`memloop` called as `memloop-runc`, registered with dockerd as
# the runtime "memloop"), with `--annotation io.memloop.region=R` where the daemon takes
# annotations (API ≥ 1.43, docker ≥ 24) and `-e MEMLOOP_CONTAINER_REGION=R` where it does not
# (Debian 12's docker.io is 20.10):
#   1. redis-server in one container, redis-benchmark in another, on docker's default bridge
#      (docker0), both `--runtime memloop` and opted in: the results are checked and the region
#      saw ring bytes;
#   2. the same client, same runtime, not opted in: plain TCP over docker0, the region untouched;
#   3. a client container blocked in recv on an opted-in server container whose process is
#      SIGKILLed: `memloop status` first shows both as members in their containers (pid 1 in
#      their own pid namespace, docker's container id); the client sees EOF or a reset within
#      2 s, and the region returns to its baseline (no live member, no channel);
#   4. a region the wrapper cannot open: the container still runs, on the kernel path.
# This script starts its own dockerd (socket, exec root and data root in a temporary directory,
# no systemd; see dockerd_args) and stops it at the end. No registry is reachable: the image is `docker import`ed from a root file
# system assembled here from the host's Debian programs (redis, python3, dash and the libraries
# they link; ~30 MB, imported in ~0.5 s, so it is not cached between runs).
# Needs root and docker.io (installed with apt-get if missing). MEMLOOP_BIN: the memloop binary
# (default target/release/memloop; its libmemloop.so beside it). Exit status 0 = passed; a
# machine where dockerd cannot run prints "skipped (reason)" (a failure when CI is set).
set -euo pipefail
M=$(realpath -m "${MEMLOOP_BIN:-$(dirname "$0")/../../target/release/memloop}")
cd "$(dirname "$0")/../.."
[ -x "$M" ] && [ -f "$(dirname "$M")/libmemloop.so" ] ||
  { echo "containers (docker): build first: cargo build --release -p memloop-cli -p memloop-preload" >&2; exit 1; }
started=$(date +%s.%N)

skip() {
  if [ -n "${CI:-}" ]; then echo "containers (docker): FAILED (cannot run here): $*" >&2; exit 1; fi
  echo "containers (docker): skipped ($*)"
  exit 0
}
fail() {
  echo "containers (docker): FAILED: $*" >&2
  [ -z "${work:-}" ] || tail -n 5 "$work/dockerd.log" 2>/dev/null | sed 's/^/  dockerd: /' >&2
  exit 1
}
ok() { echo "containers (docker): ok: $*"; passed=$((passed + 1)); }

[ "$(id -u)" = 0 ] || skip "needs root"
if ! command -v dockerd >/dev/null || ! command -v runc >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io runc) \
    >/dev/null 2>&1 || skip "cannot install docker.io"
fi
# The client of the same package as the daemon (another docker CLI may come first in PATH).
DOCKER=$(dirname "$(dirname "$(command -v dockerd)")")/bin/docker
[ -x "$DOCKER" ] || DOCKER=$(command -v docker) || skip "dockerd has no docker client"
if pgrep -x dockerd >/dev/null && ip link show docker0 >/dev/null 2>&1; then
  skip "another dockerd runs here and owns docker0"
fi

work=$(mktemp -d /tmp/memloop-docker.XXXXXX)
R=ml-dkr-$$
tag=mlt$$
passed=0
dpid=""
cpid=""
members=()
had_docker0=$(ip link show docker0 >/dev/null 2>&1 && echo yes || true)
mkdir -p "$work/share" "$work/rt"
ln -s "$M" "$work/rt/memloop-runc"
echo '{}' >"$work/daemon.json" # not /etc/docker/daemon.json: nothing of the host's settings
dk() { "$DOCKER" -H "unix://$work/docker.sock" "$@"; }
status() { "$M" status --json --region "$R"; }

stop_dockerd() {
  kill -TERM "$dpid" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "$dpid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$dpid" 2>/dev/null; then
    echo "containers (docker): dockerd did not stop in 10 s, killing it" >&2
    kill -KILL "$dpid" 2>/dev/null || true
  fi
  wait "$dpid" 2>/dev/null || true
  dpid=""
}
down() {
  if [ -n "$dpid" ]; then
    local ids
    ids=$(dk ps -aq 2>/dev/null || true)
    [ -z "$ids" ] || dk rm -f $ids >/dev/null 2>&1 || true
    stop_dockerd
  fi
  # The containerd that dockerd started (it stops it, unless dockerd had to be killed).
  if [ -n "$cpid" ] && grep -qF "$work/" "/proc/$cpid/cmdline" 2>/dev/null; then
    kill -KILL "$cpid" 2>/dev/null || true
  fi
  [ -n "$had_docker0" ] || ip link del docker0 2>/dev/null || true
  "$M" region destroy --region "$R" >/dev/null 2>&1 || true
  local m
  for m in $(findmnt -rn -o TARGET | grep "^$work/" | sort -r); do umount -l "$m" 2>/dev/null || true; done
  rm -rf --one-file-system "$work"
}
trap down EXIT
trap 'exit 143' TERM HUP
trap 'exit 130' INT

# ---- the daemon
dockerd_args=(
  --config-file "$work/daemon.json" -H "unix://$work/docker.sock" --pidfile "$work/dockerd.pid"
  --data-root "$work/data" --exec-root "$work/exec"
  --exec-opt native.cgroupdriver=cgroupfs # its default on cgroup v1 (hybrid here), made explicit
  --iptables=false --ip-masq=false        # the host's firewall left alone: one bridge needs no NAT
  --add-runtime "memloop=$work/rt/memloop-runc"
)
start_dockerd() { # STORAGE_DRIVER
  dockerd "${dockerd_args[@]}" --storage-driver "$1" </dev/null >"$work/dockerd.log" 2>&1 &
  dpid=$!
  for _ in $(seq 150); do
    if dk version >/dev/null 2>&1; then
      cpid=$(pgrep -P "$dpid" -x containerd || true)
      return 0
    fi
    kill -0 "$dpid" 2>/dev/null || break
    sleep 0.2
  done
  stop_dockerd
  return 1
}
driver=overlay2
start_dockerd overlay2 || { driver=vfs; start_dockerd vfs; } ||
  skip "dockerd does not start here: $(grep -E 'level=(error|fatal)|failed' "$work/dockerd.log" | tail -n 2 | tr '\n' ' ')"
api=$(dk version -f '{{.Server.APIVersion}}')
if dk run --help 2>/dev/null | grep -q -- --annotation &&
  [ "$(printf '%s\n1.43\n' "$api" | sort -V | head -n 1)" = 1.43 ]; then
  optin=(--annotation "io.memloop.region=$R")
  how="--annotation io.memloop.region"
else
  optin=(-e "MEMLOOP_CONTAINER_REGION=$R")
  how="-e MEMLOOP_CONTAINER_REGION (API $api has no annotations)"
fi
"$M" region create --region "$R" >/dev/null

# ---- the image: the host's programs and the libraries they link, nothing else
rootfs() { # DIR
  local dir=$1 f py stdlib files
  py=$(readlink -f /usr/bin/python3)
  stdlib=$("$py" -c 'import os; print(os.path.dirname(os.__file__))')
  mkdir -p "$dir"/{usr/bin,usr/lib64,etc,tmp,run,proc,sys,dev}
  chmod 1777 "$dir/tmp"
  ln -s usr/bin "$dir/bin"
  ln -s usr/lib "$dir/lib"
  ln -s usr/lib64 "$dir/lib64"
  ln -s bin "$dir/usr/sbin"
  printf 'root:x:0:0:root:/root:/bin/sh\n' >"$dir/etc/passwd"
  printf 'root:x:0:\n' >"$dir/etc/group"
  # Python: only the modules the test's scripts load (and every codec), from the standard library.
  files=$(
    echo /usr/bin/redis-benchmark /usr/bin/redis-cli /usr/bin/dash "$py"
    "$py" -s -c 'import socket, sys, threading, time
socket.getaddrinfo("127.0.0.1", 1)  # loads the idna codec and what it needs
for m in list(sys.modules.values()):
    f = getattr(m, "__file__", None) or ""
    if f.startswith(sys.prefix + "/lib/python"): print(f)'
    find "$stdlib/encodings" -name '*.py'
  )
  for f in $files; do install -D -m "$(stat -Lc %a "$f")" "$f" "$dir$f"; done
  install -D /usr/bin/redis-server "$dir/usr/bin/redis-server" # a link to redis-check-rdb
  ln -s dash "$dir/usr/bin/sh"
  ln -s "$(basename "$py")" "$dir/usr/bin/python3"
  mkdir -p "$dir$stdlib/lib-dynload" # where python looks for its exec prefix
  # shellcheck disable=SC2046 # the paths are words
  for f in $(ldd /usr/bin/redis-server $(printf '%s\n' $files | grep -E '\.so$|/bin/') 2>/dev/null |
    grep -o '/[^ ]*\.so[^ ]*' | sort -u); do
    install -D "$f" "$dir$(realpath -s "$f")"
  done
}
for p in /usr/bin/redis-server /usr/bin/redis-benchmark /usr/bin/redis-cli /usr/bin/dash /usr/bin/python3; do
  [ -x "$p" ] || skip "no $p on the host (the image is made of the host's programs)"
done
rootfs "$work/rootfs"
img=memloop-test/redis:$$
tar -C "$work/rootfs" -c . | dk import - "$img" >/dev/null || fail "docker import"
rm -rf "$work/rootfs"
run() { dk run --label memloop-test=1 "$@"; }
opted() { run --runtime memloop "${optin[@]}" "$@"; }
run --rm "$img" /bin/sh -c : || skip "docker cannot start a container here: $(tail -n 2 "$work/dockerd.log")"
echo "containers (docker): dockerd $(dk version -f '{{.Server.Version}}') (API $api, storage $driver, cgroupfs, no iptables) up in $(python3 -c "import time; print(f'{time.time() - $started:.1f}')") s; opting in with $how"

# ---- 1. an opted-in pair
opted -d --name "$tag-srv" "$img" redis-server --port 6390 --protected-mode no --save '' \
  --appendonly no >/dev/null || fail "the server container did not start"
ip=$(dk inspect -f '{{.NetworkSettings.IPAddress}}' "$tag-srv")
[ -n "$ip" ] || fail "the server container has no address on docker0"
for _ in $(seq 20); do
  run --rm "$img" redis-cli -h "$ip" -p 6390 ping 2>/dev/null | grep -q PONG && break
  sleep 0.1
done
opted --rm --name "$tag-cli" "$img" redis-benchmark -h "$ip" -p 6390 -n 20000 -c 4 -q -t set,get \
  >"$work/bench.txt" 2>&1 || fail "redis-benchmark: $(tail -n 3 "$work/bench.txt")"
tr '\r' '\n' <"$work/bench.txt" | grep -E "^(SET|GET): [0-9.]+ requests per second" >"$work/rps.txt" || true
[ "$(wc -l <"$work/rps.txt")" = 2 ] || fail "redis-benchmark results: $(tail -c 300 "$work/bench.txt")"
v=$(status)
ring=$(jq '.ring_bytes' <<<"$v")
[ "$ring" -gt 100000 ] || fail "the opted-in pair left $ring ring bytes: $(jq -c '.fallbacks' <<<"$v")"
ok "opted-in pair on docker0: $(paste -sd ' ' "$work/rps.txt" | sed 's/ requests per second/ rps/g'), $ring ring bytes"

# ---- 2. the same client under the same runtime, not opted in: TCP, the region untouched
run --rm --runtime memloop "$img" redis-benchmark -h "$ip" -p 6390 -n 20000 -c 4 -q -t set,get \
  >"$work/plain.txt" 2>&1 || fail "redis-benchmark (not opted in): $(tail -n 3 "$work/plain.txt")"
tr '\r' '\n' <"$work/plain.txt" | grep -E "^(SET|GET): [0-9.]+ requests per second" >"$work/plain-rps.txt" || true
[ "$(wc -l <"$work/plain-rps.txt")" = 2 ] || fail "redis-benchmark (not opted in) results"
ring2=$(status | jq '.ring_bytes')
[ "$ring2" = "$ring" ] || fail "a client that was not opted in moved ring bytes ($ring -> $ring2)"
ok "not opted in (same runtime): $(paste -sd ' ' "$work/plain-rps.txt" | sed 's/ requests per second/ rps/g') over docker0"

# ---- 3. members in their containers, then SIGKILL of the server container's process
cat >"$work/share/blocked.py" <<'EOF'
import socket, sys, time
s = socket.create_connection((sys.argv[1], 6390))
s.sendall(b"PING\r\n")
assert s.recv(100) == b"+PONG\r\n"
open(sys.argv[2], "w").close()
try:
    what = f"EOF {s.recv(100)!r}"
except OSError as e:
    what = f"error {e.errno}"
print(f"{what} at {time.time():.3f}", flush=True)
EOF
opted --rm --name "$tag-kill" -v "$work/share:/share" "$img" python3 /share/blocked.py "$ip" \
  /share/ready >"$work/blocked.out" 2>&1 &
kpid=$!
for _ in $(seq 100); do [ -e "$work/share/ready" ] && break; sleep 0.1; done
[ -e "$work/share/ready" ] || fail "the blocked client never connected: $(cat "$work/blocked.out")"
v=$(status)
for who in srv:redis-server kill:python3; do
  id=$(dk inspect -f '{{.Id}}' "$tag-${who%%:*}" | cut -c1-12)
  m=$(jq -c --arg id "$id" --arg n "${who#*:}" \
    '[.members[] | select(.container == $id and .name == $n and .alive)] | .[0]' <<<"$v")
  [ "$m" != null ] || fail "status shows no live ${who#*:} member in container $id: $(jq -c '[.members[] | {name, pid, container, alive}]' <<<"$v")"
  [ "$(jq '.pid' <<<"$m")" = 1 ] || fail "the ${who#*:} member's pid is not its container's 1: $m"
  members+=("${who#*:} in $id")
done
ok "memloop status: members $(printf '%s, ' "${members[@]}")pid 1 each, docker's container ids"
sleep 0.5 # asleep in recv by now
killed_at=$(date +%s.%N)
dk kill -s KILL "$tag-srv" >/dev/null
wait "$kpid" || fail "the blocked client failed: $(cat "$work/blocked.out")"
seen=$(grep -o 'at [0-9.]*$' "$work/blocked.out" | cut -c4-)
[ -n "$seen" ] || fail "the blocked client said: $(cat "$work/blocked.out")"
took=$(python3 -c "print(f'{$seen - $killed_at:.3f}')")
python3 -c "import sys; sys.exit(0 if $took < 2.0 else 1)" ||
  fail "the client saw its peer's death after $took s (want < 2 s): $(cat "$work/blocked.out")"
dk rm -f "$tag-srv" >/dev/null 2>&1 || true
baseline=""
for _ in $(seq 50); do
  "$M" region reclaim --region "$R" >/dev/null 2>&1 || true
  v=$(status)
  if [ "$(jq '[.members[] | select(.alive)] | length' <<<"$v")" = 0 ] &&
    [ "$(jq '.channels | length' <<<"$v")" = 0 ]; then
    baseline=yes
    break
  fi
  sleep 0.2
done
[ -n "$baseline" ] || fail "the region did not return to its baseline: $(jq -c '{members: [.members[] | {name, alive}], channels: (.channels | length)}' <<<"$v")"
ok "server container SIGKILLed: the client saw $(cut -d' ' -f1-2 "$work/blocked.out") ${took} s later; the region is back to no live member and no channel"

# ---- 4. a region the wrapper cannot open: the container runs anyway
bad=("${optin[@]}")
bad[1]=${bad[1]%%=*}=$work/not-a-region-dir/
out=$(run --rm --runtime memloop "${bad[@]}" "$img" /bin/sh -c 'echo "ran LD_PRELOAD=${LD_PRELOAD:-none}"' 2>&1) ||
  fail "a container with an unusable region did not run: $out"
grep -q "ran LD_PRELOAD=none" <<<"$out" || fail "a container with an unusable region: $out"
ok "unusable region: the container ran without memloop"

echo "containers (docker): all $passed checks passed in $(python3 -c "import time; print(f'{time.time() - $started:.0f}')") s"
