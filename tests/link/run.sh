#!/usr/bin/env bash
# shellcheck disable=SC2015 # `A && B || fail …`: fail when either does not hold
# End-to-end tests of `memloop link`: a point-to-point network link whose wire is a shared-memory
# region. Two domains (network namespaces on a bridge, `memloop domains`) each run a side of one
# link (`memloop link up` in d0 and d1; d2 is the third party); real programs (ping, iperf3, a
# static Go HTTP client/server, a checksummed TCP stream) talk over it, and the link's counters in
# `memloop status --json` must show that their bytes crossed the link, not the bridge.
#
#   tests/link/run.sh [--only CASE[,CASE…]] [--list] [--keep]
#
# Cases (in this order; each brings the link up first if a side is missing):
#   ping            ping -4 / -6 both ways; the status JSON's halves: carrier, addresses,
#                   offloads, packet counters
#   iperf3_tcp      iperf3 -t 3 d0 → d1 over the link (the link's rx_bytes cover what arrived),
#                   then the same over the bridge for comparison (not checked)
#   iperf3_udp      iperf3 -u -b 500M -l 1400 -t 2 over the link; notes the loss
#   go_static_http  a static Go program (go/httpcheck): GET 64 MiB and POST 16 MiB, SHA-256
#                   checked, counters cover them
#   carrier         link down in d1: d0 loses its carrier (≤ 3 s) and the status says so;
#                   link up in d1 again: carrier on both, ping works
#   busy            a third `link up` of the same link in d2 fails, naming the link, and
#                   disturbs nothing
#   kill_restart    a 512 MiB checksummed TCP stream d0 → d1; ~1 s in, SIGKILL to d1's service:
#                   d0 loses its carrier (≤ 3 s), `link up` in d1 again, the stream completes
#                   intact (≤ 60 s); restarts counted
#
# Environment:
#   MEMLOOP_BIN           memloop binary (default: target/release/memloop)
#   ML_KEEP=1             keep the run directory (always kept when a case failed)
#   ML_LINK_BASELINE=0    no iperf3 over the bridge for comparison in iperf3_tcp
#   ML_LINK_KILL_RATE     MiB/s of the kill_restart stream (default 128: it must still run
#                         when its receiver's side is killed)
#
# Needs root, ip, jq, iperf3, ping, go (Go ≥ 1.19), timeout, ss. Every case is bounded by
# timeout(1). Prints one line per case; exit status: 0 all passed, 1 some failed, 2 cannot run.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
SELF=$HERE/$(basename "$0")

ALL_CASES=(ping iperf3_tcp iperf3_udp go_static_http carrier busy kill_restart)

# Seconds each case may take (timeout(1) ends it after that).
case_timeout() {
  case $1 in
    kill_restart) echo 150 ;;
    go_static_http | iperf3_tcp) echo 90 ;;
    *) echo 60 ;;
  esac
}

log() { printf '[%(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

# ---------------------------------------------------------------------------------------------
# Helpers of the cases (each case runs in its own process: `run.sh --case NAME`, environment
# from the parent: ML, PREFIX, REGION, LINK, IFN, K, B0/B1, HC/HC_ERR, RUN_DIR, CASE_DIR).

# fail REASON: ends the case; the first reason given is the case's.
fail() {
  [ -e "$CASE_DIR/reason" ] || printf '%s\n' "$*" >"$CASE_DIR/reason"
  log "FAIL: $*"
  exit 1
}

# note TEXT: one piece of the case's result line (numbers, what was seen).
note() {
  printf '%s\n' "$*" >>"$CASE_DIR/note"
  log "$*"
}

ns() { echo "$PREFIX-d$1"; }

# The link addresses of domain I's side (d2's would be the third party's).
addr4() { case $1 in 0) echo "10.99.$K.1" ;; 1) echo "10.99.$K.2" ;; *) echo "10.99.$K.5" ;; esac; }
addr6() { case $1 in 0) echo "fd99:$K::1" ;; 1) echo "fd99:$K::2" ;; *) echo "fd99:$K::5" ;; esac; }

now() { echo "$EPOCHREALTIME"; }
since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.2f", b - a }'; }

