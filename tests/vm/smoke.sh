#!/usr/bin/env bash
# Smoke check of the two-guest harness (scripts/vm/vm.sh), about 15-25 s:
#  1. both guests read a random marker the host wrote into the region file (ivshmem works), write
#     words the other guest and the host see, ping the host and each other over virtio-net, move
#     bytes over TCP with socat, and run `memloop --help` (the dynamic libraries are complete);
#     the host side (in the harness's network namespace) pings both guests.
#  2. --kill-b-on: guest b is SIGKILLed when its console shows a string; the run still succeeds.
# Needs root. Exit status 0 = passed.
# shellcheck disable=SC2016 # (guest job scripts are single-quoted on purpose)
set -euo pipefail
cd "$(dirname "$0")/../.."
VM=scripts/vm/vm.sh

passed=0 failed=0
ok() { echo "smoke: ok: $*"; passed=$((passed + 1)); }
bad() { echo "smoke: FAILED: $*"; failed=$((failed + 1)); }

"$VM" image

region=/dev/shm/memloop-vm-smoke-$$
logs=$(mktemp -d /tmp/memloop-vm-smoke.XXXXXX)
trap 'rm -f "$region"' EXIT
truncate -s 16M "$region"
head -c 16 /dev/urandom | dd of="$region" conv=notrunc status=none
# The marker as the 32-bit little-endian words the guests print (devmem: 0xABCDEF01).
want=$(od -An -tx4 -N16 "$region" | tr -s ' ' | sed 's/^ //; s/ $//')

# Words in the region: 4096 "A-UP" (a), 8192 "B-OK" (b), 12288 "H-OK" (host).
common='set -e
. /usr/lib/memloop-vm/region.sh
echo "marker: $(region_peek32 0) $(region_peek32 4) $(region_peek32 8) $(region_peek32 12)"
ping -c 1 -W 5 10.77.0.1 >/dev/null && echo "ping host: ok"
memloop --help >/dev/null && echo "memloop --help: ok"'

job_a="$common"'
socat -u TCP-LISTEN:7000,reuseaddr OPEN:/tmp/got,creat,trunc &
region_poke32 4096 0x50552d41
region_wait32 8192 0x4b4f2d42 60
wait
echo "tcp: $(cat /tmp/got)"
region_wait32 12288 0x4b4f2d48 60
echo "a: done"'

job_b="$common"'
region_wait32 4096 0x50552d41 60
ping -c 1 -W 5 10.77.0.2 >/dev/null && echo "ping a: ok"
i=0
until echo hello-over-virtio | socat -u - TCP:10.77.0.2:7000 2>/dev/null; do
  i=$((i + 1)); [ $i -lt 50 ] || exit 1; sleep 0.1
done
region_poke32 8192 0x4b4f2d42
region_wait32 12288 0x4b4f2d48 60
echo "b: done"'

# Runs in the harness's network namespace, where the bridge has 10.77.0.1.
job_host='for ip in 10.77.0.2 10.77.0.3; do
  n=0
  until busybox ping -c 1 -W 1 "$ip" >/dev/null 2>&1; do
    n=$((n + 1)); [ $n -lt 60 ] || { echo "host: $ip unreachable"; exit 1; }; sleep 0.5
  done
  echo "host: ping $ip ok"
done
printf "H-OK" | dd of="$MEMLOOP_REGION" bs=1 seek=12288 conv=notrunc status=none'

t0=$EPOCHREALTIME
if "$VM" run --region "$region" --a "$job_a" --b "$job_b" --host "$job_host" --timeout 90 --log-dir "$logs/1"; then
  ok "run 1 exited 0"
else
  bad "run 1 exited non-zero"
fi
t1=$EPOCHREALTIME

for g in a b; do
  got=$(tr -d '\r' <"$logs/1/$g.log" | sed -n 's/^marker: //p' | tr 'A-F' 'a-f' | sed 's/0x//g')
  if [ "$got" = "$want" ]; then ok "$g read the host's marker ($want)"; else bad "$g read marker '$got', want '$want'"; fi
  for s in "ping host: ok" "memloop --help: ok" "$g: done"; do
    if tr -d '\r' <"$logs/1/$g.log" | grep -qxF "$s"; then ok "$g: $s"; else bad "$g: no line '$s'"; fi
  done
done
if tr -d '\r' <"$logs/1/b.log" | grep -qxF "ping a: ok"; then ok "b pinged a"; else bad "b did not ping a"; fi
if tr -d '\r' <"$logs/1/a.log" | grep -qxF "tcp: hello-over-virtio"; then ok "TCP b -> a over virtio-net"; else bad "no TCP data b -> a"; fi
for w in "4096 A-UP" "8192 B-OK" "12288 H-OK"; do
  off=${w% *} s=${w#* }
  if [ "$(dd if="$region" bs=1 skip="$off" count=4 status=none)" = "$s" ]; then
    ok "region word at $off is $s"
  else
    bad "region word at $off is not $s"
  fi
done
if grep -qxF "host: ping 10.77.0.3 ok" "$logs/1/host.log"; then ok "host reached both guests"; else bad "host did not reach the guests"; fi

# 2: b is killed on purpose mid-job; a sees b's word and finishes; the run succeeds.
t2=$EPOCHREALTIME
if "$VM" run --region "$region" --timeout 60 --log-dir "$logs/2" --kill-b-on "b-ready" \
  --a '. /usr/lib/memloop-vm/region.sh; region_wait32 16384 0x59444552 60 && echo "a: saw b"' \
  --b '. /usr/lib/memloop-vm/region.sh; region_poke32 16384 0x59444552; echo b-ready; sleep 100; echo b-not-killed'; then
  ok "run 2 (kill b) exited 0"
else
  bad "run 2 (kill b) exited non-zero"
fi
t3=$EPOCHREALTIME
if grep -q "b-not-killed" "$logs/2/b.log"; then bad "b was not killed"; else ok "b was killed"; fi

awk -v a="$t0" -v b="$t1" -v c="$t2" -v d="$t3" \
  'BEGIN { printf "smoke: run 1 %.1f s, run 2 %.1f s\n", b - a, d - c }'
if [ $failed = 0 ]; then rm -rf "$logs"; else echo "smoke: logs in $logs"; fi
echo "vm smoke: $passed passed, $failed failed"
[ $failed = 0 ]
