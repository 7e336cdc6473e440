# shellcheck shell=bash
# PostgreSQL: a fresh cluster (initdb in the case directory) whose postgres runs as user
# postgres and listens on domain 0's address; psql and pgbench connect from domain 1 over TCP.

PG_PORT=5432

pg_bin() {
  local d
  d=$(find /usr/lib/postgresql -maxdepth 2 -name bin -type d 2>/dev/null | sort -V | tail -n 1)
  [ -x "$d/postgres" ] || fail "no PostgreSQL server under /usr/lib/postgresql"
  echo "$d"
}

as_postgres() {
  setpriv --reuid=postgres --regid=postgres --init-groups -- "$@"
}

start_postgres() {
  local bin pg=$CASE_DIR/pg i
  bin=$(pg_bin)
  install -d -o postgres -g postgres -m 700 "$pg" "$pg/sock"
  as_postgres "$bin/initdb" -D "$pg/data" -U postgres --auth=trust -E UTF8 --no-sync \
    >"$CASE_DIR/initdb.log" 2>&1 || { tail -n 20 "$CASE_DIR/initdb.log" >&2; fail "initdb failed"; }
  echo "host all all $SUBNET trust" >>"$pg/data/pg_hba.conf"
  [ -z "${SUBNET6:-}" ] || echo "host all all $SUBNET6 trust" >>"$pg/data/pg_hba.conf"
  start_server postgres setpriv --reuid=postgres --regid=postgres --init-groups -- \
    "$bin/postgres" -D "$pg/data" -p $PG_PORT -c listen_addresses="${PG_LISTEN:-$ADDR0}" \
    -c unix_socket_directories="$pg/sock" -c fsync=off -c synchronous_commit=off \
    -c full_page_writes=off -c max_connections=40 -c shared_buffers=64MB -c logging_collector=off
  wait_listen postgres $PG_PORT 30
  # Accepting connections (probed over the Unix socket: no TCP connection of our own).
  for ((i = 0; i < 100; i++)); do
    "$bin/pg_isready" -q -h "$pg/sock" -p $PG_PORT -U postgres && return 0
    sleep 0.2
  done
  fail "postgres not ready after 20s"
}

# psql_c NAME SQL...: psql over TCP from domain 1 (to PG_HOST, default domain 0's address),
# stopping at the first error.
psql_c() {
  local name=$1
  shift
  run_client "$name" 120 psql -X -q -A -t -v ON_ERROR_STOP=1 -h "${PG_HOST:-$ADDR0}" -p $PG_PORT \
    -U postgres -d postgres "$@"
}

# Over IPv6: postgres listening on domain 0's IPv6 address, psql from domain 1 — the addresses
# each end sees, and 40000 rows in and out again with \copy.
case_postgres_v6() {
  need_ipv6
  local d=$CASE_DIR
  PG_LISTEN=$ADDR0_6 start_postgres
  export PG_HOST=$ADDR0_6
  psql_c peer -c "SELECT inet_client_addr(), inet_server_addr()"
  [ "$(cat "$d/peer.out")" = "$ADDR1_6|$ADDR0_6" ] || fail "client|server address: $(cat "$d/peer.out")"
  "$PY" - "$d/rows.csv" <<'PYEOF'
import random, sys
rng = random.Random(9)
with open(sys.argv[1], "w") as f:
    for i in range(1, 40001):
        f.write(f"{i},{rng.randbytes(rng.randint(1, 60)).hex()}\n")
PYEOF
  psql_c create -c "CREATE TABLE t (id int PRIMARY KEY, payload text NOT NULL)"
  psql_c copyin -c "\\copy t FROM '$d/rows.csv' CSV"
  psql_c copyout -c "\\copy (SELECT * FROM t ORDER BY id) TO '$d/rows-back.csv' CSV"
  [ "$(sha256 "$d/rows.csv")" = "$(sha256 "$d/rows-back.csv")" ] || fail "COPY round trip differs"
  stop_server postgres
}