# alive PID: the process exists and is not a zombie.
alive() {
  local st
  st=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  st=${st##*) }
  [ "${st:0:1}" != Z ]
}

# carrier I: domain I's link interface carrier: 1, 0, "down" (administratively) or "gone".
carrier() {
  # shellcheck disable=SC2016 # expanded by sh -c
  ip netns exec "$(ns "$1")" sh -c \
    'cat "/sys/class/net/$1/carrier" 2>/dev/null || { [ -e "/sys/class/net/$1" ] && echo down || echo gone; }' \
    sh "$IFN"
}

# wait_carrier I WANT SECS: until carrier I reads WANT; sets WAITED (seconds it took).
wait_carrier() {
  local i=$1 want=$2 secs=$3 t0 n
  t0=$(now)
  for ((n = 0; n < secs * 20; n++)); do
    if [ "$(carrier "$i")" = "$want" ]; then
      WAITED=$(since "$t0")
      return 0
    fi
    sleep 0.05
  done
  [ "$(carrier "$i")" = "$want" ] && { WAITED=$(since "$t0"); return 0; }
  return 1
}

status_now() {
  timeout -k 2 10 "$ML" status --region "$REGION" --json
}

# half_in STATUS I: domain I's half of our link in STATUS (the live half whose service runs in
# domain I's namespace, with "index" added), or null.
half_in() {
  local st=$1 i=$2 idx pid
  while read -r idx pid; do
    [ -n "$pid" ] || continue
    if alive "$pid" && [ "$(ip netns identify "$pid" 2>/dev/null)" = "$(ns "$i")" ]; then
      jq -c --arg n "$LINK" --argjson k "$idx" \
        '[.links[] | select(.name == $n)][0].halves[$k] + {index: $k}' <<<"$st"
      return 0
    fi
  done < <(jq -r --arg n "$LINK" \
    '[.links[]? | select(.name == $n)][0].halves // [] | to_entries[] | select(.value != null) | "\(.key) \(.value.pid)"' \
    <<<"$st" 2>/dev/null)
  echo null
}

# status_links: a fresh status (also in $CASE_DIR/status-last.json); fails the case when it has
# no "links" array.
status_links() {
  local st
  st=$(status_now) || fail "memloop status --region $REGION --json failed"
  printf '%s\n' "$st" >"$CASE_DIR/status-last.json"
  jq -e '.links | type == "array"' <<<"$st" >/dev/null 2>&1 ||
    fail "memloop status --json has no \"links\" array (top-level keys: $(jq -c 'keys' <<<"$st" 2>/dev/null))"
  printf '%s\n' "$st"
}

# link_entry STATUS: our link's entry, compact (for messages).
link_entry() {
  jq -c --arg n "$LINK" '[.links[]? | select(.name == $n)][0]' <<<"$1" 2>/dev/null
}

# half I: domain I's half from a fresh status; fails the case when there is none.
half() {
  local st h
  st=$(status_links) || exit 1
  h=$(half_in "$st" "$1")
  [ "$h" != null ] || fail "the status shows no live half of link $LINK in d$1: $(link_entry "$st")"
  printf '%s\n' "$h"
}

# cnt HALF FIELD: a counter of a half (JSON from `half`).
cnt() {
  jq -r --arg f "$2" '.counters[$f] // "missing"' <<<"$1"
}

# grew BEFORE AFTER FIELD: how much a counter grew between two looks at one half.
grew() {
  local a b
  a=$(cnt "$1" "$3") b=$(cnt "$2" "$3")
  [ "$a" != missing ] && [ "$b" != missing ] || fail "no counter $3 in the status's half: $2"
  echo $((b - a))
}

# service_pid I: sets SVC_PID to the pid of domain I's link service: from the status (a half
# whose pid lives in d I), else (no "links" in the status) the domain's process running
# `link up NAME --foreground`; PID_FROM says which. Status 1 if there is none.
service_pid() {
  local i=$1 st pid cmd
  SVC_PID="" PID_FROM=""
  st=$(status_now 2>/dev/null) || st='{}'
  pid=$(half_in "$st" "$i" | jq -r '.pid // empty')
  if [ -n "$pid" ]; then
    SVC_PID=$pid PID_FROM=status
    return 0
  fi
  for pid in $(ip netns pids "$(ns "$i")" 2>/dev/null); do
    cmd=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || continue
    case $cmd in
      *" link up $LINK --foreground "*)
        alive "$pid" || continue
        SVC_PID=$pid PID_FROM="ip netns pids"
        return 0
        ;;
    esac
  done
  return 1
}

# log_file I: the service log of domain I's side.
log_file() {
  echo "/dev/shm/memloop-$REGION.wake/link-$LINK-net$(stat -L -c %i "/run/netns/$(ns "$1")").log"
}

# save_service_logs TAG: copies the sides' service logs into the case's directory (`link up`
# starts a new one, and the region's are gone after the run).
save_service_logs() {
  local i f
  for i in 0 1 2; do
    f=$(log_file "$i" 2>/dev/null) || continue
    [ -f "$f" ] && cp "$f" "$CASE_DIR/service-d$i.$1.log"
  done
  return 0
}

UPS=0
# link_up I: `memloop link up` in domain I with its side's addresses; it must succeed and print
# the interface's name, which must exist in the domain.
link_up() {
  local i=$1 out rc=0 err
  UPS=$((UPS + 1))
  err=$CASE_DIR/link-up-d$i.$UPS.err
  save_service_logs "before-up$UPS"
  log "link up in d$i"
  out=$(timeout -k 5 30 "$ML" domains exec "$i" --prefix "$PREFIX" -- \
    "$ML" link up "$LINK" --addr "$(addr4 "$i")/30" --addr6 "$(addr6 "$i")/64" \
    --region "$REGION" 2>"$err") || rc=$?
  [ "$rc" = 0 ] || fail "link up in d$i: exit status $rc: $(tail -n 3 "$err" | tr '\n' ' ')"
  [ "$out" = "$IFN" ] || fail "link up in d$i printed '$out', expected '$IFN'"
  ip netns exec "$(ns "$i")" ip link show dev "$IFN" >/dev/null 2>&1 ||
    fail "link up in d$i printed $IFN, but d$i has no such interface"
}

# link_down I: `memloop link down` in domain I; it must succeed, and the service must be gone
# when it returns.
link_down() {
  local i=$1 pid rc=0 err=$CASE_DIR/link-down-d$1.err
  service_pid "$i" || fail "link down in d$i: no service of link $LINK runs there"
  pid=$SVC_PID
  log "link down in d$i (service pid $pid)"
  timeout -k 5 30 "$ML" domains exec "$i" --prefix "$PREFIX" -- \
    "$ML" link down "$LINK" --region "$REGION" 2>"$err" || rc=$?
  [ "$rc" = 0 ] || fail "link down in d$i: exit status $rc: $(tail -n 3 "$err" | tr '\n' ' ')"
  ! alive "$pid" || fail "link down in d$i returned while its service (pid $pid) still runs"
}

# ensure_link: both sides up (starting those missing), carrier on both within 10 s.
ensure_link() {
  local i
  for i in 0 1; do
    service_pid "$i" || link_up "$i"
  done
  for i in 0 1; do
    wait_carrier "$i" 1 10 ||
      fail "d$i's $IFN has carrier '$(carrier "$i")' 10 s after both sides are up (want 1)"
  done
}

# ping_ok FROM ADDR [PING OPTIONS…]: 3 echo requests from domain FROM to ADDR, 3 replies. Sets
# RTT (average, ms).
ping_ok() {
  local from=$1 addr=$2 out rc=0
  shift 2
  out=$(timeout -k 2 15 "$ML" domains exec "$from" --prefix "$PREFIX" -- \
    ping "$@" -n -c 3 -i 0.2 -W 2 "$addr" 2>&1) || rc=$?
  printf '%s\n' "$out" >>"$CASE_DIR/ping.log"
  [ "$rc" = 0 ] || fail "ping $* d$from → $addr: exit status $rc: $(grep -E 'received|ping:|nreachable' <<<"$out" | tail -n 1)"
  grep -q ' 3 received' <<<"$out" || fail "ping $* d$from → $addr: $(grep received <<<"$out")"
  RTT=$(sed -n 's|^rtt [^=]*= [0-9.]*/\([0-9.]*\)/.*|\1|p' <<<"$out")
}

