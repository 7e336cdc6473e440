# shellcheck shell=bash
# Helpers for the real-program suite, sourced by run.sh and by each case (case.sh).
#
# A case runs servers in domain 0 and clients in domain 1 (network namespaces on a bridge, from
# `memloop domains`), each under `memloop run` with the region its variant gives it:
#   SRV_REGION  region of the server side ("" = no `memloop run`)
#   CLI_REGION  region of the client side ("" = no `memloop run`)
# and checks the programs' results. Whether the ring was used is judged afterwards, by run.sh,
# with assert_ring_used / assert_tcp_fallback below (py/ringcheck.py reads the status JSON).
#
# Environment set by run.sh: ML (memloop binary), PY (python3), HERE (this directory), PREFIX,
# NS0/NS1 (namespaces), ADDR0/ADDR1 (their addresses), ADDR0_6/ADDR1_6 and SUBNET6 (their IPv6
# addresses, empty without IPv6), SUBNET, CASE_DIR (this case's files), SRV_REGION, CLI_REGION,
# SERVER_TIMEOUT.

# need_ipv6: the *6 cases need the domains' IPv6 addresses.
need_ipv6() {
  [ -n "${ADDR0_6:-}" ] && [ -n "${ADDR1_6:-}" ] || fail "the domains have no IPv6 addresses"
}

