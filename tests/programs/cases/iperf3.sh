# shellcheck shell=bash
# iperf3: a fixed number of bytes each way (-n); both ends' counts compared (--json on both,
# the server's report fetched by the client with --get-server-output).
#
# iperf3 stops counting at the receiver when the sender's TEST_END arrives on the control
# connection, so bytes still buffered in flight at that moment are never counted: on plain TCP
# the receiver routinely reports megabytes less than was sent (socket buffers of several MB).
# Checked exactly: the sender's count (≥ -n), and that each side's JSON agrees with what the
# other side reports of it; checked with a slack: received ≤ sent ≤ received + ML_IPERF_SLACK.

case_iperf3() {
  local port=5201 d=$CASE_DIR slack=${ML_IPERF_SLACK:-$((32 << 20))}
  start_server iperf3 iperf3 -s -J -B "$ADDR0" -p $port
  wait_listen iperf3 $port
  # Client → server over two parallel streams, then server → client (-R).
  run_client fwd 90 iperf3 -c "$ADDR0" -p $port -n 256M -P 2 --json --get-server-output
  run_client rev 90 iperf3 -c "$ADDR0" -p $port -n 128M -R --json --get-server-output
  stop_server iperf3
  local f
  for f in fwd rev; do
    jq -e 'has("error") | not' "$d/$f.out" >/dev/null || fail "iperf3 $f: $(jq -r .error "$d/$f.out")"
    jq -e '.server_output_json.end' "$d/$f.out" >/dev/null || fail "iperf3 $f: no server report"
  done
  # fwd: the client sends, the server receives.
  iperf_check "$d/fwd.out" forward $((256 << 20)) "$slack" \
    .end.sum_sent.bytes .server_output_json.end.sum_received.bytes .end.sum_received.bytes
  # rev: the server sends, the client receives.
  iperf_check "$d/rev.out" reverse $((128 << 20)) "$slack" \
    .server_output_json.end.sum_sent.bytes .end.sum_received.bytes .end.sum_sent.bytes
  jq -r '"forward \(.end.sum_received.bits_per_second / 1e7 | round / 100) Gbit/s"' "$d/fwd.out" >&2
  jq -r '"reverse \(.end.sum_received.bits_per_second / 1e7 | round / 100) Gbit/s"' "$d/rev.out" >&2
}

# iperf_check FILE WHAT N SLACK SENT RECEIVED SENT_AS_REPORTED_TO_THE_OTHER_SIDE
iperf_check() {
  local f=$1 what=$2 n=$3 slack=$4 sent recv other
  sent=$(jq "$5" "$f")
  recv=$(jq "$6" "$f")
  other=$(jq "$7" "$f")
  log "iperf3 $what: sent $sent, received $recv (at least $n asked)"
  [ "$sent" -ge "$n" ] || fail "iperf3 $what: sender counted $sent bytes, fewer than -n $n"
  [ "$recv" -le "$sent" ] || fail "iperf3 $what: received $recv > sent $sent"
  [ $((sent - recv)) -le "$slack" ] || fail "iperf3 $what: received $recv of $sent (more than $slack short)"
  [ "$recv" -gt 0 ] || fail "iperf3 $what: nothing received"
  # The two reports of the same end agree exactly.
  if [ "$what" = forward ]; then
    [ "$other" = "$recv" ] || fail "iperf3 $what: server counted $recv, told the client $other"
  else
    [ "$other" = "$sent" ] || fail "iperf3 $what: server sent $sent, told the client $other"
  fi
}
