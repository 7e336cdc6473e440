#!/usr/bin/env bash
# memloop between real podman containers, opted in by an annotation (no image touched):
#   1. redis-server in one container, redis-benchmark in another, both annotated
#      io.memloop.region=R (the OCI hook of `memloop container install` mounts the region, its
#      wake-socket directory and the library, and sets LD_PRELOAD/MEMLOOP_REGION): the results
#      are checked, the region saw ring bytes, and `memloop status` shows both as members in
#      their containers (pid 1 in their own pid namespace, container id);
#   2. the same client not annotated: plain TCP over podman's bridge, the region untouched;
#   3. a client container blocked in recv on an opted-in server container whose process is
#      SIGKILLed: the client sees EOF or a reset within 2 s, and the region returns to its
#      baseline (no live member, no channel) once the dead are reclaimed;
#   4. a region the hook cannot open: the container still runs, on the kernel path;
#   5. the same opt-in through the OCI runtime wrapper (`memloop-runc`, for engines without
#      hooks, e.g. docker's `--runtime`), with no hook installed: a pair in the container moves
#      its bytes through a ring;
#   6. a `memloop link` between two containers (each with /dev/net/tun, CAP_NET_ADMIN and the
#      region mounted): ping across it, the counters in the links table; one container
#      SIGKILLed → the other's carrier drops within 3 s; a new container brings it back.
# The containers' root file system is the host's, as an overlay (`--rootfs /:O`): no registry
# is reachable here, and the programs are the host's Debian packages.
# Then the same pair, kill and opt-in checks with docker: tests/containers/docker.sh (its own
# dockerd, started and stopped there; containers opted in through the runtime wrapper).
# Needs root, podman and runc (installed with apt-get if missing). MEMLOOP_BIN: the memloop
# binary (default target/release/memloop; its libmemloop.so beside it). Exit status 0 = passed;
# a machine where podman cannot run at all prints "skipped" (a failure when CI is set).
set -euo pipefail
M=$(realpath -m "${MEMLOOP_BIN:-$(dirname "$0")/../../target/release/memloop}")
cd "$(dirname "$0")/../.."
[ -x "$M" ] && [ -f "$(dirname "$M")/libmemloop.so" ] ||
  { echo "containers: build first: cargo build --release -p memloop-cli -p memloop-preload" >&2; exit 1; }

docker_part() { MEMLOOP_BIN=$M tests/containers/docker.sh; }
skip() {
  if [ -n "${CI:-}" ]; then echo "containers: FAILED (cannot run here): $*" >&2; exit 1; fi
  echo "containers: skipped: $*"
  docker_part
  exit
}
[ "$(id -u)" = 0 ] || skip "needs root"
if ! command -v podman >/dev/null || ! command -v runc >/dev/null; then
  (apt-get update -qq && apt-get install -y -qq podman runc) >/dev/null 2>&1 || skip "cannot install podman and runc"
fi

work=$(mktemp -d /tmp/memloop-containers.XXXXXX)
R=ml-ctr-$$
tag=mlt$$
passed=0
. tests/containers/podman.sh
podman_bed "$work" "$R" "$tag"
fail() { echo "containers: FAILED: $*" >&2; exit 1; }
ok() { echo "containers: ok: $*"; passed=$((passed + 1)); }
pod() { podman run --hooks-dir "$work/hooks" "$@" 2> >(quiet >&2); }
opted() { pod --annotation "io.memloop.region=$R" "$@"; }
status() { "$M" status --json --region "$R"; }

podman run --rm --rootfs /:O /bin/true 2>/dev/null || skip "podman cannot start a container here"

# ---- 1. an opted-in pair
opted -d --name "$tag-srv" --rootfs /:O /usr/bin/redis-server --port 6390 --protected-mode no \
  --save '' --appendonly no >/dev/null
ip=$(podman inspect -f '{{.NetworkSettings.IPAddress}}' "$tag-srv")
[ -n "$ip" ] || fail "the server container has no address"
for _ in $(seq 50); do
  pod --rm --rootfs /:O /usr/bin/redis-cli -h "$ip" -p 6390 ping 2>/dev/null | grep -q PONG && break
  sleep 0.1
