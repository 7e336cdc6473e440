#!/usr/bin/env bash
# Issue 14's figures, side by side in one run, in a default region (2 GiB, 16,384 channels):
#   - connection setup (`memloop bench probe --test crr` against `memloop bench serve`, both
#     preloaded) with 10 and with 10,000 other ring connections open in the region: conn/s;
#   - resident memory of the region file (its allocated blocks) per idle connection, from the
#     10,000 held open (and back after they close and two sweeps give the memory back);
#   - one busy connection streaming 64 KB messages (`--test stream --size 65536`) with elastic
#     windows (16 KiB, grown while busy) against fixed 1 MiB rings (`MEMLOOP_RING_WINDOW=max`),
#     over 2 s and over a new connection's first 10 ms;
#   - redis-benchmark `-c 1000` (SET and GET) in domain 1 against redis-server in domain 0
#     (two network namespaces on a bridge): under `memloop run` against veth+bridge.
# Server on CPU 1, client on CPU 0; ROUNDS rounds (default 3), medians. Writes OUT.md and
# OUT.json (default docs/results/bench-scale).
#   scripts/bench-scale.sh [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/results/bench-scale}
ROUNDS=${ROUNDS:-3}
HOLD=${HOLD:-10000}
M=$PWD/target/release/memloop
[ -x "$M" ] && [ -f target/release/libmemloop.so ] ||
  cargo build --release -p memloop-cli -p memloop-preload -p memloop-bench
command -v jq >/dev/null || { apt-get update -qq && apt-get install -y -qq jq >/dev/null; }