# bg NAME SECS I CMD…: CMD in domain I in the background, bounded; stdout in $CASE_DIR/NAME.out,
# stderr in NAME.err, the pid (of timeout(1)) in NAME.pid.
bg() {
  local name=$1 secs=$2 i=$3
  shift 3
  log "d$i: $* (background)"
  timeout -k 5 "$secs" "$ML" domains exec "$i" --prefix "$PREFIX" -- "$@" \
    >"$CASE_DIR/$name.out" 2>"$CASE_DIR/$name.err" &
  echo $! >"$CASE_DIR/$name.pid"
}

bg_pid() { cat "$CASE_DIR/$1.pid"; }

# bg_wait NAME SECS: waits for it to end; its exit status (124: still running after SECS).
bg_wait() {
  local pid n rc=0
  pid=$(bg_pid "$1")
  for ((n = 0; n < $2 * 10; n++)); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    return 124
  fi
  wait "$pid" || rc=$?
  return "$rc"
}

bg_stop() {
  local pid
  pid=$(bg_pid "$1")
  kill -TERM "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}

# wait_line NAME PATTERN SECS: until NAME.out has a line matching PATTERN; fails the case if NAME
# ends first or it takes longer.
wait_line() {
  local name=$1 pat=$2 secs=$3 n
  for ((n = 0; n < secs * 20; n++)); do
    grep -q "$pat" "$CASE_DIR/$name.out" 2>/dev/null && return 0
    kill -0 "$(bg_pid "$name")" 2>/dev/null ||
      fail "$name ended before printing '$pat': $(tail -n 3 "$CASE_DIR/$name.err" | tr '\n' ' ')"
    sleep 0.05
  done
  fail "$name printed no '$pat' in ${secs}s"
}

# wait_listen I PORT NAME: until something listens on PORT in domain I (NAME: the server).
wait_listen() {
  local i=$1 port=$2 name=$3 n
  for ((n = 0; n < 200; n++)); do
    [ -z "$(ip netns exec "$(ns "$i")" ss -Hln "sport = :$port" 2>/dev/null)" ] || return 0
    kill -0 "$(bg_pid "$name")" 2>/dev/null ||
      fail "$name ended before listening: $(tail -n 3 "$CASE_DIR/$name.err" "$CASE_DIR/$name.out" | tr '\n' ' ')"
    sleep 0.05
  done
  fail "$name not listening on port $port in d$i after 10 s"
}

gbits() { awk -v b="$1" 'BEGIN { printf "%.2f", b / 1e9 }'; }
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }

need_hc() {
  [ -n "$HC" ] || fail "${HC_ERR:-the Go program was not built}"
}

# ---------------------------------------------------------------------------------------------
# The cases.

case_ping() {
  ensure_link
  local b0 b1 h0 h1 i h me other ip6 a4 r f st inode
  b0=$(half 0)
  b1=$(half 1)
  ping_ok 0 "$(addr4 1)"
  r="v4 d0→d1 ${RTT}ms"
  ping_ok 1 "$(addr4 0)"
  r+=", d1→d0 ${RTT}ms"
  ping_ok 0 "$(addr6 1)" -6
  r+="; v6 d0→d1 ${RTT}ms"
  ping_ok 1 "$(addr6 0)" -6
  r+=", d1→d0 ${RTT}ms"
  note "ping rtt avg: $r"

  st=$(status_links) || exit 1
  h0=$(half_in "$st" 0)
  h1=$(half_in "$st" 1)
  for i in 0 1; do
    if [ "$i" = 0 ]; then me=$h0 other=$b0; else me=$h1 other=$b1; fi
    [ "$me" != null ] || fail "the status shows no live half in d$i: $(link_entry "$st")"
    [ "$(jq -r .carrier <<<"$me")" = true ] || fail "d$i's half: carrier $(jq -c .carrier <<<"$me"), want true"
    [ "$(jq -r .ifname <<<"$me")" = "$IFN" ] || fail "d$i's half: ifname $(jq -c .ifname <<<"$me"), want $IFN"
    [ "$(jq -r .mtu <<<"$me")" = 65535 ] || fail "d$i's half: mtu $(jq -c .mtu <<<"$me"), want 65535"
    a4=$(addr4 "$i")/30 ip6=$(addr6 "$i")/64
    [ "$(jq -r .ipv4 <<<"$me")" = "$a4" ] || fail "d$i's half: ipv4 $(jq -c .ipv4 <<<"$me"), want $a4"
    [ "$(jq -r .ipv6 <<<"$me")" = "$ip6" ] || fail "d$i's half: ipv6 $(jq -c .ipv6 <<<"$me"), want $ip6"
    for f in csum tso4; do
      jq -e --arg f "$f" '.offloads | index($f)' <<<"$me" >/dev/null ||
        fail "d$i's half: offloads $(jq -c .offloads <<<"$me") lack $f"
    done
    # 6 echo requests and 6 replies each way (more with IPv6 neighbour discovery, MLD).
    for f in tx_packets rx_packets; do
      [ "$(grew "$other" "$me" "$f")" -ge 12 ] ||
        fail "d$i's half: $f grew by $(grew "$other" "$me" "$f") over 12 pings each way (want ≥ 12): $(jq -c .counters <<<"$me")"
    done
    for f in tx_bytes rx_bytes; do
      [ "$(cnt "$me" "$f")" -gt 0 ] || fail "d$i's half: $f is $(cnt "$me" "$f")"
    done
    inode=$(stat -L -c %i "/run/netns/$(ns "$i")")
    [ -s "$(log_file "$i")" ] ||
      fail "no service log $(log_file "$i") for d$i (netns inode $inode)"
  done
  note "halves: d0 #$(jq .index <<<"$h0") pid $(jq .pid <<<"$h0") offloads $(jq -r '.offloads | join(",")' <<<"$h0"); d1 #$(jq .index <<<"$h1") pid $(jq .pid <<<"$h1")"
}

# iperf3_json NAME: checks iperf3's JSON in NAME.out (no "error").
iperf3_json() {
  jq -e . "$CASE_DIR/$1.out" >/dev/null 2>&1 ||
    fail "$1: no JSON from iperf3: $(tail -n 3 "$CASE_DIR/$1.out" "$CASE_DIR/$1.err" | tr '\n' ' ')"
  if jq -e '.error' "$CASE_DIR/$1.out" >/dev/null 2>&1; then
    fail "$1: iperf3: $(jq -r .error "$CASE_DIR/$1.out")"
  fi
}