log() { printf '[%(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

# Fails the current case (the case runs in its own process).
fail() {
  log "FAIL: $*"
  exit 1
}

# Sets DOM to the argv prefix that runs a command in domain $1 under region $2 ("" = plain).
dom_cmd() {
  local i=$1 region=$2
  DOM=("$ML" domains exec "$i" --prefix "$PREFIX" --)
  if [ -n "$region" ]; then
    DOM+=("$ML" run --strict --no-create --region "$region" --)
  fi
}

# start_server NAME CMD...: CMD in domain 0 in the background, bounded by SERVER_TIMEOUT;
# stdout+stderr in $CASE_DIR/NAME.log, the pid of its timeout(1) in $CASE_DIR/NAME.pid.
start_server() {
  local name=$1
  shift
  dom_cmd 0 "$SRV_REGION"
  log "server $name: $*"
  timeout -k 5 "${SERVER_TIMEOUT:-300}" "${DOM[@]}" "$@" >"$CASE_DIR/$name.log" 2>&1 &
  echo $! >"$CASE_DIR/$name.pid"
}

server_alive() {
  kill -0 "$(cat "$CASE_DIR/$1.pid")" 2>/dev/null
}

# wait_listen NAME PORT [SECS]: until something listens on ADDR0:PORT in domain 0; fails early
# if server NAME exits.
wait_listen() {
  local name=$1 port=$2 secs=${3:-20} i
  for ((i = 0; i < secs * 10; i++)); do
    if ip netns exec "$NS0" ss -Hltn "sport = :$port" 2>/dev/null | grep -q .; then
      return 0
    fi
    if ! server_alive "$name"; then
      tail -n 30 "$CASE_DIR/$name.log" >&2
      fail "server $name exited before listening on port $port"
    fi
    sleep 0.1
  done
  tail -n 30 "$CASE_DIR/$name.log" >&2
  fail "server $name not listening on $ADDR0:$port after ${secs}s"
}

# wait_server NAME [SECS]: the server exits by itself (after its last client) with status 0.
wait_server() {
  local name=$1 secs=${2:-20} pid rc=0 i
  pid=$(cat "$CASE_DIR/$name.pid")
  for ((i = 0; i < secs * 10; i++)); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then
    tail -n 30 "$CASE_DIR/$name.log" >&2
    fail "server $name still running ${secs}s after its last client"
  fi
  wait "$pid" || rc=$?
  if [ "$rc" != 0 ]; then
    tail -n 30 "$CASE_DIR/$name.log" >&2
    fail "server $name exited with status $rc"
  fi
}

# stop_server NAME: SIGTERM to its timeout(1), which passes it on to its process group.
stop_server() {
  local pid
  pid=$(cat "$CASE_DIR/$1.pid")
  kill -TERM "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}

# run_client NAME SECS CMD...: CMD in domain 1, in the foreground, at most SECS seconds; stdout in
# $CASE_DIR/NAME.out, stderr in $CASE_DIR/NAME.err. A non-zero exit fails the case.
run_client() {
  local name=$1 secs=$2 rc=0 snap
  shift 2
  # (CLIENT_DOMAIN=0: a client beside the server, e.g. over ::1.)
  dom_cmd "${CLIENT_DOMAIN:-1}" "$CLI_REGION"
  log "client $name: $*"
  # A client that hangs: what every region and program looked like just before the timeout.
  (sleep $((secs > 10 ? secs - 3 : secs)) && hang_snapshot "$CASE_DIR/$name.hang") &
  snap=$!
  timeout -k 5 "$secs" "${DOM[@]}" "$@" >"$CASE_DIR/$name.out" 2>"$CASE_DIR/$name.err" || rc=$?
  kill "$snap" 2>/dev/null
  if [ "$rc" != 0 ]; then
    tail -n 20 "$CASE_DIR/$name.out" "$CASE_DIR/$name.err" >&2
    [ "$rc" = 124 ] && fail "client $name timed out after ${secs}s"
    fail "client $name exited with status $rc"
  fi
}

# hang_snapshot FILE: the status of the case's regions (each connection's path and switch
# state) and the threads' stacks of every program in the two domains, into FILE.
hang_snapshot() {
  local out=$1 r pid ns
  {
    for r in $(printf '%s\n' "$SRV_REGION" "$CLI_REGION" | sort -u); do
      echo "== memloop status --json --region $r"
      "$ML" status --json --region "$r" 2>&1
    done
    for ns in "$NS0" "$NS1"; do
      for pid in $(ip netns pids "$ns" 2>/dev/null); do
        echo "== $ns pid $pid: $(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null)"
        if command -v gdb >/dev/null; then
          timeout 20 gdb -p "$pid" -batch -ex 'thread apply all bt 25' 2>&1 | grep -E '^(Thread|#)'
        else
          cat /proc/"$pid"/task/*/wchan 2>/dev/null; echo
        fi
      done
    done
  } >"$out" 2>&1
  log "hang snapshot in $out"
}

# client_stdin NAME SECS FILE CMD...: as run_client with FILE on stdin.
client_stdin() {
  local name=$1 secs=$2 input=$3 rc=0
  shift 3
  dom_cmd 1 "$CLI_REGION"
  log "client $name: $* < $(basename "$input")"
  timeout -k 5 "$secs" "${DOM[@]}" "$@" <"$input" >"$CASE_DIR/$name.out" 2>"$CASE_DIR/$name.err" || rc=$?
  if [ "$rc" != 0 ]; then
    tail -n 20 "$CASE_DIR/$name.out" "$CASE_DIR/$name.err" >&2
    [ "$rc" = 124 ] && fail "client $name timed out after ${secs}s"
    fail "client $name exited with status $rc"
  fi
}

# random_file PATH BYTES: pseudo-random bytes; prints nothing.
random_file() {
  head -c "$2" /dev/urandom >"$1"
}

sha256() {
  sha256sum "$1" | cut -d' ' -f1
}

# ---------------------------------------------------------------------------------------------
# Domains, processes, regions (used by run.sh).

# Kills every process inside our domains (all of them are ours).
kill_domain_procs() {
  local ns pids
  for ns in "$NS0" "$NS1"; do
    pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')
    if [ -n "${pids// /}" ]; then
      # shellcheck disable=SC2086 # a list of pids
      kill -KILL $pids 2>/dev/null || true
    fi
  done
}

region_create() {
  # Mode 666: servers that drop privileges (postgres, nginx workers) must attach too. 32 MiB
  # of rings with 1,024 channel slots: the late-ring cases' filler runs it out of ring memory
  # (rings shrink with the pressure) after ~300 connections, within its 600, with slots
  # left for decline markers.
  "$ML" region create --region "$1" --mode 666 --size 32M --channels 1024 >/dev/null
}

region_destroy() {
  "$ML" region destroy --region "$1" >/dev/null 2>&1 || true
}

# ring_watch_start REGION: samples the region's status in the background (channels vanish when
# both ends close, so a final look alone could miss short connections).
ring_watch_start() {
  "$PY" "$HERE/py/ringcheck.py" watch --memloop "$ML" --region "$1" \
    --state "$CASE_DIR/watch-$1.json" --interval 0.05 >/dev/null 2>&1 &
  echo $! >"$CASE_DIR/watch-$1.pid"
}

ring_watch_stop() {
  local f=$CASE_DIR/watch-$1.pid
  [ -f "$f" ] || return 0
  kill -TERM "$(cat "$f")" 2>/dev/null || true
  wait "$(cat "$f")" 2>/dev/null || true
  rm -f "$f"
}

# assert_ring_used REGION: the region recorded ring traffic. The verdict and the evidence (one
# JSON line) go to $CASE_DIR/ring-REGION.json and stdout. Adapt the rules in py/ringcheck.py.
# ML_STRICT_RING=1: also fail when the region recorded any fallback.
assert_ring_used() {
  local strict=()
  [ "${ML_STRICT_RING:-0}" = 1 ] && strict=(--strict)
  "$PY" "$HERE/py/ringcheck.py" ring --memloop "$ML" --region "$1" "${strict[@]}" \
    --state "$CASE_DIR/watch-$1.json" | tee "$CASE_DIR/ring-$1.json"
  return "${PIPESTATUS[0]}"
}

# assert_fallback_recorded REGION: the region recorded at least one TCP fallback (uses the
# summary assert_tcp_fallback wrote).
assert_fallback_recorded() {
  jq -e '(.fallbacks | add // 0) + .fallback_records_seen > 0' "$CASE_DIR/ring-$1.json" >/dev/null
}

# assert_tcp_fallback REGION: the region recorded no ring traffic.
assert_tcp_fallback() {
  "$PY" "$HERE/py/ringcheck.py" fallback --memloop "$ML" --region "$1" \
    --state "$CASE_DIR/watch-$1.json" | tee "$CASE_DIR/ring-$1.json"
  return "${PIPESTATUS[0]}"
}

# ---------------------------------------------------------------------------------------------
# Switch storm (live path switching, issue 12): the ring connections of the server's region are
# asked to leave their rings again and again while a workload runs. The programs must not
# notice: no error, no lost or corrupted byte.

# note TEXT: one line of the case's summary; run.sh shows the lines in the results table.
note() {
  printf '%s\n' "$*" >>"$CASE_DIR/note"
  log "$*"
}

# storm_promote REGION: the promotion half of a storm round. `memloop promote --all --wait 0`
# asks every connection of the region whose both sides are on TCP (demoted by the round before)
# to come back to its ring; the preloaded processes agree the stream position and move on their
# next call or heartbeat. Connections still on their rings are left alone.
storm_promote() {
  "$ML" promote --all --wait 0 --region "$1"
}

# storm_start: in the background, every ML_STORM_INTERVAL seconds (default 0.05) until
# storm_stop, `memloop demote --all --wait 0` on the server's region (every accepted ring
# connection of it is asked to leave its ring), then storm_promote (every connection both of
# whose sides are on TCP is asked back to its ring): connections go ring → TCP → ring … while
# the workload runs. Each round's output goes to $CASE_DIR/storm.log; a command that fails is
# logged as a line starting with FAILED.
# Without a region (ML_NO_PRELOAD=1) there is nothing to demote and it does nothing.
# ML_STORM=0: no storm at all (a control run of the same workload; storm_check then only notes).
storm_start() {
  [ -n "$SRV_REGION" ] || return 0
  [ "${ML_STORM:-1}" != 0 ] || { log "storm: off (ML_STORM=0)"; return 0; }
  local interval=${ML_STORM_INTERVAL:-0.05}
  log "storm: demote --all, then promote --all, every ${interval}s in $SRV_REGION"
  (
    trap 'exit 0' TERM
    # Also ends when the case does without storm_stop (a failure): the loop outlives nothing.
    while kill -0 "$$" 2>/dev/null; do
      if ! out=$("$ML" demote --all --wait 0 --region "$SRV_REGION" 2>&1); then
        printf 'FAILED demote: %s\n' "$out"
      else
        printf '%s\n' "$out"
      fi
      if ! out=$(storm_promote "$SRV_REGION" 2>&1); then
        printf 'FAILED promote: %s\n' "$out"
      else
        printf '%s\n' "$out"
      fi
      sleep "$interval"
    done
  ) >>"$CASE_DIR/storm.log" 2>&1 &
  echo $! >"$CASE_DIR/storm.pid"
}

# storm_asked VERB: channels the storm's VERB rounds newly asked, summed. A round prints
# "demote: asked 5 channels to leave the ring (2 already asked before)": it lists every selected
# channel, the 2 were still on their way from an earlier round (not asked again, not counted
# again in `switches`), so it newly asked 3.
storm_asked() {
  awk -v verb="$1:" '$1 == verb && $2 == "asked" {
      n += $3
      for (i = 4; i < NF; i++) if ($(i + 1) == "already") n -= substr($i, 2) + 0
    } END { print n + 0 }' "$CASE_DIR/storm.log"
}

# storm_stop: ends the storm; fails the case if any of its rounds failed. Sets STORM_ROUNDS
# (demote rounds), STORM_ASKED (channels asked to leave their rings, summed over the rounds),
# STORM_PROMOTE_ROUNDS and STORM_PROMOTE_ASKED (channels asked back to their rings).
storm_stop() {
  local f=$CASE_DIR/storm.pid
  STORM_ROUNDS=0 STORM_ASKED=0 STORM_PROMOTE_ROUNDS=0 STORM_PROMOTE_ASKED=0
  [ -f "$f" ] || return 0 # no storm (no region, or ML_STORM=0)
  kill -TERM "$(cat "$f")" 2>/dev/null || true
  wait "$(cat "$f")" 2>/dev/null || true
  rm -f "$f"
  STORM_ROUNDS=$(grep -c '^demote: asked' "$CASE_DIR/storm.log" || true)
  STORM_ASKED=$(storm_asked demote)
  STORM_PROMOTE_ROUNDS=$(grep -c '^promote: asked' "$CASE_DIR/storm.log" || true)
  STORM_PROMOTE_ASKED=$(storm_asked promote)
  if grep -q '^FAILED' "$CASE_DIR/storm.log"; then
    grep '^FAILED' "$CASE_DIR/storm.log" | tail -n 5 >&2
    fail "storm: $(grep -c '^FAILED' "$CASE_DIR/storm.log") rounds failed"
  fi
  [ "$STORM_ROUNDS" -gt 0 ] || fail "storm: no demote round ran"
  [ "$STORM_PROMOTE_ROUNDS" -gt 0 ] || fail "storm: no promote round ran"
}

# storm_kill: ends a storm still running, quietly (case.sh runs it when a case exits).
storm_kill() {
  local f=$CASE_DIR/storm.pid
  [ -f "$f" ] || return 0
  kill -TERM "$(cat "$f")" 2>/dev/null || true
  rm -f "$f"
}

# storm_no_orphans [SECS]: once the clients are gone, no channel of the server's region may be
# held by one side after the other closed it (default: wait up to 5 s for it to settle). A
# connection whose client closed while a switch was under way must still reach the server as
# EOF — else the server keeps it forever (and its channel: the region fills up and new
# connections fall back with region_full). Only for servers that close a connection when its
# client does (redis: one process). The orphans are kept in $CASE_DIR/orphans.jsonl, with the
# region's status (orphans-status.json) and the server domain's sockets (orphans-ss.txt).
storm_no_orphans() {
  [ -n "$SRV_REGION" ] && [ "$SRV_REGION" = "$CLI_REGION" ] || return 0
  local secs=${1:-5} i n
  for ((i = 0; i < secs * 10; i++)); do
    "$PY" "$HERE/py/ringcheck.py" orphans --memloop "$ML" --region "$SRV_REGION" \
      >"$CASE_DIR/orphans.jsonl" 2>&1 && return 0
    sleep 0.1
  done
  "$ML" status --region "$SRV_REGION" --json >"$CASE_DIR/orphans-status.json" 2>&1
  # The server's sockets: an orphan's connection is still open there (CLOSE-WAIT: the client's
  # FIN arrived, the program was never told).
  ip netns exec "$NS0" ss -tanpi >"$CASE_DIR/orphans-ss.txt" 2>&1
  n=$(grep -c . "$CASE_DIR/orphans.jsonl")
  note "storm: $n channels orphaned (one side closed, the other still holds them ${secs}s later)"
  head -n 3 "$CASE_DIR/orphans.jsonl" >&2
  fail "storm: $n channels still held by the server ${secs}s after their client closed them" \
    "(first: $(head -n 1 "$CASE_DIR/orphans.jsonl" | jq -c '{idx, gen, client_closed, server_closed, switch_requested, on_tcp, tuple}' 2>/dev/null))"
}

# storm_check: after storm_stop, whether connections really switched, both ways. The region's
# status (and what run.sh's watcher sampled, py/ringcheck.py) must show, when both ends share the
# region (ring variant): operator switch requests (`switches.operator` > 0), connections recorded
# as switched to TCP by the operator after carrying ring bytes (mid-stream), and completed
# promotions back to the ring (`switches.promoted` > 0); when the client is outside (fallback
# variant): no switch at all (there was no ring to leave, nor to come back to). Notes the numbers.
storm_check() {
  [ -n "$SRV_REGION" ] || { note "storm: no region (plain TCP), nothing to demote"; return 0; }
  [ "${ML_STORM:-1}" != 0 ] || { note "storm: off (ML_STORM=0)"; return 0; }
  local s ops prom rec mid
  s=$("$PY" "$HERE/py/ringcheck.py" summary --memloop "$ML" --region "$SRV_REGION" \
    --state "$CASE_DIR/watch-$SRV_REGION.json") || fail "storm: no status of $SRV_REGION"
  printf '%s\n' "$s" >"$CASE_DIR/storm-summary.json"
  ops=$(jq '.switches.operator // 0' <<<"$s")
  prom=$(jq '.switches.promoted // 0' <<<"$s")
  rec=$(jq '.switched_record_reasons.operator // 0' <<<"$s")
  mid=$(jq '.switched_with_ring_bytes' <<<"$s")
  note "storm: $STORM_ROUNDS demote rounds asked $STORM_ASKED channels," \
    "$STORM_PROMOTE_ROUNDS promote rounds asked $STORM_PROMOTE_ASKED;" \
    "switches.operator=$ops, switches.promoted=$prom;" \
    "switched records seen $rec ($mid after ring bytes)"
  if [ "$SRV_REGION" = "$CLI_REGION" ]; then
    [ "$ops" -gt 0 ] || fail "storm: switches.operator = 0: no connection was asked to switch"
    [ "$rec" -gt 0 ] || fail "storm: no connection record shows a switch by the operator"
    [ "$mid" -gt 0 ] || fail "storm: no switched connection had carried ring bytes first"
    [ "$STORM_PROMOTE_ASKED" -gt 0 ] || fail "storm: no promote round found a connection on TCP"
    [ "$prom" -gt 0 ] || fail "storm: switches.promoted = 0: no connection came back to its ring"
  else
    [ "$ops" = 0 ] || fail "storm: $ops operator switches although no connection was on a ring"
    [ "$prom" = 0 ] || fail "storm: $prom promotions although no connection was on a ring"
  fi
}

# fill_region PORT: a filler in domain 1 (py/filler.py, under the client's region) opens idle
# connections to domain 0's PORT until one falls back to TCP (no ring memory left), then waits
# for $CASE_DIR/release; fails the case if the region never filled. Its output:
# $CASE_DIR/filler.out.
fill_region() {
  local d=$CASE_DIR i
  # Exited processes of the case (pgbench -i, psql) may still hold ring memory until a sweep
  # reclaims them; a client that finds the region full reclaims them itself and gets a ring —
  # then "full" was not full of live connections. Reclaim first.
  [ -z "$CLI_REGION" ] || "$ML" region reclaim --region "$CLI_REGION" >/dev/null 2>&1 || true
  # With both ends in one region, the filler tells "full" from a transient fallback by the
  # region's region_full counter.
  local look=()
  [ -z "$CLI_REGION" ] || [ "$SRV_REGION" != "$CLI_REGION" ] || look=("$ML" "$CLI_REGION")
  dom_cmd 1 "$CLI_REGION"
  "${DOM[@]}" "$PY" "$HERE/py/filler.py" "$ADDR0" "$1" "$d" "${look[@]}" >"$d/filler.out" 2>&1 &
  for ((i = 0; i < 600; i++)); do
    [ -e "$d/filled" ] && break
    sleep 0.1
  done
  [ -e "$d/filled" ] || fail "the filler never filled the region: $(tail -n 3 "$d/filler.out")"
  log "filler: $(cat "$d/filler.out")"
}

# late_rings: how many connections of the server's region came to their rings late, or nothing
# when the ends are in different regions (no late ring is possible there).
late_rings() {
  if [ -n "$SRV_REGION" ] && [ "$SRV_REGION" = "$CLI_REGION" ]; then
    "$ML" status --json --region "$SRV_REGION" | jq '.switches.late // 0'
  fi
}
