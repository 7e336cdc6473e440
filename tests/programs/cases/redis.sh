# shellcheck shell=bash
# redis-server with redis-cli (values up to 1 MB, a batch on one connection, mass insertion
# with --pipe) and redis-benchmark.

REDIS_PORT=6379

start_redis() {
  start_server redis redis-server --bind "$ADDR0" --port $REDIS_PORT --protected-mode no \
    --save "" --appendonly no --daemonize no --dir "$CASE_DIR" --logfile ""
  wait_listen redis $REDIS_PORT
}

# redis NAME ARGS...: one redis-cli invocation against the server.
rcli() {
  local name=$1
  shift
  run_client "$name" 60 redis-cli -h "$ADDR0" -p $REDIS_PORT "$@"
}

case_redis_cli() {
  local d=$CASE_DIR i
  start_redis
  rcli ping PING
  [ "$(cat "$d/ping.out")" = PONG ] || fail "PING answered $(cat "$d/ping.out")"

  # Small values, then a 1 MiB one (hex text) set from stdin and read back.
  rcli set SET small "hello memloop"
  rcli get GET small
  [ "$(cat "$d/get.out")" = "hello memloop" ] || fail "GET small: $(cat "$d/get.out")"
  head -c $((512 << 10)) /dev/urandom | od -An -vtx1 | tr -d ' \n' >"$d/big.txt"
  [ "$(stat -c %s "$d/big.txt")" = $((1 << 20)) ] || fail "test value is not 1 MiB"
  client_stdin setbig 60 "$d/big.txt" redis-cli -h "$ADDR0" -p $REDIS_PORT -x SET big
  [ "$(cat "$d/setbig.out")" = OK ] || fail "SET big: $(head -c 200 "$d/setbig.out")"
  rcli strlen STRLEN big
  [ "$(cat "$d/strlen.out")" = $((1 << 20)) ] || fail "STRLEN big: $(cat "$d/strlen.out")"
  rcli getbig GET big
  # redis-cli prints the value and a newline.
  [ "$(stat -c %s "$d/getbig.out")" = $(((1 << 20) + 1)) ] ||
    fail "GET big returned $(stat -c %s "$d/getbig.out") bytes"
  [ "$(head -c $((1 << 20)) "$d/getbig.out" | sha256sum)" = "$(sha256sum <"$d/big.txt")" ] ||
    fail "GET big: value differs"

  # 2000 commands in one session (one connection, request after request).
  for ((i = 0; i < 1000; i++)); do
    echo "SET key:$i value-$i-$RANDOM"
  done >"$d/batch.txt"
  for ((i = 0; i < 1000; i++)); do echo "INCR counter"; done >>"$d/batch.txt"
  client_stdin batch 60 "$d/batch.txt" redis-cli -h "$ADDR0" -p $REDIS_PORT
  local oks
  oks=$(grep -c '^OK$' "$d/batch.out" || true)
  [ "$oks" = 1000 ] || fail "batch: $oks OKs, expected 1000"
  [ "$(tail -n 1 "$d/batch.out")" = 1000 ] || fail "batch: last INCR gave $(tail -n 1 "$d/batch.out")"

  # Mass insertion in the raw protocol (--pipe writes and reads concurrently).
  "$PY" - "$d/pipe.bin" <<'PYEOF'
import sys
with open(sys.argv[1], "wb") as f:
    for i in range(20000):
        k, v = f"pipe:{i}".encode(), (f"v{i}-" * (i % 50 + 1)).encode()
        f.write(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (len(k), k, len(v), v))
PYEOF
  client_stdin pipe 60 "$d/pipe.bin" redis-cli -h "$ADDR0" -p $REDIS_PORT --pipe
  grep -q 'errors: 0, replies: 20000' "$d/pipe.out" || fail "--pipe: $(tail -n 2 "$d/pipe.out")"
  rcli dbsize DBSIZE
  # small, big, 1000 key:*, counter, 20000 pipe:*
  [ "$(cat "$d/dbsize.out")" = 21003 ] || fail "DBSIZE $(cat "$d/dbsize.out"), expected 21003"
  rcli getpipe GET pipe:19999
  [ "$(cat "$d/getpipe.out")" = "$(printf 'v19999-%.0s' $(seq 50))" ] || fail "GET pipe:19999 differs"
  stop_server redis
}