case_postgres_psql() {
  local d=$CASE_DIR
  start_postgres
  psql_c version -c "SELECT version()"
  grep -q PostgreSQL "$d/version.out" || fail "SELECT version(): $(cat "$d/version.out")"
  psql_c peer -c "SELECT inet_client_addr(), inet_server_addr()"
  [ "$(cat "$d/peer.out")" = "$ADDR1|$ADDR0" ] || fail "client|server address: $(cat "$d/peer.out")"

  # 40000 rows (~3 MB of CSV) in with \copy, out again ordered: byte-identical.
  "$PY" - "$d/rows.csv" >"$d/rows.expected" <<'PYEOF'
import random, sys
rng = random.Random(7)
total = 0
with open(sys.argv[1], "w") as f:
    for i in range(1, 40001):
        n = rng.randint(-10**12, 10**12)
        total += n
        f.write(f"{i},{rng.randbytes(rng.randint(1, 60)).hex()},{n}\n")
print(f"40000|{total}")
PYEOF
  psql_c create -c "CREATE TABLE t (id int PRIMARY KEY, payload text NOT NULL, n bigint)"
  psql_c copyin -c "\\copy t FROM '$d/rows.csv' CSV"
  psql_c copyout -c "\\copy (SELECT * FROM t ORDER BY id) TO '$d/rows-back.csv' CSV"
  [ "$(sha256 "$d/rows.csv")" = "$(sha256 "$d/rows-back.csv")" ] || fail "COPY round trip differs"
  psql_c count -c "SELECT count(*), sum(n) FROM t"
  [ "$(cat "$d/count.out")" = "$(cat "$d/rows.expected")" ] ||
    fail "count|sum: $(cat "$d/count.out"), expected $(cat "$d/rows.expected")"

  # A 4 MiB value through the wire both ways.
  head -c $((2 << 20)) /dev/urandom | od -An -vtx1 | tr -d ' \n' >"$d/big.txt"
  printf '1,%s\n' "$(cat "$d/big.txt")" >"$d/big.csv"
  psql_c bigtable -c "CREATE TABLE big (id int PRIMARY KEY, v text)"
  psql_c bigin -c "\\copy big FROM '$d/big.csv' CSV"
  psql_c bigmd5 -c "SELECT length(v), md5(v) FROM big"
  [ "$(cat "$d/bigmd5.out")" = "$((4 << 20))|$(md5sum <"$d/big.txt" | cut -d' ' -f1)" ] ||
    fail "big value: $(cat "$d/bigmd5.out")"
  psql_c bigout -c "SELECT v FROM big"
  [ "$(head -c $((4 << 20)) "$d/bigout.out" | sha256sum)" = "$(sha256sum <"$d/big.txt")" ] ||
    fail "big value read back differs"

  # Transactions and errors travel too: a rollback leaves nothing, an error reaches the client.
  psql_c rollback -c "BEGIN" -c "DELETE FROM t" -c "ROLLBACK" -c "SELECT count(*) FROM t"
  [ "$(cat "$d/rollback.out")" = 40000 ] || fail "after ROLLBACK: $(cat "$d/rollback.out") rows"
  if run_client_may_fail divzero psql -X -v ON_ERROR_STOP=1 -h "$ADDR0" -p $PG_PORT -U postgres \
    -d postgres -c "SELECT 1/0"; then
    fail "SELECT 1/0 succeeded"
  fi
  grep -q "division by zero" "$d/divzero.err" || fail "no division-by-zero error: $(cat "$d/divzero.err")"
  # The connection-per-statement pattern: 50 short sessions.
  local i
  for ((i = 0; i < 50; i++)); do echo "SELECT $i;"; done >"$d/many.sql"
  psql_c many -f "$d/many.sql"
  [ "$(wc -l <"$d/many.out")" = 50 ] || fail "50 SELECTs gave $(wc -l <"$d/many.out") rows"
  stop_server postgres
}

