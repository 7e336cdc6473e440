#!/usr/bin/env bash
# Real, unmodified programs across two memloop domains: server in domain 0, client in domain 1,
# both under `memloop run` (LD_PRELOAD of libmemloop_preload.so).
#
#   tests/programs/run.sh [--only NAME[,NAME…]] [--variant ring|fallback|both] [--list] [--keep]
#
# Variants:
#   ring      both ends in the same region: results must be right AND the region must show ring
#             traffic;
#   fallback  the client in another region (ML_FALLBACK_CLIENT=plain: without `memloop run`):
#             results must be right, neither region may show ring traffic, and the client's
#             region must have recorded a fallback (its library ran and chose TCP).
# NAME is a case or a prefix of cases ("python" = every python-* case); --list shows them.
#
# Environment:
#   MEMLOOP_BIN          memloop binary (default: build target/release/memloop)
#   MEMLOOP_PRELOAD_LIB  the preload library (default: next to the memloop binary)
#   ML_NO_PRELOAD=1      run the programs without `memloop run` (plain TCP; harness debugging):
#                        one "plain" variant, no ring assertions
#   ML_FALLBACK_CLIENT   region (default) | plain
#   ML_STRICT_RING=1     the ring variant also fails when a region recorded any fallback
#   ML_CASE_TIMEOUT      seconds per case (default 240)
#   ML_SKIP_INSTALL=1    do not run install-deps.sh
#   ML_KEEP=1            keep the run directory (it is always kept when something failed)
#   ML_STORM=0           the *-storm cases without their switch storm (a control run)
#   ML_STORM_INTERVAL    seconds between two rounds (demote --all, promote --all) of the storm
#                        (default 0.05)
#
# Needs root (namespaces, bridge). Exit status: 0 all passed, 1 some failed, 2 cannot run.
set -uo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
export HERE
# shellcheck source=tests/programs/lib.sh
. "$HERE/lib.sh"

ALL_CASES=(
  python-blocking python-selectors python-asyncio python-forking python-prefork
  python-sockopts python-http
  nginx-curl nginx-curl6
  redis-cli redis-benchmark redis-storm redis-late redis-v6
  iperf3
  sockperf-pingpong sockperf-throughput
  postgres-psql postgres-pgbench postgres-storm postgres-late postgres-v6
  sockperf-udp-pingpong sockperf-udp-throughput iperf3-udp dnsmasq-dig python-udp-asyncio
  inetd-tftp
)

usage() {
  sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'
}

only="" variant=both keep=${ML_KEEP:-0}
while [ $# -gt 0 ]; do
  case $1 in
    --only) only=${2:?--only needs a value}; shift 2 ;;
    --only=*) only=${1#--only=}; shift ;;
    --variant) variant=${2:?--variant needs a value}; shift 2 ;;
    --variant=*) variant=${1#--variant=}; shift ;;
    --keep) keep=1; shift ;;
    --list) printf '%s\n' "${ALL_CASES[@]}"; exit 0 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "run.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

case $variant in
  ring) variants=(ring) ;;
  fallback) variants=(fallback) ;;
  both) variants=(ring fallback) ;;
  *) echo "run.sh: --variant ring|fallback|both, not $variant" >&2; exit 2 ;;
esac
if [ "${ML_NO_PRELOAD:-0}" = 1 ]; then
  variants=(plain)
fi

cases=()
if [ -z "$only" ]; then
  cases=("${ALL_CASES[@]}")
