# shellcheck shell=bash
# UDP programs: sockperf (UDP ping-pong: nothing dropped, duplicated or reordered; throughput),
# iperf3 -u (datagram and byte counts of both ends agree, loss reported), dnsmasq answering
# dig, an asyncio datagram server with many client sockets, and inetd starting in.tftpd.

# wait_udp NAME PORT [SECS]: until a UDP socket is bound to PORT in domain 0.
wait_udp() {
  local name=$1 port=$2 secs=${3:-20} i
  for ((i = 0; i < secs * 10; i++)); do
    ip netns exec "$NS0" ss -Hlun "sport = :$port" 2>/dev/null | grep -q . && return 0
    server_alive "$name" || { tail -n 30 "$CASE_DIR/$name.log" >&2; fail "server $name exited"; }
    sleep 0.1
  done
  fail "server $name not bound to UDP port $port after ${secs}s"
}

case_sockperf_udp_pingpong() {
  local port=11113 m
  start_server sockperf sockperf server -i "$ADDR0" -p $port
  wait_udp sockperf $port
  for m in 64 1472; do
    sockperf_pingpong "sockperf UDP ping-pong" $port $m
  done
  stop_server sockperf
}

case_sockperf_udp_throughput() {
  local port=11114 m out rate
  start_server sockperf sockperf server -i "$ADDR0" -p $port
  wait_udp sockperf $port
  for m in 1024 8192; do
    run_client "tp$m" 30 sockperf throughput -i "$ADDR0" -p $port -t 2 -m $m
    out=$(sockperf_out "tp$m")
    if grep -qiE 'error|fail' <<<"$out"; then
      fail "sockperf UDP throughput -m $m reported: $(grep -iE 'error|fail' <<<"$out" | head -n 3)"
    fi
    rate=$(sed -n 's/.*Summary: Message Rate is \([0-9]*\) \[msg\/sec\].*/\1/p' <<<"$out")
    [ "${rate:-0}" -gt 0 ] || fail "sockperf UDP throughput -m $m: no message rate"
    note "sockperf UDP throughput -m $m: $rate msg/s sent"
  done
  server_alive sockperf || fail "sockperf server died"
  run_client after 30 sockperf ping-pong -i "$ADDR0" -p $port -t 1 -m 64 --mps 20000000
  stop_server sockperf
}

case_iperf3_udp() {
  local port=5202 f=$CASE_DIR/u.out sp rp lost sb rb
  start_server iperf3 iperf3 -s -J -B "$ADDR0" -p $port
  wait_listen iperf3 $port
  run_client u 90 iperf3 -c "$ADDR0" -p $port -u -b 400M -l 1400 -n 50M --json --get-server-output
  stop_server iperf3
  jq -e 'has("error") | not' "$f" >/dev/null || fail "iperf3 -u: $(jq -r .error "$f")"
  jq -e '.server_output_json.end.sum' "$f" >/dev/null || fail "iperf3 -u: no server report"
  sp=$(jq '.end.sum.packets' "$f")
  rp=$(jq '.server_output_json.end.sum.packets' "$f")
  lost=$(jq '.server_output_json.end.sum.lost_packets' "$f")
  sb=$(jq '.end.sum.bytes' "$f")
  rb=$(jq '.server_output_json.end.sum.bytes' "$f")
  log "iperf3 -u: client sent $sp datagrams ($sb bytes); server: $rp datagrams, $lost lost, $rb bytes"
  [ "$sp" -gt 0 ] && [ "$sb" -ge $((50 << 20)) ] || fail "iperf3 -u: the client sent $sp datagrams, $sb bytes"
  # The server counts what arrived plus the gaps in the sequence numbers: every datagram the
  # client sent is one or the other (iperf3 stops counting at TEST_END: a few may be in flight).
  [ "$rp" -le "$sp" ] && [ $((sp - rp)) -le 64 ] || fail "iperf3 -u: server counted $rp of $sp datagrams"
  [ "$lost" -le "$rp" ] || fail "iperf3 -u: $lost lost of $rp"
  [ "$rb" -le "$sb" ] || fail "iperf3 -u: server received $rb > sent $sb bytes"
  note "iperf3 -u: $sp datagrams sent, $lost lost ($(jq '.server_output_json.end.sum.lost_percent | . * 100 | round / 100' "$f")%)"
}