done
opted --rm --name "$tag-cli" --rootfs /:O /usr/bin/redis-benchmark -h "$ip" -p 6390 -n 20000 -c 4 \
  -q -t set,get >"$work/bench.txt" 2>&1 || fail "redis-benchmark: $(tail -n 3 "$work/bench.txt")"
tr '\r' '\n' <"$work/bench.txt" | grep -E "^(SET|GET): [0-9.]+ requests per second" >"$work/rps.txt" || true
[ "$(wc -l <"$work/rps.txt")" = 2 ] || fail "redis-benchmark results: $(tail -c 300 "$work/bench.txt")"
v=$(status)
ring=$(jq '.ring_bytes' <<<"$v")
[ "$ring" -gt 100000 ] || fail "the opted-in pair left $ring ring bytes: $(jq -c '.fallbacks' <<<"$v")"
srv_id=$(podman inspect -f '{{.Id}}' "$tag-srv" | cut -c1-12)
member=$(jq -c --arg id "$srv_id" '[.members[] | select(.container == $id and .name == "redis-server")] | .[0]' <<<"$v")
[ "$member" != null ] || fail "status shows no redis-server member in container $srv_id: $(jq -c '.members' <<<"$v")"
[ "$(jq '.pid' <<<"$member")" = 1 ] || fail "the server member's pid is not its container's 1: $member"
ok "opted-in pair: $(paste -sd ' ' "$work/rps.txt" | sed 's/ requests per second/ rps/g'), $ring ring bytes; member $member"

# ---- 2. the same client, not opted in: TCP, the region untouched
pod --rm --rootfs /:O /usr/bin/redis-benchmark -h "$ip" -p 6390 -n 20000 -c 4 -q -t set,get \
  >"$work/plain.txt" 2>&1 || fail "redis-benchmark (not opted in): $(tail -n 3 "$work/plain.txt")"
tr '\r' '\n' <"$work/plain.txt" | grep -E "^(SET|GET): [0-9.]+ requests per second" >"$work/plain-rps.txt" || true
[ "$(wc -l <"$work/plain-rps.txt")" = 2 ] || fail "redis-benchmark (not opted in) results"
ring2=$(status | jq '.ring_bytes')
[ "$ring2" = "$ring" ] || fail "a client that was not opted in moved ring bytes ($ring -> $ring2)"
ok "not opted in: $(paste -sd ' ' "$work/plain-rps.txt" | sed 's/ requests per second/ rps/g') over podman's bridge"

# ---- 3. SIGKILL of the server container's process
cat >"$work/blocked.py" <<'EOF'
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
rm -f "$work/ready"
opted --rm --name "$tag-kill" -v "$work:$work" --rootfs /:O python3 "$work/blocked.py" "$ip" "$work/ready" \
  >"$work/blocked.out" 2>&1 &
kpid=$!
for _ in $(seq 100); do [ -e "$work/ready" ] && break; sleep 0.1; done
[ -e "$work/ready" ] || fail "the blocked client never connected: $(cat "$work/blocked.out")"
sleep 0.5 # asleep in recv by now
killed_at=$(date +%s.%N)
podman kill -s KILL "$tag-srv" >/dev/null
wait "$kpid" || fail "the blocked client failed: $(cat "$work/blocked.out")"
seen=$(grep -o 'at [0-9.]*$' "$work/blocked.out" | cut -c4-)
[ -n "$seen" ] || fail "the blocked client said: $(cat "$work/blocked.out")"
took=$(python3 -c "print(f'{$seen - $killed_at:.3f}')")
python3 -c "import sys; sys.exit(0 if $took < 2.0 else 1)" ||
  fail "the client saw its peer's death after $took s (want < 2 s): $(cat "$work/blocked.out")"
podman rm -f -t 0 "$tag-srv" >/dev/null 2>&1 || true
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