case_redis_benchmark() {
  local d=$CASE_DIR t n=4000 tests=PING_INLINE,SET,GET,INCR,LPUSH,LRANGE_100
  start_redis
  run_client bench 120 redis-benchmark -h "$ADDR0" -p $REDIS_PORT -q -n $n -c 20 \
    -t ping_inline,set,get,incr,lpush,lrange_100
  run_client bench-pipelined 120 redis-benchmark -h "$ADDR0" -p $REDIS_PORT -q -n $((4 * n)) \
    -c 10 -P 16 -t set,get
  # Each line reads "SET: 41666.67 requests per second, p50=0.311 msec" (after \r progress).
  tr '\r' '\n' <"$d/bench.out" >"$d/bench.txt"
  tr '\r' '\n' <"$d/bench-pipelined.out" >"$d/bench-pipelined.txt"
  IFS=, read -ra want <<<"$tests"
  for t in "${want[@]}"; do
    grep -Eq "^${t}[^:]*: [0-9.]+ requests per second" "$d/bench.txt" ||
      fail "redis-benchmark reported no rate for $t: $(tail -n 3 "$d/bench.txt")"
  done
  for t in SET GET; do
    grep -Eq "^$t: [0-9.]+ requests per second" "$d/bench-pipelined.txt" ||
      fail "pipelined redis-benchmark reported no rate for $t"
  done
  if grep -Eq "^[A-Z_0-9 ()]+: 0(\.0+)? requests per second" "$d/bench.txt" "$d/bench-pipelined.txt"; then
    fail "a zero rate"
  fi
  # The server counted every command (plus the benchmark's own CONFIG calls).
  run_client info 30 redis-cli -h "$ADDR0" -p $REDIS_PORT INFO stats
  local cmds
  cmds=$(info_field total_commands_processed <"$d/info.out")
  [ "${cmds:-0}" -ge $((6 * n + 8 * n)) ] || fail "server processed ${cmds:-?} commands, expected >= $((14 * n))"
  stop_server redis
}

# rbench NAME ARGS...: one redis-benchmark run (-q); fails the case on a non-zero exit
# (redis-benchmark 7 exits 1 at the first error: a connection error, an error reply, a reply it
# cannot parse), on any error line, or unless every test of -t reported a non-zero rate. Sets
# RBENCH_REQUESTS to the requests of the run (-n per test).
rbench() {
  local name=$1 n want tests bad
  shift
  run_client "$name" 180 redis-benchmark -h "$ADDR0" -p $REDIS_PORT -q "$@"
  tr '\r' '\n' <"$CASE_DIR/$name.out" >"$CASE_DIR/$name.txt"
  if bad=$(grep -i -m 3 'error\|could not\|reset\|closed' "$CASE_DIR/$name.txt" "$CASE_DIR/$name.err"); then
    fail "redis-benchmark $name: $bad"
  fi
  n=$(awk '{ for (i = 1; i < NF; i++) if ($i == "-n") print $(i + 1) }' <<<"$*")
  want=$(awk '{ for (i = 1; i < NF; i++) if ($i == "-t") print split($(i + 1), t, ",") }' <<<"$*")
  # "SET: 41666.67 requests per second, p50=0.311 msec", "LRANGE_100 (first 100 elements): …"
  tests=$(grep -Ec '^[A-Z][A-Za-z_0-9 ()]*: [0-9.]+ requests per second' "$CASE_DIR/$name.txt" || true)
  # (LRANGE_* tests add an "LPUSH (needed to benchmark LRANGE)" run of their own.)
  [ "$tests" -ge "$want" ] ||
    fail "redis-benchmark $name reported $tests rates of $want tests: $(tail -n 3 "$CASE_DIR/$name.txt")"
  if grep -Eq '^[A-Z][A-Za-z_0-9 ()]*: 0(\.0+)? requests per second' "$CASE_DIR/$name.txt"; then
    fail "redis-benchmark $name: a zero rate"
  fi
  RBENCH_REQUESTS=$((n * tests))
  log "redis-benchmark $name: $tests tests × $n requests: $(grep -Eo '^[A-Z][A-Za-z_0-9 ()]*: [0-9.]+' "$CASE_DIR/$name.txt" | tr '\n' ' ')"
}

