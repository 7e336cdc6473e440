#!/usr/bin/env bash
# memloop between two real QEMU guests (TCG) that share one ivshmem region, and with the host.
# Two runs of scripts/vm/vm.sh:
#
#  1. pair: the native API between the guests and guest <-> host (8 MB, sha256 on both ends),
#     unmodified socat under the preload between the guests and guest -> host (8 MB, sha256)
#     with the ring used,
#     a preloaded client against a host server outside the region (TCP, counted fallback), and
#     request/response + 64 KB stream measurements through memloop (native and transparent)
#     and through virtio-net, printed side by side with their ratios.
#  2. power-off: guest b streams to guest a and to a host process (native API); b's QEMU is
#     SIGKILLed mid-stream. Both receivers must get an error within 2 s, and the region's usage
#     must return to what it was before the guests booted.
#
# Needs root. Exit status 0 = passed. `--json FILE` also writes the measurements.
# shellcheck disable=SC2016 # (guest and host job scripts are single-quoted on purpose)
set -euo pipefail
cd "$(dirname "$0")/../.."
VM=scripts/vm/vm.sh
M=$PWD/target/release/memloop
json_out=
[ "${1:-}" = "--json" ] && json_out=$2

t_start=$(date +%s.%N)
passed=0 failed=0
ok() { echo "vm-test: ok: $*"; passed=$((passed + 1)); }
bad() { echo "vm-test: FAILED: $*"; failed=$((failed + 1)); }

[ -x "$M" ] && [ -x "$M-bench" ] || cargo build --release -p memloop-cli -p memloop-bench -p memloop-preload
"$VM" image

region=/dev/shm/memloop-vmtest-$$
logs=$(mktemp -d /tmp/memloop-vmtest.XXXXXX)
trap 'rm -f "$region"' EXIT
usage() { MEMLOOP_LOG= "$M" status --json --region "$region" | python3 -c 'import json,sys; u=json.load(sys.stdin)["usage"]; print(u["members"], u["endpoints"], u["channels"], u["segments_used"])'; }

# ---------------------------------------------------------------------------------------------
# 1. pair

"$M" region create --region "$region" --size 64M >/dev/null
baseline=$(usage)

job_host='
memloop bench serve --addr memloop:host-echo &
memloop run -- memloop bench serve --addr 0.0.0.0:7100 &
# A server outside the region: a preloaded client must reach it over TCP.
memloop bench serve --addr 0.0.0.0:7101 &
memloop run -- socat -u TCP-LISTEN:7102,reuseaddr - | sha256sum | sed "s/ .*//; s/^/host tcp sha256 /" &
tcp_sum=$!
memloop cat --listen host-sink | sha256sum | sed "s/ .*//; s/^/host native sha256 /"
wait $tcp_sum
'

job_a='set -e
memloop bench serve --addr memloop:a-echo &
memloop run -- memloop bench serve --addr 0.0.0.0:7000 &
memloop bench serve --addr 0.0.0.0:7001 &
memloop run -- socat -u TCP-LISTEN:7002,reuseaddr - | sha256sum | sed "s/ .*//; s/^/a tcp sha256 /" &
tcp_sum=$!
memloop cat --listen a-sink | sha256sum | sed "s/ .*//; s/^/a native sha256 /"
wait $tcp_sum
# b says when it is done (its probes need the servers until then).
socat -u TCP-LISTEN:7009,reuseaddr - >/dev/null
echo "a: done"'

job_b='set -e
head -c 8000000 /dev/urandom > /tmp/data
echo "b data sha256 $(sha256sum < /tmp/data | sed "s/ .*//")"
memloop cat --connect a-sink < /tmp/data
memloop cat --connect host-sink < /tmp/data
memloop run -- socat -u FILE:/tmp/data TCP:10.77.0.2:7002,retry=100,interval=0.1
memloop run -- socat -u FILE:/tmp/data TCP:10.77.0.1:7102,retry=100,interval=0.1
probe() { # NAME ADDR TEST SIZE [memloop run]
  name=$1 addr=$2 test=$3 size=$4; shift 4
  echo "RESULT $name $test $size $("$@" memloop bench probe --addr "$addr" --test "$test" --size "$size" --secs 1)"
}
for t in "rr 64" "stream 65536"; do
  set -- $t
  probe vm-native memloop:a-echo "$1" "$2"
  probe vm-ring 10.77.0.2:7000 "$1" "$2" memloop run --
  probe vm-virtio 10.77.0.2:7001 "$1" "$2"
  probe host-native memloop:host-echo "$1" "$2"
  probe host-ring 10.77.0.1:7100 "$1" "$2" memloop run --
  probe host-virtio 10.77.0.1:7101 "$1" "$2"
  probe host-outside 10.77.0.1:7101 "$1" "$2" memloop run --
