# shellcheck shell=bash
# python3 standard-library programs: blocking sockets, selectors, asyncio, socket semantics,
# http.server + urllib.

PROGS=${HERE:?}/py/progs.py

# Every "accepted ADDR PORT" line of a server log must name domain 1's address.
check_peers() {
  local log=$1 want=$2 n bad
  n=$(grep -c '^accepted ' "$log" || true)
  [ "$n" -ge "$want" ] || fail "$log: $n connections accepted, expected $want"
  bad=$(grep '^accepted ' "$log" | awk -v a="$ADDR1" '$2 != a' | head -n 3)
  [ -z "$bad" ] || fail "server saw peer addresses other than $ADDR1: $bad"
}

# check_echo OUT CONNS BYTES: the echo client's JSON says all CONNS connections got BYTES back.
check_echo() {
  local out=$1 conns=$2 bytes=$3
  jq -e --argjson c "$conns" --argjson b "$bytes" \
    '.ok and .conns == $c and .received_total == $c * $b and all(.results[]; .ok)' \
    "$out" >/dev/null || fail "echo result wrong: $(head -c 400 "$out")"
}

case_python_blocking() {
  local port=7001 bytes=$((8 << 20))
  start_server srv "$PY" "$PROGS" blocking-server --host "$ADDR0" --port $port --conns 2
  wait_listen srv $port
  # Two connections one after the other, 8 MiB each way, random-sized writes.
  run_client c1 120 "$PY" "$PROGS" echo-client --host "$ADDR0" --port $port --bytes $bytes --seed 1
  run_client c2 120 "$PY" "$PROGS" echo-client --host "$ADDR0" --port $port --bytes $bytes --seed 2
  wait_server srv
  check_echo "$CASE_DIR/c1.out" 1 $bytes
  check_echo "$CASE_DIR/c2.out" 1 $bytes
  check_peers "$CASE_DIR/srv.log" 2
  grep -q "^echoed $bytes\$" "$CASE_DIR/srv.log" || fail "server did not echo $bytes bytes"
}

case_python_selectors() {
  local port=7002 bytes=$((3 << 20)) conns=6
  start_server srv "$PY" "$PROGS" selectors-server --host "$ADDR0" --port $port --conns $conns
  wait_listen srv $port
  # Six concurrent connections multiplexed by one epoll loop.
  run_client c 120 "$PY" "$PROGS" echo-client --host "$ADDR0" --port $port --bytes $bytes \
    --conns $conns --seed 10
  wait_server srv
  check_echo "$CASE_DIR/c.out" $conns $bytes
  check_peers "$CASE_DIR/srv.log" $conns
}

case_python_asyncio() {
  local port=7003 bytes=$((3 << 20)) conns=4
  start_server srv "$PY" "$PROGS" asyncio-server --host "$ADDR0" --port $port --conns $conns
  wait_listen srv $port
  run_client c 120 "$PY" "$PROGS" asyncio-client --host "$ADDR0" --port $port --bytes $bytes \
    --conns $conns --seed 20
  wait_server srv
  check_echo "$CASE_DIR/c.out" $conns $bytes
  check_peers "$CASE_DIR/srv.log" $conns
}

case_python_forking() {
  local port=7006 bytes=$((4 << 20)) conns=3
  # The parent accepts, a child serves, the parent closes its copy of the connection.
  start_server srv "$PY" "$PROGS" forking-server --host "$ADDR0" --port $port --conns $conns
  wait_listen srv $port
  run_client c 120 "$PY" "$PROGS" echo-client --host "$ADDR0" --port $port --bytes $bytes \
    --conns $conns --seed 30
  wait_server srv
  check_echo "$CASE_DIR/c.out" $conns $bytes
  check_peers "$CASE_DIR/srv.log" $conns
}

case_python_prefork() {
  local port=7007 bytes=$((2 << 20)) conns=4
  # Two forked workers accept on the listening socket they inherited.
  start_server srv "$PY" "$PROGS" prefork-server --host "$ADDR0" --port $port --conns $conns
  wait_listen srv $port
  run_client c 120 "$PY" "$PROGS" echo-client --host "$ADDR0" --port $port --bytes $bytes \
    --conns $conns --seed 40
  wait_server srv
  check_echo "$CASE_DIR/c.out" $conns $bytes
  check_peers "$CASE_DIR/srv.log" $conns
}

case_python_sockopts() {
  local port=7004 file=$CASE_DIR/sendfile.bin
  random_file "$file" $((2 << 20))
  start_server srv "$PY" "$PROGS" sockopts-server --host "$ADDR0" --port $port --file "$file"
  wait_listen srv $port
  run_client c 60 "$PY" "$PROGS" sockopts-client --host "$ADDR0" --port $port --file "$file"
  wait_server srv
  jq -e '.ok' "$CASE_DIR/c.out" >/dev/null || fail "socket semantics: $(cat "$CASE_DIR/c.out")"
  check_peers "$CASE_DIR/srv.log" 1
}

case_python_http() {
  local port=7005 www=$CASE_DIR/www args=() s f
  mkdir -p "$www"
  for s in 0 1 4096 100000 1048576 $((6 << 20)); do
    f=file-$s.bin
    random_file "$www/$f" "$s"
    args+=("$f=$(sha256 "$www/$f")")
  done
  # The standard library's own server, unmodified, speaking HTTP/1.1 (keep-alive).
  start_server srv "$PY" -m http.server --bind "$ADDR0" --directory "$www" -p HTTP/1.1 $port
  wait_listen srv $port
  # urllib: a connection per file; http.client: all files twice on one connection, which then
  # idles for a moment before closing.
  run_client get 120 "$PY" "$PROGS" http-get --base "http://$ADDR0:$port" "${args[@]}"
  run_client keepalive 120 "$PY" "$PROGS" http-keepalive --base "http://$ADDR0:$port" \
    --hold 0.5 "${args[@]}"
  stop_server srv
  jq -e '.ok' "$CASE_DIR/get.out" >/dev/null || fail "urllib: $(cat "$CASE_DIR/get.out")"
  jq -e '.ok' "$CASE_DIR/keepalive.out" >/dev/null ||
    fail "keep-alive: $(cat "$CASE_DIR/keepalive.out")"
  # The server logged every GET, from domain 1's address.
  [ "$(grep -c "^$ADDR1 - - .*\"GET /file-[0-9]*.bin HTTP/1.1\" 200" "$CASE_DIR/srv.log")" = $((3 * ${#args[@]})) ] ||
    fail "server log lacks GETs from $ADDR1: $(tail -n 3 "$CASE_DIR/srv.log")"
}