# redis-benchmark and redis-cli --pipe while every ring connection of the region is demoted to
# TCP every 50 ms (lib.sh storm_start): long-lived connections are moved mid-stream (with a
# pipeline in flight), and with -k 0 (a new connection per request) thousands of connections
# start on rings and are moved. Zero errors, every command executed, values intact.
case_redis_storm() {
  local d=$CASE_DIR total=0 cmds errs conns
  start_redis
  storm_start
  # 50 keep-alive clients per test, the tests one after the other (new clients each test).
  rbench keepalive -n 40000 -c 50 -r 10000 -t ping_inline,ping_mbulk,set,get,incr,lpush,lpop,lrange_100
  total=$((total + RBENCH_REQUESTS))
  # Pipelines of 32 requests: the rings hold requests and replies when the switch comes.
  rbench pipelined -n 200000 -c 20 -P 32 -r 10000 -d 256 -t set,get
  total=$((total + RBENCH_REQUESTS))
  # A fresh connection per request: connections are set up on rings and demoted all the time.
  rbench reconnect -n 6000 -c 20 -k 0 -r 10000 -t set,get
  total=$((total + RBENCH_REQUESTS))
  # Mass insertion on one connection (--pipe writes and reads at once), demoted mid-stream.
  "$PY" - "$d/pipe.bin" <<'PYEOF'
import sys
with open(sys.argv[1], "wb") as f:
    for i in range(50000):
        k, v = f"pipe:{i}".encode(), (f"v{i}-" * (i % 50 + 1)).encode()
        f.write(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (len(k), k, len(v), v))
PYEOF
  client_stdin pipe 120 "$d/pipe.bin" redis-cli -h "$ADDR0" -p $REDIS_PORT --pipe
  grep -q 'errors: 0, replies: 50000' "$d/pipe.out" || fail "--pipe: $(tail -n 2 "$d/pipe.out")"
  total=$((total + 50000))
  storm_stop

  # The values --pipe wrote, every one (a Lua script on the server compares them).
  run_client pipecheck 60 redis-cli -h "$ADDR0" -p $REDIS_PORT EVAL "
    local bad = 0
    for i = 0, 49999 do
      if redis.call('GET', 'pipe:' .. i) ~= string.rep('v' .. i .. '-', i % 50 + 1) then
        bad = bad + 1
      end
    end
    return bad" 0
  [ "$(cat "$d/pipecheck.out")" = 0 ] || fail "--pipe: $(cat "$d/pipecheck.out") values differ"
  # The server executed every request and answered none with an error.
  run_client info 30 redis-cli -h "$ADDR0" -p $REDIS_PORT INFO stats
  cmds=$(info_field total_commands_processed <"$d/info.out")
  errs=$(info_field total_error_replies <"$d/info.out")
  conns=$(info_field total_connections_received <"$d/info.out")
  [ "${cmds:-0}" -ge "$total" ] || fail "server processed ${cmds:-?} commands, expected >= $total"
  [ "${errs:-x}" = 0 ] || fail "server sent ${errs:-?} error replies"
  note "redis: $total requests, 0 errors (server: $cmds commands, $errs error replies," \
    "$conns connections)"
  storm_check
  # Every client closed its connections: redis closed them too (EOF reached it), none is left.
  storm_no_orphans
  stop_server redis
}

# The late ring with two event-loop programs: redis-benchmark's connections fall back to TCP at
# connect because the region has no ring memory left (a filler holds it), then the filler gives
# it back mid-run: ring variant — the connections come to their rings mid-stream (`late`
# switches counted); either variant — zero errors, every request executed.
# info_field FIELD < INFO output: that field's value.
info_field() {
  tr -d '\r' | awk -F: -v f="$1" '$1 == f { print $2 }'
}

# redis_commands: the server's total_commands_processed (asked from domain 1).
redis_commands() {
  dom_cmd 1 "$CLI_REGION"
  "${DOM[@]}" redis-cli -h "$ADDR0" -p $REDIS_PORT INFO stats 2>/dev/null |
    info_field total_commands_processed
}