else
  IFS=, read -ra wanted <<<"$only"
  for c in "${ALL_CASES[@]}"; do
    for w in "${wanted[@]}"; do
      if [ "$c" = "$w" ] || [ "${c#"$w"-}" != "$c" ]; then
        cases+=("$c")
        break
      fi
    done
  done
  [ ${#cases[@]} -gt 0 ] || { echo "run.sh: no case matches $only (see --list)" >&2; exit 2; }
fi

# ---------------------------------------------------------------------------------------------
# Preconditions: root, programs, memloop, the preload library.

[ "$(id -u)" = 0 ] || { echo "run.sh: needs root (network namespaces)" >&2; exit 2; }
if [ "${ML_SKIP_INSTALL:-0}" != 1 ]; then
  "$HERE/install-deps.sh" || { echo "run.sh: installing the programs failed" >&2; exit 2; }
fi

if [ -n "${MEMLOOP_BIN:-}" ]; then
  ML=$(realpath "$MEMLOOP_BIN")
else
  pkgs=(-p memloop-cli)
  if [ "${ML_NO_PRELOAD:-0}" != 1 ] && [ -d "$ROOT/crates/memloop-preload" ]; then
    pkgs+=(-p memloop-preload)
  fi
  log "building ${pkgs[*]}"
  (cd "$ROOT" && cargo build --release -q "${pkgs[@]}") || { echo "run.sh: build failed" >&2; exit 2; }
  ML=$ROOT/target/release/memloop
fi
[ -x "$ML" ] || { echo "run.sh: no memloop binary at $ML" >&2; exit 2; }
export ML
PY=python3
[ -x /usr/bin/python3 ] && PY=/usr/bin/python3 # the distribution's, not a user's shim
export PY
export PYTHONDONTWRITEBYTECODE=1 # no __pycache__ in the source tree

# Old runs that died without cleaning up: domains and regions whose owner pid is gone.
for ns in /run/netns/mp*-d0; do
  [ -e "$ns" ] || continue
  p=${ns#/run/netns/mp}
  p=${p%-d0}
  case $p in *[!0-9]* | "") continue ;; esac
  if ! kill -0 "$p" 2>/dev/null; then
    log "removing leftovers of run $p"
    "$ML" domains down --prefix "mp$p" >/dev/null 2>&1 || true
    rm -rf /dev/shm/memloop-mp"$p"-*
    rm -rf /etc/netns/mp"$p"-d0 /etc/netns/mp"$p"-d1
  fi
done

PREFIX=mp$$
RUN_DIR=$(mktemp -d /tmp/memloop-programs.XXXXXX)
chmod 755 "$RUN_DIR" # servers that drop privileges (postgres) work in it
export PREFIX RUN_DIR

if [ "${variants[0]}" != plain ]; then
  probe=$PREFIX-probe
  if ! out=$("$ML" run --strict --region "$probe" -- true 2>&1); then
    region_destroy "$probe"
    echo "run.sh: \`memloop run\` cannot start programs: $out" >&2
    echo "run.sh: (ML_NO_PRELOAD=1 runs the suite without the library, over plain TCP)" >&2
    rmdir "$RUN_DIR"
    exit 2
  fi
  region_destroy "$probe"
fi

# A /24 no interface uses yet, derived from our pid.
pick_subnet() {
  local k a b
  for ((k = 0; k < 500; k++)); do
    a=$((200 + ($$ + k) % 50))
    b=$(((($$ + k) / 50) % 256))
    if ! ip -4 -o addr show | grep -q " 10\.$a\.$b\."; then
      echo "10.$a.$b"
      return 0
    fi
  done
  return 1
}
net=$(pick_subnet) || { echo "run.sh: no free 10.x.y.0/24" >&2; exit 2; }
SUBNET=$net.0/24 ADDR0=$net.1 ADDR1=$net.2 NS0=$PREFIX-d0 NS1=$PREFIX-d1
export SUBNET ADDR0 ADDR1 NS0 NS1

regions=()
cleanup() {
  local r
  for r in "${regions[@]}"; do ring_watch_stop "$r" 2>/dev/null; done
  kill_domain_procs
  "$ML" domains down --prefix "$PREFIX" >/dev/null 2>&1
  rm -rf "/etc/netns/$NS0" "/etc/netns/$NS1"
  for r in "${regions[@]}"; do region_destroy "$r"; done
  if [ "$keep" = 1 ] || [ "${failed:-0}" -gt 0 ]; then
    log "logs kept in $RUN_DIR"
  else
    rm -rf "$RUN_DIR"
  fi
}
trap cleanup EXIT
case_pid=""
on_signal() {
  log "interrupted"
  failed=$((${failed:-0} + 1)) # keeps the logs
  # timeout(1) passes the signal on to the case's process group.
  [ -n "$case_pid" ] && kill -TERM "$case_pid" 2>/dev/null && wait "$case_pid" 2>/dev/null
  exit 130
}
trap on_signal INT TERM HUP

if ! "$ML" domains up 2 --prefix "$PREFIX" --subnet "$SUBNET" >"$RUN_DIR/domains.log" 2>&1; then
  cat "$RUN_DIR/domains.log" >&2
  echo "run.sh: cannot create the domains" >&2
  failed=1
  exit 2
fi
# Name lookups inside the domains stay local: `ip netns exec` mounts /etc/netns/NS/* over /etc,
# and reverse lookups of the domain addresses (http.server's getfqdn) must not wait for an
# unreachable resolver.
for ns in "$NS0" "$NS1"; do
  mkdir -p "/etc/netns/$ns"
  printf '127.0.0.1 localhost\n%s %s\n%s %s\n' "$ADDR0" "$NS0" "$ADDR1" "$NS1" >"/etc/netns/$ns/hosts"
  printf 'options timeout:1 attempts:1\n' >"/etc/netns/$ns/resolv.conf"
done
# Their IPv6 addresses (`memloop domains up` gives each one; the *6 cases need them).
addr6() {
  "$ML" domains list --prefix "$PREFIX" --json |
    jq -r --argjson i "$1" '.domains[] | select(.index == $i) | .address6 // empty | sub("/.*"; "")'
}
ADDR0_6=$(addr6 0) ADDR1_6=$(addr6 1)
SUBNET6=${ADDR0_6%::*}::/64
export ADDR0_6 ADDR1_6 SUBNET6
log "domains $NS0 ($ADDR0, ${ADDR0_6:-no IPv6}) and $NS1 ($ADDR1, ${ADDR1_6:-no IPv6}), logs in $RUN_DIR"

# ---------------------------------------------------------------------------------------------
# The cases.

CASE_TIMEOUT=${ML_CASE_TIMEOUT:-240}
export SERVER_TIMEOUT=$CASE_TIMEOUT
failed=0
passed=0
n=0
results=()
t_start=$EPOCHREALTIME

secs_since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }

for c in "${cases[@]}"; do
  for v in "${variants[@]}"; do
    n=$((n + 1))
    CASE_DIR=$RUN_DIR/$c-$v
    mkdir -p "$CASE_DIR"
    chmod 755 "$CASE_DIR"
    export CASE_DIR
    rs=$PREFIX-$n-s rc_=$PREFIX-$n-c
    case $v in
      ring) SRV_REGION=$rs CLI_REGION=$rs; mine=("$rs") ;;
      fallback)
        SRV_REGION=$rs CLI_REGION=$rc_
        mine=("$rs" "$rc_")
        if [ "${ML_FALLBACK_CLIENT:-region}" = plain ]; then
          CLI_REGION=""
          mine=("$rs")
        fi
        ;;
      plain) SRV_REGION="" CLI_REGION="" mine=() ;;
    esac
    export SRV_REGION CLI_REGION
    for r in "${mine[@]}"; do
      regions+=("$r")
      region_create "$r" || { echo "run.sh: cannot create region $r" >&2; exit 2; }
      ring_watch_start "$r"
    done

    log "---- $c ($v)"
    t0=$EPOCHREALTIME
    rc=0
    # In the background so that a signal to run.sh is handled at once (bash runs traps only
    # between foreground commands; `wait` is interruptible).
    timeout -k 10 "$CASE_TIMEOUT" "$HERE/case.sh" "$c" >"$CASE_DIR/case.log" 2>&1 &
    case_pid=$!
    wait "$case_pid" || rc=$?
    case_pid=""
    kill_domain_procs
    for r in "${mine[@]}"; do ring_watch_stop "$r"; done
    took=$(secs_since "$t0")

    verdict=PASS note=""
    if [ $rc = 124 ] || [ $rc = 137 ]; then
      verdict=FAIL note="timed out after ${CASE_TIMEOUT}s"
    elif [ $rc != 0 ]; then
      verdict=FAIL note=$(grep 'FAIL:' "$CASE_DIR/case.log" | tail -n 1 | sed 's/.*FAIL: //')
      [ -n "$note" ] || note="exit status $rc"
    fi
    # What the case noted about itself (lib.sh note: counts, the storm's switches).
    if [ -s "$CASE_DIR/note" ]; then
      note="${note:+$note; }$(paste -sd'|' "$CASE_DIR/note" | sed 's/|/; /g')"
    fi
    # Ring evidence (also when the programs failed: it says how far they got).
    for r in "${mine[@]}"; do
      if [ "$v" = ring ]; then
        if ! assert_ring_used "$r" >>"$CASE_DIR/case.log" 2>&1; then
          if [ $verdict = PASS ]; then
            note="results right but NO ring traffic in $r"
            if jq -e .ring_used "$CASE_DIR/ring-$r.json" >/dev/null 2>&1; then
              note="results right, ring used, but fallbacks recorded in $r (ML_STRICT_RING)"
            fi
          fi
          verdict=FAIL
        fi
      elif ! assert_tcp_fallback "$r" >>"$CASE_DIR/case.log" 2>&1; then
        [ $verdict = PASS ] && note="ring traffic in $r although the peer is outside it"
        verdict=FAIL
      elif [ "$r" = "$rc_" ] && ! assert_fallback_recorded "$r" >>"$CASE_DIR/case.log" 2>&1; then
        # The client's library was there and saw its peer outside its region: it must say so.
        [ $verdict = PASS ] && note="no fallback recorded in the client's region $r"
        verdict=FAIL
      fi
      ev=$(jq -r '"\(.region | sub(".*-"; "")): ring \(.ring_bytes_seen)B in \(.channels_with_bytes) ch, members \(.max_members_seen), fallbacks \(.fallbacks | to_entries | map("\(.key)=\(.value)") | join(",") | if . == "" then "none" else . end)"' \
        "$CASE_DIR/ring-$r.json" 2>/dev/null || echo "no status for $r")
      note="${note:+$note; }$ev"
    done
    for r in "${mine[@]}"; do region_destroy "$r"; done

    if [ $verdict = PASS ]; then
      passed=$((passed + 1))
    else
      failed=$((failed + 1))
      sed 's/^/    | /' "$CASE_DIR/case.log" | tail -n 25 >&2
    fi
    line=$(printf '%-20s %-8s %-4s %6ss  %s' "$c" "$v" "$verdict" "$took" "$note")
    log "$line"
    results+=("$line")
    jq -nc --arg case "$c" --arg variant "$v" --arg verdict "$verdict" --arg note "$note" \
      --argjson seconds "$took" '$ARGS.named' >>"$RUN_DIR/results.jsonl"
  done
done

total=$(secs_since "$t_start")
echo
echo "== real programs across two domains ($passed passed, $failed failed, ${total}s)"
printf '%s\n' "${results[@]}"
[ $failed = 0 ]
