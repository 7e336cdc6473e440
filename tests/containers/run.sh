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
#      SIGKILLed → the other's carrier drops within 3 s; a new container brings it back;
#   7. a `memloop blk` device between two containers: a storage container exports a 64 MiB
#      file of the host (`blk export --foreground` as its process: the region and its wake
#      directory mounted, where the stats files are), a client container attaches it (the
#      service started by `podman exec … blk attach`) and on the loop device makes ext4, writes
#      a checksummed tree, fsck -fn clean (also the backing file, from the host), verifies
#      after a remount; `memloop status` shows the export with its client and the bytes; the
#      storage container SIGKILLed under a dd loop → the client's I/O fails within 5 s (every
#      wait bounded); a new storage container re-exports the file and the same loop device
#      reads the same sha256 and the files; detach frees the loop device. The client needs
#      no --privileged: `--device /dev/fuse --device /dev/loop-control` (the FUSE mount; loop
#      devices allocated), `--device-cgroup-rule 'b 7:* rwm'` (the loop block devices),
#      `--cap-add SYS_ADMIN` (mount(2), losetup's ioctls) and `--cap-add MKNOD` (already in
#      podman 4.3's defaults): the container's /dev is podman's own, where a loop device made
#      after the start has no node, so it makes /dev/loop0…N itself before attaching. ext4 is
#      only ever mounted in a shell's own mount namespace (`unshare -m`; why: at the case).
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
# The loop device case 7 attached, if its client container was removed while it was attached
# (its attach service is gone, the loop device is not; it then shows its FUSE file as "/disk").
blk_dev="" B=vol
blk_loops_down() {
  [ -n "$blk_dev" ] || return 0
  local back
  back=$(cat "/sys/block/${blk_dev#/dev/}/loop/backing_file" 2>/dev/null) || return 0
  case $back in
  /disk | */memloop-$R.wake/blk-*) losetup -d "$blk_dev" 2>/dev/null || true ;;
  esac
}
blk_down() { # before the containers go: the client detaches in order (bounded)
  [ -n "$blk_dev" ] || return 0
  timeout -k 2 20 podman exec "$tag-bcli" "$M" blk detach "$B" --region "$R" >/dev/null 2>&1 || true
}
trap 'blk_down; podman_bed_down; blk_loops_down' EXIT
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

# ---- 7. a memloop blk device between two containers (storage exports, client attaches)
command -v mkfs.ext4 >/dev/null && command -v fsck.ext4 >/dev/null && command -v losetup >/dev/null ||
  fail "blk: needs mkfs.ext4, fsck.ext4 (e2fsprogs) and losetup (util-linux)"
[ -c /dev/fuse ] && [ -c /dev/loop-control ] || fail "blk: the host has no /dev/fuse or /dev/loop-control"
img=$work/blk.img
wake=/dev/shm/memloop-$R.wake
truncate -s 64M "$img" && mkdir -p "$wake" && chmod 1777 "$wake" || fail "blk: making $img and $wake"
shared=(-v "/dev/shm/memloop-$R:/dev/shm/memloop-$R" -v "$wake:$wake")
t7=$(date +%s.%N)
blk_store() { # the storage container: the export as its process, ready once its stats file is there
  rm -f "$wake/blk-export-$B.json"
  podman run -d --name "$tag-bsto" "${shared[@]}" -v "$img:/srv/blk.img" --rootfs /:O \
    "$M" blk export "$B" --file /srv/blk.img --region "$R" --foreground 2> >(quiet >&2) >/dev/null || return 1
  local i
  for ((i = 0; i < 100; i++)); do
    [ -s "$wake/blk-export-$B.json" ] && return 0
    sleep 0.1
  done
  return 1
}
cx() { # SECS CMD…: in the client container, bounded
  local secs=$1
  shift
  timeout -k 5 "$secs" podman exec "$tag-bcli" "$@"
}
blk_of() { # the export's and the attachment's status, as {e, a}
  status | jq -c --arg n "$B" '{e: ([.blk.exports[] | select(.name == $n)] | .[0]),
    a: ([.blk.attachments[] | select(.name == $n)] | .[0])}'
}
blk_until() { # JQ-CONDITION: blk_of once it holds (at most 5 s; the services write every second)
  local v i
  for ((i = 0; i < 25; i++)); do
    v=$(blk_of)
    [ "$(jq "$1" <<<"$v")" = true ] && break
    sleep 0.2
  done
  echo "$v"
}
blk_store || fail "blk: the storage container did not export $img: $(podman logs "$tag-bsto" 2>&1 | tail -n 3)"
podman run -d --name "$tag-bcli" --device /dev/fuse --device /dev/loop-control \
  --device-cgroup-rule 'b 7:* rwm' --cap-add SYS_ADMIN --cap-add MKNOD "${shared[@]}" --rootfs /:O \
  sleep infinity 2> >(quiet >&2) >/dev/null || fail "blk: starting the client container"