# ---- 4. a region the hook cannot open: the container runs anyway
out=$(pod --annotation "io.memloop.region=$work/not-a-region-dir/" --rm --rootfs /:O /bin/sh -c \
  'echo "ran LD_PRELOAD=${LD_PRELOAD:-none}"' 2>&1) || fail "a container with an unusable region did not run: $out"
grep -q "ran LD_PRELOAD=none" <<<"$out" || fail "a container with an unusable region: $out"
ok "unusable region: the container ran without memloop"

# ---- 5. the runtime wrapper instead of the hook
mkdir -p "$work/rt" "$work/nohooks"
ln -s "$M" "$work/rt/memloop-runc"
cat >"$work/pair.py" <<'PAIR'
import socket, threading
ls = socket.socket(); ls.bind(("127.0.0.1", 0)); ls.listen(1)
data = bytes(range(256)) * 4096  # 1 MiB
def serve():
    c, _ = ls.accept()
    n = 0
    while n < len(data):
        n += len(c.recv(1 << 16))
    c.sendall(b"done")
threading.Thread(target=serve, daemon=True).start()
s = socket.create_connection(ls.getsockname())
s.sendall(data)
assert s.recv(4) == b"done"
print("pair done")
PAIR
before=$(status | jq '.ring_bytes')
out=$(podman run --rm --hooks-dir "$work/nohooks" --runtime "$work/rt/memloop-runc" \
  --annotation "io.memloop.region=$R" -v "$work:$work" --rootfs /:O python3 "$work/pair.py" 2> >(quiet >&2)) ||
  fail "a container under the runtime wrapper: $out"
[ "$out" = "pair done" ] || fail "the pair under the runtime wrapper: $out"
moved=$(($(status | jq '.ring_bytes') - before))
[ "$moved" -ge 1048576 ] || fail "the runtime wrapper's container moved $moved ring bytes (want ≥ 1 MiB)"
ok "runtime wrapper (memloop-runc, no hook): a pair in the container moved $moved bytes through a ring"

# ---- 6. a memloop link between two containers (the link service as each one's process)
link_ctr() { # NAME ADDR
  podman run -d --name "$tag-$1" --device /dev/net/tun --cap-add NET_ADMIN \
    -v "/dev/shm/memloop-$R:/dev/shm/memloop-$R" --rootfs /:O \
    "$M" link up L --addr "$2" --region "$R" --foreground 2> >(quiet >&2) >/dev/null
}
carrier_of() { podman exec "$tag-$1" cat /sys/class/net/ml-L/carrier 2>/dev/null || echo none; }
wait_carrier() { # NAME WANT SECS
  local i
  for ((i = 0; i < $3 * 10; i++)); do
    [ "$(carrier_of "$1")" = "$2" ] && return 0
    sleep 0.1
  done
  return 1
}
link_ctr la 10.99.77.1/30 && link_ctr lb 10.99.77.2/30 || fail "starting the link containers"
wait_carrier la 1 5 && wait_carrier lb 1 5 || fail "the link's carrier did not come up in the containers"
podman exec "$tag-la" ping -c 3 -i 0.2 -W 2 10.99.77.2 >/dev/null || fail "ping across the link between containers"
rx=$(status | jq '[.links[] | select(.name == "L") | .halves[] | select(. != null) | .counters.rx_packets] | add')
[ "${rx:-0}" -ge 6 ] || fail "the link's counters did not see the pings (rx packets: $rx)"
podman kill -s KILL "$tag-la" >/dev/null 2>&1
wait_carrier lb 0 3 || fail "the surviving container's carrier did not drop within 3 s of the kill"
podman rm -f "$tag-la" >/dev/null 2>&1
link_ctr la 10.99.77.1/30 || fail "restarting the link container"
wait_carrier lb 1 5 || fail "the carrier did not come back after a new container took the link"
podman exec "$tag-lb" ping -c 2 -W 2 10.99.77.1 >/dev/null || fail "ping across the link after the restart"
podman rm -f "$tag-la" "$tag-lb" >/dev/null 2>&1
ok "link between two containers: ping, counters ($rx packets received), carrier down on SIGKILL and back with a new container"

echo "containers: all $passed checks passed"

docker_part