# run_client_may_fail NAME CMD...: as run_client, but returns CMD's status instead of failing.
run_client_may_fail() {
  local name=$1 rc=0
  shift
  dom_cmd 1 "$CLI_REGION"
  timeout -k 5 60 "${DOM[@]}" "$@" >"$CASE_DIR/$name.out" 2>"$CASE_DIR/$name.err" || rc=$?
  [ $rc != 124 ] || fail "client $name timed out"
  return $rc
}

case_postgres_pgbench() {
  local d=$CASE_DIR f
  start_postgres
  run_client init 120 pgbench -i -s 2 -h "$ADDR0" -p $PG_PORT -U postgres postgres
  grep -q "done in" "$d/init.err" "$d/init.out" || fail "pgbench -i: $(tail -n 3 "$d/init.err")"
  # TPC-B-like read/write with four clients, then select-only with prepared statements.
  run_client rw 60 pgbench -c 4 -j 2 -T 5 -h "$ADDR0" -p $PG_PORT -U postgres postgres
  run_client ro 60 pgbench -c 4 -j 2 -T 3 -S -M prepared -h "$ADDR0" -p $PG_PORT -U postgres postgres
  for f in rw ro; do
    local n failed tps
    n=$(sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p' "$d/$f.out")
    failed=$(sed -n 's/^number of failed transactions: \([0-9]*\).*/\1/p' "$d/$f.out")
    tps=$(sed -n 's/^tps = \([0-9.]*\).*/\1/p' "$d/$f.out")
    [ "${n:-0}" -gt 0 ] || fail "pgbench $f: no transactions: $(tail -n 5 "$d/$f.out")"
    [ "${failed:-x}" = 0 ] || fail "pgbench $f: ${failed:-?} failed transactions"
    log "pgbench $f: $n transactions, 0 failed, tps $tps"
  done
  # The accounts table holds what pgbench -i -s 2 wrote.
  psql_c accounts -c "SELECT count(*) FROM pgbench_accounts"
  [ "$(cat "$d/accounts.out")" = 200000 ] || fail "pgbench_accounts has $(cat "$d/accounts.out") rows"
  stop_server postgres
}

# pgb NAME ARGS...: one pgbench run from domain 1; fails the case unless pgbench exits 0, reports
# transactions and 0 failed ones, and printed no error (an aborted client, a lost connection, a
# protocol or SQL error). Sets PGB_N to the transactions processed.
pgb() {
  local name=$1 f failed tps bad
  shift
  run_client "$name" 120 pgbench -h "$ADDR0" -p $PG_PORT -U postgres "$@" postgres
  f=$CASE_DIR/$name
  if bad=$(grep -Ei -m 3 'error|abort|fatal|could not|terminat|lost|unexpected' "$f.err" "$f.out"); then
    fail "pgbench $name: $bad"
  fi
  PGB_N=$(sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p' "$f.out")
  failed=$(sed -n 's/^number of failed transactions: \([0-9]*\).*/\1/p' "$f.out")
  tps=$(sed -n 's/^tps = \([0-9.]*\).*/\1/p' "$f.out")
  [ "${PGB_N:-0}" -gt 0 ] || fail "pgbench $name: no transactions: $(tail -n 5 "$f.out")"
  [ "${failed:-x}" = 0 ] || fail "pgbench $name: ${failed:-?} failed transactions"
  log "pgbench $name: $PGB_N transactions, 0 failed, tps $tps"
}

# pgbench while every ring connection of the region is demoted to TCP every 50 ms (lib.sh
# storm_start): the initial load (COPY) and long-lived clients are moved mid-stream, and with
# -C (a new connection, hence a new forked backend, per transaction) thousands of connections
# start on rings and are moved. Zero failed transactions, no error, and the TPC-B invariants
# hold afterwards: every balance change of every transaction arrived exactly once.
case_postgres_storm() {
  local d=$CASE_DIR total=0 rw=0
  start_postgres
  storm_start
  # The initial load (COPY of 200000 rows) with the storm too.
  run_client init 120 pgbench -i -s 2 -h "$ADDR0" -p $PG_PORT -U postgres postgres
  grep -q "done in" "$d/init.err" "$d/init.out" || fail "pgbench -i: $(tail -n 3 "$d/init.err")"
  # Eight clients on long-lived connections, TPC-B-like read/write. -n: no VACUUM before a run
  # (it would truncate pgbench_history, which the check below counts).
  pgb rw -n -c 8 -j 4 -T 8
  total=$((total + PGB_N)) rw=$((rw + PGB_N))
  # A new connection per transaction, read/write, then select-only with extended protocol.
  pgb rw-connect -n -C -c 8 -j 4 -T 10
  total=$((total + PGB_N)) rw=$((rw + PGB_N))
  pgb ro-connect -n -C -c 8 -j 4 -T 5 -S -M extended
  total=$((total + PGB_N))
  storm_stop

  # Every transaction's effects, once: each adds one history row and the same delta to one
  # account, one teller and one branch.
  psql_c invariants -c "SELECT (SELECT count(*) FROM pgbench_history),
      (SELECT sum(abalance) FROM pgbench_accounts) = (SELECT coalesce(sum(delta), 0) FROM pgbench_history)
      AND (SELECT sum(tbalance) FROM pgbench_tellers) = (SELECT coalesce(sum(delta), 0) FROM pgbench_history)
      AND (SELECT sum(bbalance) FROM pgbench_branches) = (SELECT coalesce(sum(delta), 0) FROM pgbench_history),
      (SELECT count(*) FROM pgbench_accounts)"
  [ "$(cat "$d/invariants.out")" = "$rw|t|200000" ] ||
    fail "history rows|balances agree|accounts: $(cat "$d/invariants.out"), expected $rw|t|200000"
  note "postgres: $total transactions ($rw read/write), 0 failed, 0 errors, balances agree"
  storm_check
  stop_server postgres
}

# postgres-late: the late ring for a server that forks a backend per connection and closes its
# copy (the backend must follow the connection's decline marker). A filler holds the region's
# ring memory (idle connections to a PING server in domain 0), pgbench's 4 keep-alive clients
# connect (they fall back: `region_full`), the filler lets go once they run; the connections
# come to their rings mid-run. 0 failed transactions, no error, the TPC-B invariants hold.
FILL_PORT=7011

case_postgres_late() {
  local d=$CASE_DIR i bpid rc=0 late pg=$CASE_DIR/pg
  start_postgres
  run_client init 120 pgbench -i -s 1 -h "$ADDR0" -p $PG_PORT -U postgres postgres
  start_server pong "$PY" "$HERE/py/filler.py" --serve "$ADDR0" $FILL_PORT
  wait_listen pong $FILL_PORT 20
  fill_region $FILL_PORT
  (pgb late -n -c 4 -j 2 -T 12) &
  bpid=$!
  # Release once the 4 backends serve (over the Unix socket: no TCP connection of our own).
  for ((i = 0; i < 100; i++)); do
    [ "$("$(pg_bin)/psql" -X -A -t -h "$pg/sock" -p $PG_PORT -U postgres -d postgres -c \
      "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' AND
       client_addr IS NOT NULL" 2>/dev/null)" = 4 ] && break
    sleep 0.1
  done
  sleep 1
  touch "$d/release"
  wait "$bpid" || rc=$?
  [ "$rc" = 0 ] || fail "pgbench under the late ring failed (status $rc)"
  grep -q released "$d/filler.out" || fail "the filler did not release: $(tail -n 3 "$d/filler.out")"
  psql_c invariants -c "SELECT (SELECT sum(abalance) FROM pgbench_accounts) =
      (SELECT coalesce(sum(delta), 0) FROM pgbench_history)"
  [ "$(cat "$d/invariants.out")" = t ] || fail "balances disagree with the history"
  late=$(late_rings)
  [ -z "$late" ] || [ "$late" -ge 4 ] || fail "$late of pgbench's 4 connections came to their rings late"
  note "postgres-late: ${late:-no (across regions)} late rings (forked backends), 0 failed transactions"
  stop_server pong
  stop_server postgres
}