# Nodes for every loop device the host has or may allocate (minor = index << part_shift).
maxp=$(cat /sys/module/loop/parameters/max_part 2>/dev/null || echo 0)
shift_=0
while [ $((maxp >> shift_)) -gt 0 ]; do shift_=$((shift_ + 1)); done
top=$(ls /sys/class/block | sed -n 's/^loop\([0-9]*\)$/\1/p' | sort -n | tail -n 1)
top=$(((${top:-0} + 64) > 255 ? ${top:-0} + 64 : 255))
cx 30 sh -ec 'i=0; while [ $i -le "$1" ]; do [ -e /dev/loop$i ] || mknod /dev/loop$i b 7 $((i << $2)); i=$((i + 1)); done' \
  sh "$top" "$shift_" || fail "blk: making the loop device nodes in the client container"
w0=$(blk_of | jq '.e.bytes_written') || fail "blk: memloop status"
dev=$(cx 30 "$M" blk attach "$B" --region "$R" 2>"$work/blk-attach.err") ||
  fail "blk attach in the client container: $(cat "$work/blk-attach.err")"
[[ $dev == /dev/loop[0-9]* ]] || fail "blk attach printed '$dev': $(cat "$work/blk-attach.err")"
blk_dev=$dev
# ext4 and a checksummed tree (16 files, 8 MiB), unmounted, fsck'd; then remounted and verified.
# Each shell that mounts it has a mount namespace of its own (unshare -m): were the ext4 mount
# in the container's namespace, the attach service (the FUSE server) could be the last process
# to leave it when the container is removed, and would then unmount ext4 — writing through the
# loop device to itself — on its way out, before its /dev/fuse is closed: a D-state deadlock.
cx 120 unshare -m sh -ec 'mkfs.ext4 -q -F "$1"
  mkdir -p /mnt/blk; mount "$1" /mnt/blk
  for d in 0 1 2 3; do mkdir /mnt/blk/d$d; done
  i=0; while [ $i -lt 16 ]; do head -c 524288 /dev/urandom >/mnt/blk/d$((i % 4))/f$i; i=$((i + 1)); done
  cd /mnt/blk; find . -type f -name "f*" | sort | xargs sha256sum >/tmp/blk.sums; cd /
  umount /mnt/blk' sh "$dev" >"$work/blk-tree.out" 2>&1 ||
  fail "blk: mkfs.ext4 and the tree on $dev: $(tail -n 5 "$work/blk-tree.out")"
cx 60 fsck.ext4 -fn "$dev" >"$work/blk-fsck.out" 2>&1 || fail "blk: fsck.ext4 -fn $dev: $(tail -n 5 "$work/blk-fsck.out")"
fsck.ext4 -fn "$img" >"$work/blk-fsck.out" 2>&1 ||
  fail "blk: fsck.ext4 -fn of the backing file (host): $(tail -n 5 "$work/blk-fsck.out")"
verify='blockdev --flushbufs "$1"; mount "$1" /mnt/blk; cd /mnt/blk; sha256sum -c --quiet /tmp/blk.sums; cd /; umount /mnt/blk'
cx 60 unshare -m sh -ec "$verify" sh "$dev" >"$work/blk-verify.out" 2>&1 ||
  fail "blk: the tree after a remount: $(tail -n 5 "$work/blk-verify.out")"
v=$(blk_until ".e.clients == 1 and .e.bytes_written >= $w0 + 8388608 and .a.bytes_written >= 8388608")
jq -e ".e.clients == 1 and .e.bytes_written >= $w0 + 8388608 and .e.bytes_read > 0" <<<"$v" >/dev/null ||
  fail "blk: status does not show the export with its client and the bytes written ($w0 before): $v"
jq -e ".a.device == \"$dev\" and .a.connected and .a.bytes_written >= 8388608" <<<"$v" >/dev/null ||
  fail "blk: status does not show the attachment on $dev, connected: $v"
status_txt=$("$M" status --region "$R")
grep -q "BLK EXPORTS" <<<"$status_txt" && grep -q "BLK ATTACHMENTS" <<<"$status_txt" ||
  fail "blk: the text status has no BLK tables"
written=$(jq '.e.bytes_written' <<<"$v")
# The storage container SIGKILLed under I/O: reads (and same-data rewrites) in a loop must fail.
head16() { cx 30 sh -ec 'dd if="$1" bs=1M count=16 iflag=direct status=none | sha256sum' sh "$dev" | cut -d' ' -f1; }
sum0=$(head16) || fail "blk: reading the first 16 MiB of $dev"
[ "$sum0" = "$(head -c 16M "$img" | sha256sum | cut -d' ' -f1)" ] ||
  fail "blk: the device's first 16 MiB differ from the backing file's"