case_iperf3_tcp() {
  ensure_link
  local port=5311 b0 b1 a0 a1 sent recvd bps retr rc=0 out=$CASE_DIR/client.out
  bg server 40 1 iperf3 -s -1 -B "$(addr4 1)" -p "$port"
  wait_listen 1 "$port" server
  b0=$(half 0)
  b1=$(half 1)
  log "d0: iperf3 -c $(addr4 1) -t 3 -J"
  timeout -k 5 30 "$ML" domains exec 0 --prefix "$PREFIX" -- \
    iperf3 -c "$(addr4 1)" -p "$port" -t 3 -J >"$out" 2>"$CASE_DIR/client.err" || rc=$?
  iperf3_json client
  [ "$rc" = 0 ] || fail "iperf3 client: exit status $rc"
  bg_wait server 10 || fail "iperf3 server: exit status $? ($(tail -n 2 "$CASE_DIR/server.err" | tr '\n' ' '))"
  a0=$(half 0)
  a1=$(half 1)
  sent=$(jq '.end.sum_sent.bytes' "$out")
  recvd=$(jq '.end.sum_received.bytes' "$out")
  bps=$(jq '.end.sum_received.bits_per_second' "$out")
  retr=$(jq '.end.sum_sent.retransmits // "?"' "$out")
  [ "$sent" -gt 0 ] || fail "iperf3 sent $sent bytes"
  note "TCP over the link: $(gbits "$bps") Gbit/s ($(mib "$recvd") MiB in 3 s, $retr retransmits)"
  # iperf3's receiver stops counting at the end of the test: allow 1 % less than sent.
  [ "$recvd" -le "$sent" ] && [ "$((recvd * 100))" -ge "$((sent * 99))" ] ||
    fail "iperf3: sum_received $recvd bytes, sum_sent $sent"
  [ "$recvd" = "$sent" ] || note "sum_received is $((sent - recvd)) bytes short of sum_sent"
  local rx tx
  rx=$(grew "$b1" "$a1" rx_bytes)
  tx=$(grew "$b0" "$a0" tx_bytes)
  [ "$rx" -ge "$recvd" ] || fail "d1's half: rx_bytes grew by $rx, less than the $recvd bytes iperf3 received"
  [ "$tx" -ge "$recvd" ] || fail "d0's half: tx_bytes grew by $tx, less than the $recvd bytes iperf3 received"
  note "link counters: d0 tx +$(mib "$tx") MiB, d1 rx +$(mib "$rx") MiB, drops_full d0 +$(grew "$b0" "$a0" drops_full)"

  # For comparison (not checked): the same over the bridge.
  if [ "${ML_LINK_BASELINE:-1}" != 0 ]; then
    port=5312 rc=0
    bg bserver 30 1 iperf3 -s -1 -B "$B1" -p "$port"
    wait_listen 1 "$port" bserver
    timeout -k 5 30 "$ML" domains exec 0 --prefix "$PREFIX" -- \
      iperf3 -c "$B1" -p "$port" -t 3 -J >"$CASE_DIR/bclient.out" 2>"$CASE_DIR/bclient.err" || rc=$?
    bg_wait bserver 10 || true
    if [ "$rc" = 0 ] && jq -e '.end.sum_received' "$CASE_DIR/bclient.out" >/dev/null 2>&1; then
      note "TCP over the bridge (veth): $(gbits "$(jq '.end.sum_received.bits_per_second' "$CASE_DIR/bclient.out")") Gbit/s"
    else
      note "TCP over the bridge: iperf3 failed (status $rc), no comparison"
    fi
  fi
}

# udp_rcvbuf_errors I: domain I's UDP RcvbufErrors (datagrams its sockets had no room for).
udp_rcvbuf_errors() {
  # shellcheck disable=SC2016 # an awk program
  ip netns exec "$(ns "$1")" awk '/^Udp:/ { if (!n) { for (i = 2; i <= NF; i++) if ($i == "RcvbufErrors") c = i; n = 1 } else print $c }' \
    /proc/net/snmp 2>/dev/null || echo 0
}

# tun_tx_dropped I: packets the kernel dropped in front of domain I's link device (its queue).
tun_tx_dropped() {
  ip netns exec "$(ns "$1")" cat "/sys/class/net/$IFN/statistics/tx_dropped" 2>/dev/null || echo 0
}

case_iperf3_udp() {
  ensure_link
  local port=5313 b0 b1 a0 a1 rc=0 out=$CASE_DIR/client.out pk lost recvd rx q0 e1
  bg server 30 1 iperf3 -s -1 -B "$(addr4 1)" -p "$port"
  wait_listen 1 "$port" server
  b0=$(half 0)
  b1=$(half 1)
  q0=$(tun_tx_dropped 0)
  e1=$(udp_rcvbuf_errors 1)
  log "d0: iperf3 -c $(addr4 1) -u -b 500M -l 1400 -t 2 -J"
  timeout -k 5 30 "$ML" domains exec 0 --prefix "$PREFIX" -- \
    iperf3 -c "$(addr4 1)" -p "$port" -u -b 500M -l 1400 -t 2 -J >"$out" 2>"$CASE_DIR/client.err" || rc=$?
  iperf3_json client
  [ "$rc" = 0 ] || fail "iperf3 client: exit status $rc"
  bg_wait server 10 || fail "iperf3 server: exit status $? ($(tail -n 2 "$CASE_DIR/server.err" | tr '\n' ' '))"
  a0=$(half 0)
  a1=$(half 1)
  q0=$(($(tun_tx_dropped 0) - q0))
  e1=$(($(udp_rcvbuf_errors 1) - e1))
  # The receiver's numbers (iperf3 ≥ 3.?: sum_received; before: sum).
  pk=$(jq '(.end.sum_received // .end.sum).packets' "$out")
  lost=$(jq '(.end.sum_received // .end.sum).lost_packets' "$out")
  recvd=$(((pk - lost) * 1400))
  [ "$recvd" -gt 0 ] || fail "iperf3 -u: nothing received ($pk packets, $lost lost)"
  note "UDP over the link at 500M: $(gbits "$(jq '(.end.sum_received // .end.sum).bits_per_second' "$out")") Gbit/s received, loss $(jq '(.end.sum_received // .end.sum).lost_percent' "$out" | awk '{ printf "%.2f", $1 }') % ($lost of $pk datagrams)"
  rx=$(grew "$b1" "$a1" rx_bytes)
  [ "$rx" -ge "$recvd" ] || fail "d1's half: rx_bytes grew by $rx, less than the $recvd bytes iperf3 received"
  # Where the lost datagrams went (not checked: a 2-core machine runs two services and iperf3).
  note "losses: d0's queue to the device dropped $q0, d0's half tx_packets +$(grew "$b0" "$a0" tx_packets) drops_full +$(grew "$b0" "$a0" drops_full), d1's half rx_packets +$(grew "$b1" "$a1" rx_packets) (rx_bytes +$(mib "$rx") MiB) drops_bad +$(grew "$b1" "$a1" drops_bad), d1's UDP RcvbufErrors +$e1"
}

