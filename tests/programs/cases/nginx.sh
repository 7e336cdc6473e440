# shellcheck shell=bash
# curl against nginx: static files of several sizes on one keep-alive connection, with and
# without sendfile, checked by SHA-256.

case_nginx_curl() {
  nginx_curl "$ADDR0:8080" "$ADDR0" "$ADDR1"
}

# Over IPv6: nginx listening on [::] (IPv6 only), curl -6 to domain 0's IPv6 address.
case_nginx_curl6() {
  need_ipv6
  # (-g: the brackets of the address are no URL glob.)
  nginx_curl "[::]:8080" "[$ADDR0_6]" "$ADDR1_6" -6 -g
}

# nginx_curl LISTEN HOST CLIENT [CURL_OPTS...]: nginx on LISTEN, curl to http://HOST:8080/ from
# domain 1, whose address nginx must log as CLIENT.
nginx_curl() {
  local listen=$1 host=$2 client=$3
  shift 3
  local port=8080 www=$CASE_DIR/www got=$CASE_DIR/got conf=$CASE_DIR/nginx.conf
  local sizes=(0 1 1000 65536 1048576 3000000 $((8 << 20))) s args=() loc
  mkdir -p "$www" "$got" "$CASE_DIR/tmp"
  for s in "${sizes[@]}"; do random_file "$www/f$s" "$s"; done
  cat >"$conf" <<CONF
daemon off;
master_process on;
worker_processes 2;
user root;
pid $CASE_DIR/nginx.pid;
error_log $CASE_DIR/nginx-error.log info;
events { worker_connections 256; }
http {
  access_log $CASE_DIR/nginx-access.log;
  client_body_temp_path $CASE_DIR/tmp/body;
  proxy_temp_path $CASE_DIR/tmp/proxy;
  fastcgi_temp_path $CASE_DIR/tmp/fastcgi;
  uwsgi_temp_path $CASE_DIR/tmp/uwsgi;
  scgi_temp_path $CASE_DIR/tmp/scgi;
  default_type application/octet-stream;
  keepalive_requests 1000;
  sendfile on;
  tcp_nopush on;
  server {
    listen $listen;
    root $www;
    location /plain/ { alias $www/; sendfile off; }
  }
}
CONF
  start_server nginx nginx -c "$conf" -p "$CASE_DIR" -e "$CASE_DIR/nginx-error.log"
  wait_listen nginx $port
  # One curl, all files twice (sendfile, then read/write): every request after the first must
  # reuse the connection.
  for loc in "" plain/; do
    for s in "${sizes[@]}"; do
      args+=(-o "$got/${loc%/}f$s" "http://$host:$port/${loc}f$s")
    done
  done
  run_client curl 120 curl "$@" -sS --fail --http1.1 --max-time 100 \
    -w '%{http_code} %{size_download} %{num_connects} %{url_effective}\n' "${args[@]}"
  stop_server nginx
  local lines connects bad
  lines=$(wc -l <"$CASE_DIR/curl.out")
  [ "$lines" = $((2 * ${#sizes[@]})) ] || fail "curl reported $lines transfers, expected $((2 * ${#sizes[@]}))"
  bad=$(awk '$1 != 200' "$CASE_DIR/curl.out")
  [ -z "$bad" ] || fail "non-200 answers: $bad"
  connects=$(awk '{ n += $3 } END { print n }' "$CASE_DIR/curl.out")
  [ "$connects" = 1 ] || fail "curl opened $connects connections for one keep-alive session"
  for loc in "" plain; do
    for s in "${sizes[@]}"; do
      [ "$(sha256 "$got/${loc}f$s")" = "$(sha256 "$www/f$s")" ] ||
        fail "/${loc:+$loc/}f$s: content differs ($(stat -c %s "$got/${loc}f$s") of $s bytes)"
    done
  done
  # nginx logged each request from domain 1's address.
  bad=$(awk -v a="$client" '$1 != a' "$CASE_DIR/nginx-access.log" | head -n 3)
  [ -z "$bad" ] || fail "nginx saw other client addresses: $bad"
}