cx 60 sh -c 'n=0
  while dd if="$1" of=/dev/null bs=256k iflag=direct status=none &&
    dd if="$1" of="$1" bs=64k count=64 iflag=direct oflag=direct conv=notrunc status=none; do
    n=$((n + 1)); echo $n >/tmp/blk-rounds.new; mv /tmp/blk-rounds.new /tmp/blk-rounds
  done
  echo "failed after $n rounds at $(date +%s.%N)"' sh "$dev" >"$work/blk-io.out" 2>&1 &
iopid=$!
rounds() { local n; n=$(cx 5 cat /tmp/blk-rounds 2>/dev/null) || n=0; echo "${n:-0}"; }
going=""
for ((i = 0; i < 100; i++)); do
  [ "$(rounds)" -ge 2 ] && going=yes && break
  sleep 0.1
done
grep -q "^failed after" "$work/blk-io.out" && fail "blk: the I/O loop failed before the kill: $(cat "$work/blk-io.out")"
[ -n "$going" ] || fail "blk: the I/O loop made no progress: $(cat "$work/blk-io.out")"
killed_at=$(date +%s.%N)
podman kill -s KILL "$tag-bsto" >/dev/null 2>&1 || fail "blk: podman kill of the storage container"
wait "$iopid" || true
seen=$(sed -n 's/^failed after [0-9]* rounds at \([0-9.]*\)$/\1/p' "$work/blk-io.out")
[ -n "$seen" ] || fail "blk: the client's I/O loop did not end in errors (hung?): $(tail -n 3 "$work/blk-io.out")"
grep -q "Input/output error" "$work/blk-io.out" || fail "blk: the I/O loop failed but not with EIO: $(cat "$work/blk-io.out")"
took=$(python3 -c "print(f'{$seen - $killed_at:.2f}')")
python3 -c "import sys; sys.exit(0 if $took < 5 else 1)" ||
  fail "blk: the client's I/O failed $took s after the kill (want < 5 s)"
# No export: a read fails at once.
r=0
cx 5 dd if="$dev" of=/dev/null bs=4k count=1 iflag=direct status=none 2>/dev/null || r=$?
[ "$r" != 0 ] || fail "blk: a read with the storage container dead succeeded"
[ "$r" != 124 ] && [ "$r" != 137 ] || fail "blk: a read with the storage container dead hung (timeout)"
podman rm -f -t 0 "$tag-bsto" >/dev/null 2>&1 || true
# A new storage container re-exports the file: the same loop device goes on.
blk_store || fail "blk: the new storage container did not export: $(podman logs "$tag-bsto" 2>&1 | tail -n 3)"
back=""
for ((i = 0; i < 50; i++)); do
  h=$(cx 10 sh -ec 'dd if="$1" bs=1M count=8 iflag=direct status=none | sha256sum' sh "$dev" 2>/dev/null) &&
    [ "${h:0:8}" != e3b0c442 ] && back=yes && break
  sleep 0.2
done
[ -n "$back" ] || fail "blk: no I/O on $dev 10 s after the re-export"
sum1=$(head16) || fail "blk: reading $dev after the re-export"
[ "$sum1" = "$sum0" ] || fail "blk: the first 16 MiB of $dev changed across the kill ($sum0 -> $sum1)"
cx 60 unshare -m sh -ec "$verify" sh "$dev" >"$work/blk-verify.out" 2>&1 ||
  fail "blk: the tree after the re-export: $(tail -n 5 "$work/blk-verify.out")"
v=$(blk_until '.e.clients == 1 and .a.connected and .a.reattached >= 1')
jq -e '.e.clients == 1 and .a.connected and .a.reattached >= 1 and .a.failed_disconnected >= 1' <<<"$v" >/dev/null ||
  fail "blk: status after the re-export: $v"
# Detach: the loop device is free again, and no stats of the attachment remain.
cx 30 "$M" blk detach "$B" --region "$R" >"$work/blk-detach.out" 2>&1 ||
  fail "blk detach: $(cat "$work/blk-detach.out")"
grep -qs "/memloop-$R.wake/blk-" "/sys/block/${dev#/dev/}/loop/backing_file" &&
  fail "blk: $dev is still attached after detach: $(cat "/sys/block/${dev#/dev/}/loop/backing_file")"
[ "$(blk_of | jq '.a')" = null ] || fail "blk: status still shows the attachment after detach"
blk_dev=""
podman rm -f -t 0 "$tag-bcli" "$tag-bsto" >/dev/null 2>&1 || true
fsck.ext4 -fn "$img" >"$work/blk-fsck.out" 2>&1 ||
  fail "blk: fsck.ext4 -fn of the backing file at the end: $(tail -n 5 "$work/blk-fsck.out")"
t7=$(python3 -c "print(f'{$(date +%s.%N) - $t7:.1f}')")
ok "blk between containers: ext4 on $dev with an 8 MiB tree (fsck clean, verified after a remount), export shows 1 client and $((written >> 20)) MiB written; storage SIGKILLed → the client's I/O failed in $took s, a new storage container → same device, same sha256, tree verified; detached (${t7} s)"

echo "containers: all $passed checks passed"

docker_part