case_go_static_http() {
  need_hc
  local how port=8311 url b0 b1 a0 a1 rc=0 get=$((64 << 20)) put=$((16 << 20)) g
  if command -v file >/dev/null; then
    how=$(file -L "$HC")
    grep -q 'statically linked' <<<"$how" || fail "the Go program is not static: $how"
  else
    how=$(ldd "$HC" 2>&1 || true)
    grep -q 'not a dynamic executable' <<<"$how" || fail "the Go program is not static: $how"
  fi
  ensure_link
  bg server 80 1 "$HC" serve "$(addr4 1):$port"
  wait_line server '^listening' 10
  url=http://$(addr4 1):$port
  b0=$(half 0)
  b1=$(half 1)
  log "d0: httpcheck get $url 64M"
  timeout -k 5 30 "$ML" domains exec 0 --prefix "$PREFIX" -- \
    "$HC" get "$url" 64M >"$CASE_DIR/get.out" 2>"$CASE_DIR/get.err" || rc=$?
  [ "$rc" = 0 ] || fail "GET 64 MiB: exit status $rc: $(tail -n 2 "$CASE_DIR/get.err" | tr '\n' ' ')"
  log "d0: httpcheck post $url 16M"
  timeout -k 5 30 "$ML" domains exec 0 --prefix "$PREFIX" -- \
    "$HC" post "$url" 16M >"$CASE_DIR/post.out" 2>"$CASE_DIR/post.err" || rc=$?
  [ "$rc" = 0 ] || fail "POST 16 MiB: exit status $rc: $(tail -n 2 "$CASE_DIR/post.err" | tr '\n' ' ')"
  a0=$(half 0)
  a1=$(half 1)
  bg_stop server
  g=$(jq -r '"\(.mib_per_s | floor) MiB/s"' "$CASE_DIR/get.out")
  note "static Go: GET 64 MiB $g, POST 16 MiB $(jq -r '"\(.mib_per_s | floor) MiB/s"' "$CASE_DIR/post.out"), SHA-256 right"
  local x
  x=$(grew "$b1" "$a1" tx_bytes)
  [ "$x" -ge "$get" ] || fail "d1's half: tx_bytes grew by $x during a $get-byte GET"
  x=$(grew "$b0" "$a0" rx_bytes)
  [ "$x" -ge "$get" ] || fail "d0's half: rx_bytes grew by $x during a $get-byte GET"
  x=$(grew "$b0" "$a0" tx_bytes)
  [ "$x" -ge "$put" ] || fail "d0's half: tx_bytes grew by $x during a $put-byte POST"
  x=$(grew "$b1" "$a1" rx_bytes)
  [ "$x" -ge "$put" ] || fail "d1's half: rx_bytes grew by $x during a $put-byte POST"
}

# all_carriers_false STATUS: every half of our link in STATUS is null or has carrier false.
all_carriers_false() {
  jq -e --arg n "$LINK" \
    '[.links[] | select(.name == $n)][0].halves | map(select(. != null) | .carrier) | all(. == false)' \
    <<<"$1" >/dev/null 2>&1
}

case_carrier() {
  ensure_link
  local t0 drop st n seen h
  t0=$(now)
  link_down 1
  wait_carrier 0 0 3 || fail "d0's $IFN carrier is '$(carrier 0)' 3 s after link down in d1 (want 0)"
  drop=$(since "$t0")
  st=$(ip netns exec "$(ns 0)" ip link show dev "$IFN" 2>&1 || true)
  grep -q NO-CARRIER <<<"$st" || fail "ip link in d0 shows no NO-CARRIER: $(head -n 1 <<<"$st")"
  [ "$(carrier 1)" = gone ] || fail "d1 still has $IFN (carrier '$(carrier 1)') after link down"
  # The status: d1's half gone or without carrier, and d0's without carrier (within 3 s).
  for ((n = 0; n < 30; n++)); do
    st=$(status_links) || exit 1
    all_carriers_false "$st" && break
    sleep 0.1
  done
  all_carriers_false "$st" || fail "3 s after link down in d1 the status still shows a carrier: $(link_entry "$st")"
  h=$(half_in "$st" 0)
  [ "$h" != null ] || fail "after link down in d1, the status lost d0's half too: $(link_entry "$st")"
  # The text status lists a link with an empty half too (it once panicked on one).
  txt=$(timeout -k 2 10 "$ML" status --region "$REGION" 2>&1) || fail "status (text) failed with an empty half: $txt"
  grep -q "(no side)" <<<"$txt" || fail "status (text) does not show the empty half: $txt"
  seen=$(jq -r --arg n "$LINK" \
    '[.links[] | select(.name == $n)][0].halves | map(select(. != null)) | length' <<<"$st")
  link_up 1
  for n in 0 1; do
    wait_carrier "$n" 1 5 || fail "d$n's carrier is '$(carrier "$n")' 5 s after link up in d1 again"
  done
  note "carrier: d0's dropped ${drop}s after link down in d1 (halves left in the status: $seen); back ${WAITED}s after link up"
  ping_ok 0 "$(addr4 1)"
  ping_ok 1 "$(addr4 0)"
  for n in 0 1; do
    h=$(half "$n")
    [ "$(jq -r .carrier <<<"$h")" = true ] || fail "after link up again, d$n's half has carrier $(jq -c .carrier <<<"$h")"
  done
}