R=ml-bscale-$$
D=mlbs$$
work=$(mktemp -d /tmp/memloop-bench-scale.XXXXXX)
pids=()
cleanup() {
  touch "$work/pf.release" 2>/dev/null || true
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  "$M" region destroy --region "$R" >/dev/null 2>&1 || true
  "$M" domains down --prefix "$D" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
"$M" region create --region "$R" >/dev/null
file=/dev/shm/memloop-$R
resident() { echo $(($(stat -c %b "$file") * 512)); }
run() { "$M" run --region "$R" --strict -- "$@"; }

# serve ENV…: a bench server on CPU 1 (ENV: e.g. MEMLOOP_RING_WINDOW=max), its port in
# $port. (Not in a subshell: its pid must reach the clean-up.)
serve() {
  port=$((7400 + RANDOM % 500))
  env "$@" taskset -c 1 "$M" run --region "$R" --strict -- "$M" bench serve \
    --addr "127.0.0.1:$port" >/dev/null 2>&1 &
  pids+=($!)
  sleep 0.5
}
probe() { # PORT TEST SIZE ENV… → the reply JSON ($SECS measured, default 2, after a fifth)
  local port=$1 test=$2 size=$3
  shift 3
  env "$@" taskset -c 0 "$M" run --region "$R" --strict -- "$M" bench probe \
    --addr "127.0.0.1:$port" --test "$test" --size "$size" --secs "${SECS:-2}"
}
median() { sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }

# hold N: N idle ring connections between two Python processes, until `release`.
hold() {
  rm -f "$work"/pf*
  run python3 tests/semantics/scale.py server --case hold --extra "$1" --deadline 600 \
    --port-file "$work/pf" >/dev/null 2>&1 &
  pids+=($!)
  while [ ! -s "$work/pf" ]; do sleep 0.1; done
  run python3 tests/semantics/scale.py client --case hold --extra "$1" --deadline 600 \
    --port "$(cat "$work/pf")" --port-file "$work/pf" >/dev/null 2>&1 &
  pids+=($!)
  while [ ! -e "$work/pf.held" ]; do sleep 0.2; done
}
release() {
  touch "$work/pf.release"
  while "$M" status --json --region "$R" | jq -e '.usage.channels > 0' >/dev/null; do sleep 0.2; done
}

serve
base=$(resident)
declare -A crr
for k in 10 "$HOLD"; do
  hold "$k"
  [ "$k" = "$HOLD" ] && held=$(resident)
  for ((i = 1; i <= ROUNDS; i++)); do
    probe "$port" crr 1 | jq '.count / .elapsed_s | round' >>"$work/crr-$k"
  done
  crr[$k]=$(median <"$work/crr-$k")
  release
done
sleep 3 # two region sweeps: the freed rings' memory goes back
after=$(resident)

for ((i = 1; i <= ROUNDS; i++)); do
  for mode in elastic fixed; do
    env=()
    [ $mode = fixed ] && env=(MEMLOOP_RING_WINDOW=max)
    serve "${env[@]}"
    probe "$port" stream 65536 "${env[@]}" | jq '.bytes / .elapsed_s / 1e6 | round' >>"$work/stream-$mode"
    # A new connection's first 10 ms (after 2 ms): has the window grown by then?
    for _ in 1 2 3; do
      SECS=0.01 probe "$port" stream 65536 "${env[@]}" |
        jq '.bytes / .elapsed_s / 1e6 | round' >>"$work/stream10-$mode"
    done
  done
done
elastic=$(median <"$work/stream-elastic")
fixed=$(median <"$work/stream-fixed")
elastic10=$(median <"$work/stream10-elastic")
fixed10=$(median <"$work/stream10-fixed")

# redis-benchmark -c 1000 across two domains. PATH (memloop or veth) PORT: appends the SET
# and GET rates to $work/redis-{set,get}-PATH. A fresh server (and port) per run.
"$M" domains up --prefix "$D" --subnet 10.79.0.0/24 2 >/dev/null
"$M" region create --region "$R-redis" --mode 666 >/dev/null
in_domain() { "$M" domains exec "$1" --prefix "$D" -- "${@:2}"; }
redis_rates() {
  local path=$1 port=$2 pre=""
  [ "$path" = memloop ] && pre="$M run --region $R-redis --strict --"
  in_domain 0 sh -c "ulimit -n 20000; exec $pre redis-server --bind 10.79.0.1 --port $port \
    --protected-mode no --save '' --appendonly no --maxclients 10000 --logfile '' \
    --daemonize no" >/dev/null 2>&1 &
  local srv=$!
  pids+=($srv)
  until in_domain 1 redis-cli -h 10.79.0.1 -p "$port" ping >/dev/null 2>&1; do sleep 0.2; done
  in_domain 1 sh -c "ulimit -n 20000; exec $pre redis-benchmark -h 10.79.0.1 -p $port -q \
    -t set,get -c 1000 -n 500000 --csv" >"$work/redis.csv"
  awk -F'"' '$2 == "SET" { print $4 }' "$work/redis.csv" >>"$work/redis-set-$path"
  awk -F'"' '$2 == "GET" { print $4 }' "$work/redis.csv" >>"$work/redis-get-$path"
  in_domain 1 redis-cli -h 10.79.0.1 -p "$port" shutdown nosave >/dev/null 2>&1 || true
  wait "$srv" 2>/dev/null || true
}
rport=6400
for ((i = 1; i <= ROUNDS; i++)); do
  for path in memloop veth; do
    redis_rates $path $((rport++))
  done
done
"$M" region destroy --region "$R-redis" >/dev/null 2>&1 || true
for x in set-memloop set-veth get-memloop get-veth; do
  declare "redis_${x//-/_}=$(median <"$work/redis-$x")"
done

per_idle=$(((held - base) / HOLD))
jq -n --argjson c10 "${crr[10]}" --argjson cN "${crr[$HOLD]}" --argjson hold "$HOLD" \
  --argjson base "$base" --argjson held "$held" --argjson after "$after" \
  --argjson el "$elastic" --argjson fx "$fixed" --argjson rounds "$ROUNDS" \
  --argjson el10 "$elastic10" --argjson fx10 "$fixed10" \
  --argjson rsm "$redis_set_memloop" --argjson rsv "$redis_set_veth" \
  --argjson rgm "$redis_get_memloop" --argjson rgv "$redis_get_veth" '{
    rounds: $rounds, held_connections: $hold,
    crr_per_s: { with_10: $c10, with_held: $cN, ratio: ($cN / $c10) },
    resident_bytes: { before: $base, held: $held, after_release: $after,
                      per_idle_connection: (($held - $base) / $hold) },
    stream_64k_mb_per_s: { elastic: $el, fixed_1mib: $fx, ratio: ($el / $fx),
      first_10ms: { elastic: $el10, fixed_1mib: $fx10, ratio: ($el10 / $fx10) } },
    redis_c1000_requests_per_s: {
      set: { memloop: $rsm, veth_bridge: $rsv, ratio: ($rsm / $rsv) },
      get: { memloop: $rgm, veth_bridge: $rgv, ratio: ($rgm / $rgv) } } }' >"$OUT.json"
{
  echo "# Scale (issue 14): one run of \`scripts/bench-scale.sh\`, $ROUNDS rounds, medians"
  echo
  echo "| figure | value |"
  echo "| --- | --- |"
  echo "| connection setup with 10 other ring connections open | ${crr[10]} conn/s |"
  echo "| connection setup with $HOLD other ring connections open | ${crr[$HOLD]} conn/s |"
  echo "| ratio ($HOLD vs 10; target ≥ 0.9) | $(jq '.crr_per_s.ratio * 100 | round / 100' "$OUT.json") |"
  echo "| region resident: before / $HOLD idle held / after release + 2 sweeps | $base / $held / $after bytes |"
  echo "| resident per idle connection (target ≤ 64 KiB) | $per_idle bytes |"
  echo "| one connection streaming 64 KB messages, elastic windows | $elastic MB/s |"
  echo "| the same with fixed 1 MiB rings (\`MEMLOOP_RING_WINDOW=max\`) | $fixed MB/s |"
  echo "| ratio (target ≥ 0.95) | $(jq '.stream_64k_mb_per_s.ratio * 100 | round / 100' "$OUT.json") |"
  echo "| the same over a new connection's first 10 ms (from 2 ms on): elastic / fixed | $elastic10 / $fixed10 MB/s, ratio $(jq '.stream_64k_mb_per_s.first_10ms.ratio * 100 | round / 100' "$OUT.json") |"
  for t in set get; do
    echo "| redis-benchmark -c 1000 ${t^^} across two domains: memloop / veth+bridge | $(jq -r ".redis_c1000_requests_per_s.$t | \"\(.memloop) / \(.veth_bridge) requests/s, ratio \(.ratio * 100 | round / 100) (target ≥ 2)\"" "$OUT.json") |"
  done
} >"$OUT.md"
cat "$OUT.md"
