#!/usr/bin/env bash
# The README's main job: unmodified programs over memloop beside the kernel paths, in one run.
#   1. builds the workspace (the `memloop` CLI and the LD_PRELOAD library);
#   2. a real program across two domains (network namespaces on a bridge): redis-server in
#      domain 0, redis-benchmark in domain 1, once with both under `memloop run`, once over plain
#      veth+bridge, and a comparison table;
#   3. `memloop bench tcp` with the options given here (e.g. --quick, --json FILE).
# `scripts/demo.sh --native [OPTIONS]` runs `memloop bench native` instead (the native API).
# Needs root (network namespaces); installs redis-server and redis-tools with apt-get if missing.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v cargo >/dev/null; then
  curl -sSf https://sh.rustup.rs | sh -s -- -y
  # shellcheck source=/dev/null
  . "$HOME/.cargo/env"
fi

if [ "${1:-}" = "--native" ]; then
  shift
  cargo build --release -q -p memloop-cli -p memloop-bench
  exec target/release/memloop bench native "$@"
fi

if [ "$(id -u)" != 0 ]; then
  echo "demo.sh: needs root (it creates network namespaces); scripts/demo.sh --native does not" >&2
  exit 1
fi

echo "== build"
cargo build --release --workspace
ml=$PWD/target/release/memloop
preload=$PWD/target/release/libmemloop.so

if ! command -v redis-server >/dev/null || ! command -v redis-benchmark >/dev/null; then
  echo "== installing redis-server and redis-tools"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-tools >/dev/null
fi

# Names and a /24 no interface uses yet (10.250-254.x: the tests and bench tcp use 10.100-249.x).
prefix=demo$$
for ((k = 0; k < 500; k++)); do
  net=10.$((250 + ($$ + k) % 5)).$(((($$ + k) / 5) % 256))
  ip -4 -o addr show | grep -q " $net\." || break
done
server=$net.1
region=demo-$$
requests=${REDIS_REQUESTS:-100000}
work=$(mktemp -d)
pidfile=$work/redis.pid

stop_redis() {
  [ -s "$pidfile" ] || return 0
  local pid
  pid=$(cat "$pidfile")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 50); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$pidfile"
  wait 2>/dev/null || true
}

domains_down() {
  "$ml" domains down --prefix "$prefix" >/dev/null 2>&1 || true
  "$ml" region destroy --region "$region" >/dev/null 2>&1 || true
}

cleanup() {
  stop_redis
  domains_down
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# run_redis MODE: redis-server in domain 0 and redis-benchmark in domain 1, plain (MODE=veth)
# or both under `memloop run` (MODE=memloop); CSV results in $work/MODE.csv.
run_redis() {
  local mode=$1 wrap=() ready=0 channels=0 bench n
  if [ "$mode" = memloop ]; then
    wrap=("$ml" run --strict --region "$region" --)
  fi
  rm -f "$pidfile"
  "$ml" domains exec 0 --prefix "$prefix" -- "${wrap[@]}" \
    redis-server --bind "$server" --port 6379 --protected-mode no --save '' --appendonly no \
    --pidfile "$pidfile" --daemonize no >"$work/server-$mode.log" 2>&1 &
  for _ in $(seq 100); do
    if "$ml" domains exec 1 --prefix "$prefix" -- "${wrap[@]}" \
      redis-cli -h "$server" -p 6379 ping 2>/dev/null | grep -q PONG; then
      ready=1
      break
    fi
    sleep 0.1
  done
  if [ $ready = 0 ]; then
    echo "redis-server ($mode) did not answer; its log:" >&2
    tail -n 20 "$work/server-$mode.log" >&2
    stop_redis
    return 1
  fi
  "$ml" domains exec 1 --prefix "$prefix" -- "${wrap[@]}" \
    redis-benchmark -h "$server" -p 6379 -q -n "$requests" -t set,get,ping -P 1 -c 8 --csv \
    >"$work/$mode.csv" 2>"$work/bench-$mode.log" &
  bench=$!
  # While it runs, count the channels in the region: proof the ring carries the traffic.
  if [ "$mode" = memloop ]; then
    while kill -0 "$bench" 2>/dev/null; do
      n=$("$ml" status --region "$region" --json 2>/dev/null | grep -c '"bytes_c2s"' || true)
      [ "${n:-0}" -gt "$channels" ] && channels=$n
      sleep 0.2
    done
    echo "$channels" >"$work/channels"
  fi
  if ! wait "$bench"; then
    echo "redis-benchmark ($mode) failed; its log:" >&2
    tail -n 20 "$work/bench-$mode.log" >&2
    stop_redis
    return 1
  fi
  stop_redis
}

echo "== redis: redis-server in domain 0, redis-benchmark -c 8 -P 1 -n $requests in domain 1"
"$ml" domains up 2 --prefix "$prefix" --subnet "$net.0/24" >/dev/null
memloop_state=ok
run_redis veth
if [ ! -e "$preload" ]; then
  memloop_state="unavailable (preload not built: no $preload)"
elif ! "$ml" region create --region "$region" >/dev/null || ! run_redis memloop; then
  memloop_state="failed (see above)"
elif [ "$(cat "$work/channels")" = 0 ]; then
  memloop_state="failed: no channel in region $region while redis-benchmark ran (it stayed on TCP)"
fi
domains_down

# One row per redis-benchmark test: requests/s and p50 latency on each path, and the ratio.
awk -F'"' -v state="$memloop_state" '
  FNR == 1 { next }
  FILENAME ~ /veth.csv$/ { order[++n] = $2; vr[$2] = $4; vp[$2] = $10; next }
  { mr[$2] = $4; mp[$2] = $10 }
  END {
    printf "%-12s %14s %14s %8s %14s %14s\n", "test", "veth+bridge", "memloop", "ratio", "p50 ms veth", "p50 ms memloop"
    for (i = 1; i <= n; i++) {
      t = order[i]
      if (t in mr && vr[t] > 0) {
        printf "%-12s %14.0f %14.0f %7.2fx %14s %14s\n", t, vr[t], mr[t], mr[t] / vr[t], vp[t], mp[t]
      } else {
        printf "%-12s %14.0f %14s %8s %14s %14s\n", t, vr[t], "n/a", "-", vp[t], "n/a"
      }
    }
    printf "(requests/s; ratio >1 means memloop is faster)\n"
    if (state != "ok") printf "memloop: %s\n", state
  }' "$work/veth.csv" "$([ "$memloop_state" = ok ] && echo "$work/memloop.csv" || echo /dev/null)"
if [ "$memloop_state" = ok ]; then
  echo "memloop: $(cat "$work/channels") channel(s) seen in region $region during the run"
fi

echo
echo "== memloop bench tcp $*"
"$ml" bench tcp "$@"

case $memloop_state in
  ok | unavailable*) ;;
  *) exit 1 ;;
esac