case_busy() {
  ensure_link
  local p0 p1 n rc=0 out err=$CASE_DIR/third.err
  service_pid 0 || fail "no service in d0"
  p0=$SVC_PID
  service_pid 1 || fail "no service in d1"
  p1=$SVC_PID
  log "d2: link up $LINK (a third side)"
  out=$(timeout -k 5 30 "$ML" domains exec 2 --prefix "$PREFIX" -- \
    "$ML" link up "$LINK" --addr "$(addr4 2)/30" --region "$REGION" 2>"$err") || rc=$?
  [ "$rc" != 0 ] || fail "a third link up of $LINK in d2 succeeded (printed '$out')"
  [ "$rc" != 124 ] && [ "$rc" != 137 ] || fail "a third link up of $LINK in d2 hung (killed after 30 s)"
  grep -qF "$LINK" "$err" ||
    fail "the third link up failed (status $rc) without naming link $LINK: $(head -c 300 "$err")"
  note "third side refused (status $rc): $(head -n 1 "$err" | cut -c 1-160)"
  [ "$(carrier 2)" = gone ] || fail "d2 has $IFN (carrier '$(carrier 2)') after its link up failed"
  local pid left=""
  sleep 0.2
  for pid in $(ip netns pids "$(ns 2)" 2>/dev/null); do
    left+=" $pid:$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null)"
  done
  [ -z "$left" ] || fail "processes left in d2 after the refused link up:$left"
  alive "$p0" && alive "$p1" || fail "a side's service died (pids $p0, $p1) when d2 tried to join"
  for n in 0 1; do
    [ "$(carrier "$n")" = 1 ] || fail "d$n's carrier is '$(carrier "$n")' after d2's attempt (want 1)"
  done
  ping_ok 0 "$(addr4 1)"
}

# progress_of NAME: the last byte count NAME (httpcheck send/recv) printed on stderr.
progress_of() {
  local v
  v=$(sed -n 's/^[a-z]*: \([0-9]*\) bytes$/\1/p' "$CASE_DIR/$1.err" 2>/dev/null | tail -n 1)
  echo "${v:-0}"
}

case_kill_restart() {
  need_hc
  ensure_link
  local port=5314 size=$((512 << 20)) rate=${ML_LINK_KILL_RATE:-128} b0 a0 h1 pid from newpid
  local t0 tk n got rs rr tx back drop stall
  b0=$(half 0)
  service_pid 1 || fail "cannot find d1's link service"
  pid=$SVC_PID from=$PID_FROM
  [ "$from" = status ] || note "d1's service pid found with ip netns pids (not in the status)"
  bg recv 120 1 "$HC" recv "$(addr4 1):$port"
  wait_line recv '^listening' 10
  t0=$(now)
  bg send 120 0 "$HC" send "$(addr4 1):$port" 512M "$rate"
  # About 1 s in, with at least 32 MiB across.
  for ((n = 0; n < 100; n++)); do
    got=$(progress_of recv)
    if [ "$got" -ge $((32 << 20)) ] && awk -v s="$(since "$t0")" 'BEGIN { exit !(s >= 1) }'; then
      break
    fi
    kill -0 "$(bg_pid send)" 2>/dev/null || break
    sleep 0.05
  done
  kill -0 "$(bg_pid send)" 2>/dev/null && kill -0 "$(bg_pid recv)" 2>/dev/null ||
    fail "the stream ended before the kill ($(progress_of recv) bytes received): send: $(tail -n 1 "$CASE_DIR/send.err"); recv: $(tail -n 1 "$CASE_DIR/recv.err")"
  [ "$got" -ge $((32 << 20)) ] || fail "the stream moved only $got bytes in $(since "$t0") s"
  tk=$(now)
  log "kill -9 $pid (d1's link service, $got bytes across)"
  kill -KILL "$pid"
  wait_carrier 0 0 3 || fail "d0's carrier is '$(carrier 0)' 3 s after d1's service was killed (want 0)"
  drop=$WAITED
  n=0
  while [ "$(carrier 1)" != gone ] && [ $n -lt 60 ]; do
    n=$((n + 1))
    sleep 0.05
  done
  [ "$(carrier 1)" = gone ] || fail "d1's $IFN (carrier '$(carrier 1)') outlived its service by 3 s"
  kill -0 "$(bg_pid recv)" 2>/dev/null || fail "the receiver ended when the link's service was killed: $(tail -n 2 "$CASE_DIR/recv.err" | tr '\n' ' ')"
  link_up 1
  for n in 0 1; do
    wait_carrier "$n" 1 5 || fail "d$n's carrier is '$(carrier "$n")' 5 s after link up in d1 again"
  done
  back=$(since "$tk")
  rs=0 rr=0
  bg_wait send 60 || rs=$?
  bg_wait recv 10 || rr=$?
  [ "$rs" != 124 ] || fail "the stream did not complete within 60 s of the restart ($(progress_of recv) of $size bytes received)"
  [ "$rr" = 0 ] || fail "receiver: exit status $rr: $(grep -v ' bytes$' "$CASE_DIR/recv.err" | tail -n 2 | tr '\n' ' ')"
  [ "$rs" = 0 ] || fail "sender: exit status $rs: $(grep -v ' bytes$' "$CASE_DIR/send.err" | tail -n 2 | tr '\n' ' ')"
  n=$(tail -n 1 "$CASE_DIR/recv.out" | jq -r '.bytes // empty' 2>/dev/null || true)
  [ "$n" = "$size" ] || fail "the receiver reports '$n' bytes, want $size: $(tail -n 1 "$CASE_DIR/recv.out")"
  # The receiver's progress lines come every 0.2 s: how long it got (next to) nothing.
  stall=$(awk '/^recv: [0-9]+ bytes$/ { if (NR > 1 && $2 - last < 1048576) s += 0.2; last = $2 }
    END { printf "%.1f", s }' "$CASE_DIR/recv.err")
  note "SIGKILL of d1's service after ≥ $(mib "$got") MiB: d0's carrier dropped in ${drop}s, link back ${back}s after the kill; the receiver stalled ~${stall}s; 512 MiB intact in $(since "$t0")s total"
  a0=$(half 0)
  h1=$(half 1)
  newpid=$(jq -r .pid <<<"$h1")
  [ "$newpid" != "$pid" ] || fail "d1's half still shows the killed pid $pid"
  [ "$(jq -r .carrier <<<"$h1")" = true ] || fail "d1's new half has carrier $(jq -c .carrier <<<"$h1")"
  [ "$(cnt "$a0" restarts)" -ge 2 ] && [ "$(grew "$b0" "$a0" restarts)" -ge 1 ] ||
    fail "d0's half: restarts $(cnt "$b0" restarts) → $(cnt "$a0" restarts) across the kill (want ≥ 2, +1)"
  tx=$(grew "$b0" "$a0" tx_bytes)
  [ "$tx" -ge "$size" ] || fail "d0's half: tx_bytes grew by $tx during a $size-byte stream"
  note "d0's half: restarts $(cnt "$b0" restarts) → $(cnt "$a0" restarts), tx_bytes +$(mib "$tx") MiB, drops_full +$(grew "$b0" "$a0" drops_full); d1's new half pid $newpid"
}

# ---------------------------------------------------------------------------------------------
# One case (internal): run.sh --case NAME, environment from the parent.

if [ "${1:-}" = --case ]; then
  set -E
  trap 'rc=$?; fail "line $LINENO: \`$BASH_COMMAND\` failed (status $rc)"' ERR
  fn=case_$2
  declare -F "$fn" >/dev/null || fail "no case $2"
  "$fn"
  exit 0
fi

# ---------------------------------------------------------------------------------------------
# The run.

usage() {
  sed -n '3,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
}

only="" keep=${ML_KEEP:-0}
while [ $# -gt 0 ]; do
  case $1 in
    --only) only=${2:?--only needs a value}; shift 2 ;;
    --only=*) only=${1#--only=}; shift ;;
    --keep) keep=1; shift ;;
    --list) printf '%s\n' "${ALL_CASES[@]}"; exit 0 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "run.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