case_dnsmasq_dig() {
  local port=5353 hosts=$CASE_DIR/hosts i out
  command -v dnsmasq >/dev/null || fail "dnsmasq is not installed"
  for ((i = 1; i <= 50; i++)); do printf '10.77.%d.%d host%d.memloop.test\n' $((i / 200)) $((i % 200 + 1)) "$i"; done >"$hosts"
  start_server dnsmasq dnsmasq -k -p $port --listen-address="$ADDR0" --bind-interfaces \
    --no-resolv --no-hosts --addn-hosts="$hosts" --log-facility=- --user=root
  wait_udp dnsmasq $port
  for ((i = 1; i <= 50; i++)); do printf 'host%d.memloop.test\n' "$i"; done >"$CASE_DIR/names"
  run_client dig 60 dig @"$ADDR0" -p $port +short +tries=1 +time=3 -f "$CASE_DIR/names"
  out=$(cat "$CASE_DIR/dig.out")
  for ((i = 1; i <= 50; i++)); do
    grep -qx "10.77.$((i / 200)).$((i % 200 + 1))" <<<"$out" || fail "dig: no answer for host$i"
  done
  [ "$(wc -l <<<"$out")" = 50 ] || fail "dig: $(wc -l <<<"$out") answers for 50 names"
  stop_server dnsmasq
  note "dnsmasq answered 50 names to dig"
}

case_python_udp_asyncio() {
  local port=7010
  start_server srv "$PY" "$HERE/py/udp_progs.py" asyncio-server --host "$ADDR0" --port $port --clients 8
  wait_udp srv $port
  run_client c 120 "$PY" "$HERE/py/udp_progs.py" client --host "$ADDR0" --port $port --clients 8 --count 500
  grep -q '^OK 8x500$' "$CASE_DIR/c.out" || fail "udp client: $(cat "$CASE_DIR/c.out")"
  wait_server srv
}

# inetd's 'wait' UDP service: openbsd-inetd sees a TFTP request on its socket, forks, and the
# child execs in.tftpd (without the library: inetd clears LD_PRELOAD) on the socket, which it
# reads as stdin. A request still in the socket's ring at the fork is handed back to the tftp
# client, which sends it again by the kernel: every transfer is intact and no request is ever
# sent twice (a retransmission would mean a request was lost).
case_inetd_tftp() {
  local port=6969 dir=$CASE_DIR/tftp i f n
  command -v inetd >/dev/null || fail "openbsd-inetd is not installed"
  [ -x /usr/sbin/in.tftpd ] || fail "tftpd-hpa is not installed"
  mkdir -p "$dir"
  chmod 755 "$CASE_DIR" "$dir"
  for n in 0 100 511 512 70000 1000000; do
    random_file "$dir/f$n" $n
  done
  chmod 644 "$dir"/f*
  printf '%s:%d dgram udp wait root /usr/sbin/in.tftpd in.tftpd -s %s -t 1\n' \
    "$ADDR0" $port "$dir" >"$CASE_DIR/inetd.conf"
  start_server inetd inetd -d "$CASE_DIR/inetd.conf"
  wait_udp inetd $port
  for i in 1 2; do
    for n in 0 100 511 512 70000 1000000; do
      f=$CASE_DIR/got-$i-$n
      printf 'binary\ntrace\nget f%d %s\nquit\n' $n "$f" >"$CASE_DIR/cmds"
      client_stdin "get$i-$n" 60 "$CASE_DIR/cmds" tftp "$ADDR0" $port
      cmp -s "$dir/f$n" "$f" || fail "tftp get f$n (round $i): the file differs ($(cat "$CASE_DIR/get$i-$n.out" | tail -n 3))"
      [ "$(grep -c 'sent RRQ' "$CASE_DIR/get$i-$n.out")" = 1 ] ||
        fail "tftp get f$n (round $i): the request was sent $(grep -c 'sent RRQ' "$CASE_DIR/get$i-$n.out") times"
    done
    sleep 1.5 # (in.tftpd exits after 1 s idle: the next round's requests go to inetd again)
  done
  stop_server inetd
  note "inetd + in.tftpd: 12 transfers intact, each request sent once"
}
