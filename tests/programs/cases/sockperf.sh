# shellcheck shell=bash
# sockperf over TCP: ping-pong (latency; no message may be dropped, duplicated or reordered)
# and throughput, a couple of seconds each, small and large messages.

SOCKPERF_PORT=11111

start_sockperf() {
  start_server sockperf sockperf server --tcp -i "$ADDR0" -p $SOCKPERF_PORT
  wait_listen sockperf $SOCKPERF_PORT
}

# sockperf_out NAME: the client's output without colour codes.
sockperf_out() {
  sed 's/\x1b\[[0-9;]*m//g' "$CASE_DIR/$1.out" "$CASE_DIR/$1.err"
}

# sockperf_pingpong WHAT PORT SIZE [--tcp]: a 2 s ping-pong, checked: no error, nothing
# dropped, duplicated or reordered, every message answered; logs (and notes) the latency.
sockperf_pingpong() {
  local what=$1 port=$2 m=$3 out sent recvd lat
  shift 3
  # sockperf sizes its sequence table for 600 k round trips/s unless told the rate; the ring
  # goes faster than that ("_seqN > m_maxSequenceNo").
  run_client "pp$m" 30 sockperf ping-pong "$@" -i "$ADDR0" -p "$port" -t 2 -m "$m" --mps 20000000
  out=$(sockperf_out "pp$m")
  if grep -qiE 'error|fail' <<<"$out"; then
    fail "$what -m $m reported: $(grep -iE 'error|fail' <<<"$out" | head -n 3)"
  fi
  grep -q '# dropped messages = 0; # duplicated messages = 0; # out-of-order messages = 0' <<<"$out" ||
    fail "$what -m $m: $(grep 'dropped messages' <<<"$out")"
  sent=$(sed -n 's/.*\[Valid Duration\].*SentMessages=\([0-9]*\).*/\1/p' <<<"$out")
  recvd=$(sed -n 's/.*\[Valid Duration\].*ReceivedMessages=\([0-9]*\).*/\1/p' <<<"$out")
  lat=$(sed -n 's/.*Summary: Latency is \([0-9.]*\) usec.*/\1/p' <<<"$out")
  if [ "${sent:-0}" -le 0 ] || [ "$sent" != "$recvd" ]; then
    fail "$what -m $m: sent ${sent:-?}, received ${recvd:-?}"
  fi
  [ -n "$lat" ] || fail "$what -m $m: no latency summary"
  note "$what -m $m: $sent round trips, latency $lat us"
}

case_sockperf_pingpong() {
  local m
  start_sockperf
  for m in 64 16384; do
    sockperf_pingpong "sockperf ping-pong" $SOCKPERF_PORT $m --tcp
  done
  stop_server sockperf
}

case_sockperf_throughput() {
  local m out rate bw
  start_sockperf
  for m in 1400 16384; do
    run_client "tp$m" 30 sockperf throughput --tcp -i "$ADDR0" -p $SOCKPERF_PORT -t 2 -m $m
    out=$(sockperf_out "tp$m")
    if grep -qiE 'error|fail' <<<"$out"; then
      fail "sockperf throughput -m $m reported: $(grep -iE 'error|fail' <<<"$out" | head -n 3)"
    fi
    rate=$(sed -n 's/.*Summary: Message Rate is \([0-9]*\) \[msg\/sec\].*/\1/p' <<<"$out")
    bw=$(sed -n 's/.*Summary: BandWidth is \([0-9.]*\) MBps.*/\1/p' <<<"$out")
    [ "${rate:-0}" -gt 0 ] || fail "sockperf throughput -m $m: no message rate"
    [ -n "$bw" ] || fail "sockperf throughput -m $m: no bandwidth"
    log "sockperf throughput -m $m: $rate msg/s, $bw MB/s"
  done
  # The server is still there and answers after the throughput runs.
  server_alive sockperf || fail "sockperf server died"
  run_client after 30 sockperf ping-pong --tcp -i "$ADDR0" -p $SOCKPERF_PORT -t 1 -m 64 --mps 20000000
  stop_server sockperf
}