done
echo STATUS-BEGIN; memloop status --json; echo STATUS-END
echo done | socat -u - TCP:10.77.0.2:7009,retry=100,interval=0.1
echo "b: done"'

# The host side runs our binaries from the build tree.
host_path="export PATH=$PWD/target/release:\$PATH"
job_host="$host_path
$job_host"

echo "== run 1: two guests and the host on one region"
t0=$(date +%s.%N)
if "$VM" run --region "$region" --timeout 240 --quiet --log-dir "$logs/pair" \
  --host "$job_host" --a "$job_a" --b "$job_b"; then
  ok "both guests and the host finished (run 1: $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s)"
else
  bad "run 1 failed (logs in $logs/pair)"
fi

python3 - "$logs/pair" "${json_out:-}" <<'EOF' || bad "run 1 checks (see above)"
import json, re, sys
d, out = sys.argv[1], sys.argv[2]
text = {g: open(f"{d}/{g}.log", errors="replace").read() for g in ("a", "b", "host")}
def grab(g, pat):
    m = re.search(pat, text[g])
    return m.group(1) if m else None
fails = []
want = grab("b", r"b data sha256 ([0-9a-f]{64})")
for g, what in (("a", "native"), ("a", "tcp"), ("host", "native"), ("host", "tcp")):
    got = grab(g, rf"{g} {what} sha256 ([0-9a-f]{{64}})")
    if not want or got != want:
        fails.append(f"{g} {what}: sha256 {got} != sent {want}")
    else:
        print(f"vm-test: checksum ok: b -> {g} ({what}) 8 MB")
res = {}
for line in text["b"].splitlines():
    m = re.match(r"RESULT (\S+) (\S+) (\d+) (\{.*\})", line.strip())
    if m:
        res[(m.group(1), m.group(2))] = json.loads(m.group(4))
s = text["b"]
status = json.loads(s[s.index("STATUS-BEGIN") + 12 : s.index("STATUS-END")])
ring_conns, fb = status["ring_connections"], status["fallbacks"]
# b -> a and b -> host: socat, rr, stream each. The outside server must stay on TCP.
if ring_conns < 6:
    fails.append(f"only {ring_conns} ring connections in the region (want >= 6)")
if fb.get("no_listener", 0) < 2:
    fails.append(f"the outside-region peer: no_listener fallbacks {fb.get('no_listener')} (want 2)")
print(f"vm-test: region counters: {ring_conns} ring connections, fallbacks {dict((k, v) for k, v in fb.items() if v)}")
rows = []
for test, unit in (("rr", "round trip p50 µs"), ("stream", "Gbit/s")):
    for far in ("vm", "host"):
        base = res.get((f"{far}-virtio", test))
        for path in ("native", "ring", "virtio", "outside"):
            r = res.get((f"{far}-{path}", test))
            if r is None:
                if path != "outside" or far == "host":
                    fails.append(f"no result for {far}-{path} {test}")
                continue
            if test == "rr":
                v, b = r["p50_ns"] / 1000, base and base["p50_ns"] / 1000
                mean = r["elapsed_s"] / r["count"] * 1e6
                ratio = b / v if b else None
            else:
                v = r["bytes"] * 8 / r["elapsed_s"] / 1e9
                b = base and base["bytes"] * 8 / base["elapsed_s"] / 1e9
                mean = None
                ratio = v / b if b else None
            rows.append({"peer": "guest a" if far == "vm" else "host", "path": path, "test": test,
                         "unit": unit, "value": v, "mean_us": mean, "vs_virtio": ratio})
print("\nguest b to ... | path | test | value | mean RTT µs | vs virtio-net")
for r in rows:
    print(f"{r['peer']:>7} | {r['path']:>7} | {r['test']:>6} | {r['value']:10.3f} {r['unit']:<18} | "
          f"{(r['mean_us'] or 0):9.2f} | {('%.1fx' % r['vs_virtio']) if r['vs_virtio'] else '-'}")
if out:
    json.dump(rows, open(out, "w"), indent=1)
for f in fails:
    print("vm-test: FAILED:", f)
sys.exit(1 if fails else 0)
EOF

# The run ended by powering a off and killing the host's servers: reclaim them as an operator would.
"$M" region reclaim --region "$region"
after=$(usage)
if [ "$after" = "$baseline" ]; then ok "region usage back to baseline after run 1 and a reclaim ($after)"; else bad "region usage after run 1: $after, before: $baseline"; fi
rm -f "$region"

# ---------------------------------------------------------------------------------------------
# 2. power-off mid-stream