cases=()
if [ -z "$only" ]; then
  cases=("${ALL_CASES[@]}")
else
  IFS=, read -ra wanted <<<"$only"
  for w in "${wanted[@]}"; do
    found=0
    for c in "${ALL_CASES[@]}"; do
      [ "$c" = "$w" ] && { cases+=("$c"); found=1; }
    done
    [ $found = 1 ] || { echo "run.sh: no case $w (see --list)" >&2; exit 2; }
  done
fi

[ "$(id -u)" = 0 ] || { echo "run.sh: needs root (network namespaces, TUN devices)" >&2; exit 2; }
missing=()
for t in ip jq iperf3 ping go timeout ss awk; do
  command -v "$t" >/dev/null 2>&1 || missing+=("$t")
done
[ ${#missing[@]} = 0 ] || { echo "run.sh: missing ${missing[*]} (tests/programs/install-deps.sh installs them)" >&2; exit 2; }
[ -e /dev/net/tun ] || { echo "run.sh: no /dev/net/tun" >&2; exit 2; }
ML=$(realpath "${MEMLOOP_BIN:-$ROOT/target/release/memloop}" 2>/dev/null) || ML=""
[ -n "$ML" ] && [ -x "$ML" ] || { echo "run.sh: no memloop binary (MEMLOOP_BIN=${MEMLOOP_BIN:-})" >&2; exit 2; }
"$ML" link --help >/dev/null 2>&1 || { echo "run.sh: $ML has no \`link\` command" >&2; exit 2; }

# Earlier runs that died without cleaning up: their domains, services and region.
for f in /run/netns/lk*-d0; do
  [ -e "$f" ] || continue
  p=${f#/run/netns/lk}
  p=${p%-d0}
  case $p in *[!0-9]* | "") continue ;; esac
  kill -0 "$p" 2>/dev/null && continue
  log "removing leftovers of run $p"
  for d in 0 1 2; do
    pids=$(ip netns pids "lk$p-d$d" 2>/dev/null | tr '\n' ' ')
    # shellcheck disable=SC2086 # a list of pids
    [ -z "${pids// /}" ] || kill -KILL $pids 2>/dev/null || true
  done
  "$ML" domains down --prefix "lk$p" >/dev/null 2>&1 || true
  "$ML" region destroy --region "lk$p" >/dev/null 2>&1 || true
  rm -rf "/dev/shm/memloop-lk$p" "/dev/shm/memloop-lk$p.wake"
done

PREFIX=lk$$ REGION=lk$$ LINK=lk$$
IFN=ml-$LINK
IFN=${IFN:0:15}
K=$(($$ % 250 + 1))
RUN_DIR=$(mktemp -d /tmp/memloop-link.XXXXXX)
export ML PREFIX REGION LINK IFN K RUN_DIR

# A /24 for the bridge that no interface uses yet (the programs suite takes 10.200-249.x, the
# domains tests 10.100-199.x).
pick_subnet() {
  local k a b used
  used=$(ip -4 -o addr show)
  for ((k = 0; k < 500; k++)); do
    a=$((60 + ($$ + k) % 30))
    b=$(((($$ + k) / 30) % 256))
    if ! grep -q " 10\.$a\.$b\." <<<"$used"; then
      echo "10.$a.$b"
      return 0
    fi
  done
  return 1
}
net=$(pick_subnet) || { echo "run.sh: no free 10.x.y.0/24" >&2; exit 2; }

failed=0 passed=0 case_pid=""
results=()

# Kills what a case left running in the domains, except the link's services.
kill_case_procs() {
  local d pid cmd
  for d in 0 1 2; do
    for pid in $(ip netns pids "$PREFIX-d$d" 2>/dev/null); do
      cmd=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || continue
      case $cmd in *" link up $LINK --foreground "*) continue ;; esac
      kill -KILL "$pid" 2>/dev/null || true
    done
  done
}

# What the region and the domains looked like (for a failed case).
diagnose() {
  local out=$1 d
  {
    echo "== memloop status --region $REGION --json"
    timeout 10 "$ML" status --region "$REGION" --json 2>&1
    for d in 0 1 2; do
      echo "== $PREFIX-d$d: ip -d -s link; ip addr; ip route; ss -tni; processes"
      ip netns exec "$PREFIX-d$d" ip -d -s link 2>&1
      ip netns exec "$PREFIX-d$d" ip addr 2>&1
      ip netns exec "$PREFIX-d$d" ip route 2>&1
      ip netns exec "$PREFIX-d$d" ss -tni 2>&1
      for p in $(ip netns pids "$PREFIX-d$d" 2>/dev/null); do
        echo "pid $p: $(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null)"
      done
    done
    echo "== service logs"
    for f in "/dev/shm/memloop-$REGION.wake"/link-*.log; do
      [ -e "$f" ] || continue
      echo "-- $f"
      tail -n 50 "$f"
    done
  } >"$out" 2>&1
}

cleanup() {
  local d pids f rc=$?
  set +e
  [ -z "$case_pid" ] || { kill -TERM "$case_pid" 2>/dev/null; wait "$case_pid" 2>/dev/null; }
  if [ -d "/dev/shm/memloop-$REGION.wake" ]; then
    mkdir -p "$RUN_DIR/service-logs"
    cp /dev/shm/memloop-"$REGION".wake/link-*.log "$RUN_DIR/service-logs/" 2>/dev/null || true
  fi
  # The sides' services first (SIGTERM: they take their devices down and leave the table), then
  # whatever is left in the domains.
  for d in 0 1 2; do
    for f in $(ip netns pids "$PREFIX-d$d" 2>/dev/null); do kill -TERM "$f" 2>/dev/null || true; done
  done
  sleep 0.3
  for d in 0 1 2; do
    pids=$(ip netns pids "$PREFIX-d$d" 2>/dev/null | tr '\n' ' ')
    # shellcheck disable=SC2086 # a list of pids
    [ -z "${pids// /}" ] || kill -KILL $pids 2>/dev/null || true
  done
  "$ML" domains down --prefix "$PREFIX" >/dev/null 2>&1 || log "domains down --prefix $PREFIX failed"
  "$ML" region destroy --region "$REGION" >/dev/null 2>&1 || log "region destroy --region $REGION failed"
  rm -rf "/dev/shm/memloop-$REGION" "/dev/shm/memloop-$REGION.wake"
  if [ "$keep" = 1 ] || [ "$failed" -gt 0 ] || [ "$rc" != 0 ]; then
    log "logs kept in $RUN_DIR"
  else
    rm -rf "$RUN_DIR"
  fi
}
trap cleanup EXIT
trap 'log "interrupted"; failed=$((failed + 1)); exit 130' INT TERM HUP

log "run directory $RUN_DIR"
"$ML" region create --region "$REGION" --size 64M >"$RUN_DIR/region.log" 2>&1 ||
  { cat "$RUN_DIR/region.log" >&2; echo "run.sh: cannot create region $REGION" >&2; failed=1; exit 2; }
"$ML" domains up 3 --prefix "$PREFIX" --subnet "$net.0/24" >"$RUN_DIR/domains.log" 2>&1 ||
  { cat "$RUN_DIR/domains.log" >&2; echo "run.sh: cannot create the domains" >&2; failed=1; exit 2; }
B0=$net.1 B1=$net.2
export B0 B1
log "domains $PREFIX-d0..2 on $net.0/24, region $REGION, link $LINK ($IFN): d0 $(addr4 0) $(addr6 0), d1 $(addr4 1) $(addr6 1)"

# The static Go program, when a case needs it.
HC="" HC_ERR=""
case " ${cases[*]} " in
  *" go_static_http "* | *" kill_restart "*)
    mkdir -p "$RUN_DIR/bin"
    # Without HOME (a bare environment) Go has no cache or module directory of its own.
    if [ -z "${HOME:-}" ]; then
      export GOCACHE=${GOCACHE:-/tmp/memloop-link-go/cache} GOPATH=${GOPATH:-/tmp/memloop-link-go/path}
    fi
    log "building go/httpcheck (CGO_ENABLED=0, $(go version | cut -d' ' -f3))"
    if (cd "$HERE/go/httpcheck" && CGO_ENABLED=0 GOTOOLCHAIN=local GOPROXY=off GOFLAGS='' \
      timeout 600 go build -trimpath -o "$RUN_DIR/bin/httpcheck" .) >"$RUN_DIR/go-build.log" 2>&1; then
      HC=$RUN_DIR/bin/httpcheck
    else
      HC_ERR="go build of go/httpcheck failed: $(tail -n 3 "$RUN_DIR/go-build.log" | tr '\n' ' ')"
      log "$HC_ERR"
    fi
    ;;