# wait_commands BASE N PID: until the server processed N commands past BASE (or PID ended, or
# 60 s passed).
wait_commands() {
  local base=${1:-0} n=$2 pid=$3 i now
  for ((i = 0; i < 1200; i++)); do
    now=$(redis_commands)
    [ "${now:-0}" -ge $((base + n)) ] && return 0
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.05
  done
}

case_redis_late() {
  local d=$CASE_DIR bpid rc=0 late cmds errs
  start_redis
  fill_region $REDIS_PORT
  # 8 keep-alive clients, SET then GET: the SET clients connect while the region is full.
  rbench late -n 150000 -c 8 -r 10000 -t set,get &
  bpid=$!
  # Release once the SET clients run on TCP (not after a fixed time: on a fast machine the SET
  # test could end before it, and the GET clients would connect to a free region).
  wait_commands "$(redis_commands)" 2000 "$bpid"
  touch "$d/release"
  wait "$bpid" || rc=$?
  [ "$rc" = 0 ] || fail "redis-benchmark under the late ring: status $rc"
  grep -q released "$d/filler.out" || fail "the filler did not release: $(tail -n 3 "$d/filler.out")"
  run_client info 30 redis-cli -h "$ADDR0" -p $REDIS_PORT INFO stats
  cmds=$(info_field total_commands_processed <"$d/info.out")
  errs=$(info_field total_error_replies <"$d/info.out")
  [ "${cmds:-0}" -ge 300000 ] || fail "server processed ${cmds:-?} commands, expected >= 300000"
  [ "${errs:-x}" = 0 ] || fail "server sent ${errs:-?} error replies"
  late=$(late_rings)
  [ -z "$late" ] || [ "$late" -ge 1 ] || fail "no connection came to its ring late (switches.late = $late)"
  note "redis-late: ${late:-no (across regions)} late rings, $cmds commands, 0 errors"
  stop_server redis
}

# Over IPv6: redis-server bound to domain 0's IPv6 address and ::1; redis-cli from domain 1
# over the former (a 1 MiB value both ways, a batch), and from domain 0 over ::1.
case_redis_v6() {
  need_ipv6
  local d=$CASE_DIR i
  start_server redis redis-server --bind "$ADDR0_6" ::1 --port $REDIS_PORT --protected-mode no \
    --save "" --appendonly no --daemonize no --dir "$CASE_DIR" --logfile ""
  wait_listen redis $REDIS_PORT
  run_client ping 60 redis-cli -h "$ADDR0_6" -p $REDIS_PORT PING
  [ "$(cat "$d/ping.out")" = PONG ] || fail "PING answered $(cat "$d/ping.out")"
  head -c $((512 << 10)) /dev/urandom | od -An -vtx1 | tr -d ' \n' >"$d/big.txt"
  client_stdin setbig 60 "$d/big.txt" redis-cli -h "$ADDR0_6" -p $REDIS_PORT -x SET big
  [ "$(cat "$d/setbig.out")" = OK ] || fail "SET big: $(head -c 200 "$d/setbig.out")"
  run_client getbig 60 redis-cli -h "$ADDR0_6" -p $REDIS_PORT GET big
  [ "$(head -c $((1 << 20)) "$d/getbig.out" | sha256sum)" = "$(sha256sum <"$d/big.txt")" ] ||
    fail "GET big over IPv6: value differs"
  for ((i = 0; i < 1000; i++)); do echo "INCR counter"; done >"$d/batch.txt"
  client_stdin batch 60 "$d/batch.txt" redis-cli -h "$ADDR0_6" -p $REDIS_PORT
  [ "$(tail -n 1 "$d/batch.out")" = 1000 ] || fail "batch: last INCR gave $(tail -n 1 "$d/batch.out")"
  run_client clients 60 redis-cli -h "$ADDR0_6" -p $REDIS_PORT CLIENT LIST
  grep -qF "addr=[$ADDR1_6]:" "$d/clients.out" || fail "the server saw: $(cat "$d/clients.out")"
  # ::1 beside the server (its own client, loopback in domain 0).
  CLIENT_DOMAIN=0 run_client loopback 60 redis-cli -h ::1 -p $REDIS_PORT GET counter
  [ "$(cat "$d/loopback.out")" = 1000 ] || fail "GET counter over ::1: $(cat "$d/loopback.out")"
  stop_server redis
}