"$M" region create --region "$region" --size 64M >/dev/null
baseline=$(usage)

job_host='
memloop cat --listen host-sink >/dev/null 2>"$MEMLOOP_VM_LOG_DIR/host-cat.err" &
cat_pid=$!
# A transparent (preloaded) stream from b too: socat must fail, not wait for TCP to give up.
memloop run -- socat -d -u TCP-LISTEN:7103,reuseaddr OPEN:/dev/null 2>"$MEMLOOP_VM_LOG_DIR/host-socat.err" &
# (A powered-off peer sends no FIN: on plain TCP this read would wait for the TCP timeout.)
socat_pid=$!
# When b announces its streams, note the time (b is SIGKILLed right after, within ~50 ms).
until grep -q STREAMING-NOW "$MEMLOOP_VM_LOG_DIR/b.log" 2>/dev/null; do sleep 0.01; done
t_kill=$(date +%s.%N)
if wait $cat_pid; then echo "host: the stream ended cleanly: wrong"; exit 1; fi
t_err=$(date +%s.%N)
echo "host: cat failed: $(cat "$MEMLOOP_VM_LOG_DIR/host-cat.err")"
echo "host: error $(awk -v a="$t_kill" -v b="$t_err" "BEGIN{printf \"%.3f\", b-a}") s after the power-off"
# socat reports a reset on its reading side as a warning and exits 0: judge by its message.
wait $socat_pid || true
t_err=$(date +%s.%N)
grep -q "Connection reset by peer" "$MEMLOOP_VM_LOG_DIR/host-socat.err" || { echo "host: socat saw no reset"; exit 1; }
echo "host: socat failed: $(tail -1 "$MEMLOOP_VM_LOG_DIR/host-socat.err")"
echo "host: socat error $(awk -v a="$t_kill" -v b="$t_err" "BEGIN{printf \"%.3f\", b-a}") s after the power-off"
'

job_a='
memloop cat --listen a-sink >/dev/null 2>/tmp/err && { echo "a: the stream ended cleanly: wrong"; exit 1; }
echo "a: cat failed: $(cat /tmp/err)"'

job_b='
memloop cat --connect a-sink < /dev/zero &
memloop cat --connect host-sink < /dev/zero &
memloop run -- socat -u /dev/zero TCP:10.77.0.1:7103,retry=100,interval=0.1 &
sleep 2
memloop status | grep -q "ring .*10.77.0.1:7103" && echo "b: socat to the host is on a ring"
echo STREAMING-NOW
sleep 100'

job_host="$host_path
$job_host"

echo "== run 2: guest b powered off mid-stream"
if "$VM" run --region "$region" --timeout 120 --quiet --log-dir "$logs/poweroff" \
  --host "$job_host" --a "$job_a" --b "$job_b" --kill-b-on STREAMING-NOW; then
  ok "run 2 finished: both receivers saw the stream fail"
else
  bad "run 2 failed (logs in $logs/poweroff)"
fi
for g in host a; do
  line=$(grep -ao "cat failed: .*" "$logs/poweroff/$g.log" | head -1 || true)
  echo "vm-test: $g: $line"
  case "$line" in *"peer process is gone"*) ok "$g: PeerDead" ;; *) bad "$g: not a PeerDead error" ;; esac
done
for what in "" "socat "; do
  secs=$(grep -ao "host: ${what}error [0-9.]* s" "$logs/poweroff/host.log" | head -1 | awk '{print $(NF-1)}' || true)
  if [ -n "$secs" ] && awk -v s="$secs" 'BEGIN{exit !(s < 2.0)}'; then
    ok "host ${what:-native cat }noticed the power-off within 2 s ($secs s)"
  else
    bad "host ${what:-native cat }noticed the power-off after ${secs:-?} s"
  fi
done
if grep -aq "b: socat to the host is on a ring" "$logs/poweroff/b.log"; then ok "the preloaded stream was on a ring"; else bad "the preloaded stream was not on a ring"; fi
grep -ao "host: socat failed: .*" "$logs/poweroff/host.log" | head -1 | sed 's/^/vm-test: /' || true
# The survivors reclaimed b's members as they noticed. Processes that exited without closing
# (socat) are reclaimed by the next member to look: here, a reclaim.
"$M" region reclaim --region "$region"
after=$(usage)
if [ "$after" = "$baseline" ]; then ok "region usage back to baseline after the power-off ($after)"; else bad "region usage after the power-off: $after, before: $baseline"; fi

echo "vm-test: $passed passed, $failed failed, $(awk -v a="$t_start" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s in all (logs in $logs)"
[ "$failed" = 0 ]