esac
export HC HC_ERR

t_start=$EPOCHREALTIME
for c in "${cases[@]}"; do
  CASE_DIR=$RUN_DIR/$c
  mkdir -p "$CASE_DIR"
  export CASE_DIR
  log "---- $c"
  t0=$EPOCHREALTIME
  rc=0
  limit=$(case_timeout "$c")
  # In the background so that a signal to run.sh is handled at once.
  timeout -k 10 "$limit" "$SELF" --case "$c" >"$CASE_DIR/case.log" 2>&1 &
  case_pid=$!
  wait "$case_pid" || rc=$?
  case_pid=""
  took=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
  verdict=PASS why=""
  if [ $rc = 124 ] || [ $rc = 137 ]; then
    verdict=FAIL why="timed out after ${limit}s"
  elif [ $rc != 0 ]; then
    verdict=FAIL
    why=$(cat "$CASE_DIR/reason" 2>/dev/null || echo "exit status $rc")
  fi
  [ ! -s "$CASE_DIR/note" ] || why="${why:+$why; }$(paste -sd'|' "$CASE_DIR/note" | sed 's/|/; /g')"
  if [ $verdict = PASS ]; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
    diagnose "$CASE_DIR/diagnosis.txt" || true
    sed 's/^/    | /' "$CASE_DIR/case.log" | tail -n 20 >&2
    log "$c: logs in $CASE_DIR (diagnosis.txt: status, devices, sockets, service logs)"
  fi
  kill_case_procs || true
  line=$(printf '%-4s %-15s %6ss  %s' "$verdict" "$c" "$took" "$why")
  echo "$line"
  results+=("$line")
done

total=$(awk -v a="$t_start" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
echo
echo "== memloop link across two domains: $passed passed, $failed failed (${total}s, logs: $([ "$failed" = 0 ] && [ "$keep" != 1 ] && echo removed || echo "$RUN_DIR"))"
printf '%s\n' "${results[@]}"
[ "$failed" = 0 ]
