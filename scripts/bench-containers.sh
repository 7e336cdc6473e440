#!/usr/bin/env bash
# Two podman containers, side by side in one run: opted in to memloop by the annotation
# (`memloop container install`, `--annotation io.memloop.region=R`) against podman's own bridge
# network (the same containers, not annotated).
#   - request/response, 64 B, one connection back to back (`memloop bench probe --test rr`
#     against `memloop bench serve`): p50 round trip;
#   - redis-benchmark SET and GET (keep-alive clients) against redis-server: requests/s.
# Server container on CPU 1, client container on CPU 0; ROUNDS rounds (default 3), the order of
# the two paths alternating; medians; the memloop path must move ring bytes and the bridge path
# none. Writes OUT.md and OUT.json (default docs/results/bench-containers).
#   scripts/bench-containers.sh [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/results/bench-containers}
ROUNDS=${ROUNDS:-3}
M=$PWD/target/release/memloop
[ -x "$M" ] && [ -f target/release/libmemloop.so ] ||
  cargo build --release -p memloop-cli -p memloop-preload -p memloop-bench
command -v podman >/dev/null && command -v runc >/dev/null ||
  { apt-get update -qq && apt-get install -y -qq podman runc jq redis-tools redis-server >/dev/null; }

work=$(mktemp -d /tmp/memloop-bench-containers.XXXXXX)
R=ml-benchctr-$$
tag=mlb$$
. tests/containers/podman.sh
podman_bed "$work" "$R" "$tag"
# run PATH ARGS…: a container on PATH (memloop: annotated; podman: not).
run() {
  local path=$1
  shift
  local opt=()
  [ "$path" = memloop ] && opt=(--annotation "io.memloop.region=$R")
  podman run --hooks-dir "$work/hooks" "${opt[@]}" "$@" 2> >(quiet >&2)
}
ring_bytes() { "$M" status --json --region "$R" | jq '.ring_bytes'; }

declare -A ip
for path in memloop podman; do
  run "$path" -d --name "$tag-$path" --cpuset-cpus 1 --rootfs /:O /bin/sh -c \
    "redis-server --port 6390 --protected-mode no --save '' --appendonly no --daemonize yes &&
     exec $M bench serve --addr 0.0.0.0:7100" >/dev/null
  ip[$path]=$(podman inspect -f '{{.NetworkSettings.IPAddress}}' "$tag-$path")
done
sleep 1

client() { # PATH CMD…
  local path=$1
  shift
  run "$path" --rm --cpuset-cpus 0 --rootfs /:O "$@"
}
rr() { client "$1" "$M" bench probe --addr "${ip[$1]}:7100" --test rr --size 64 --secs 2 | jq '.p50_ns / 1000'; }
redis() { # PATH TEST → requests/s
  client "$1" redis-benchmark -h "${ip[$1]}" -p 6390 -n 100000 -c 8 -q -t "$2" --csv |
    tr -d '"' | awk -F, -v t="${2^^}" '$1 == t { print $2 }'
}

echo "round,path,rr_p50_us,set_rps,get_rps,ring_bytes" >"$work/rows.csv"
for ((i = 1; i <= ROUNDS; i++)); do
  order=(memloop podman)
  [ $((i % 2)) = 0 ] && order=(podman memloop)
  for path in "${order[@]}"; do
    before=$(ring_bytes)
    r=$(rr "$path")
    s=$(redis "$path" set)
    g=$(redis "$path" get)
    moved=$(($(ring_bytes) - before))
    echo "$i,$path,$r,$s,$g,$moved" | tee -a "$work/rows.csv" >&2
    if [ "$path" = memloop ] && [ "$moved" -le 0 ]; then
      echo "bench-containers: the memloop path moved no ring bytes" >&2
      exit 1
    fi
    if [ "$path" = podman ] && [ "$moved" != 0 ]; then
      echo "bench-containers: the bridge path moved $moved ring bytes" >&2
      exit 1
    fi
  done
done

python3 - "$work/rows.csv" "$OUT" "$ROUNDS" <<'EOF'
import csv, json, statistics, sys, datetime
rows = list(csv.DictReader(open(sys.argv[1])))
out, rounds = sys.argv[2], int(sys.argv[3])
med = {p: {k: statistics.median(float(r[k]) for r in rows if r["path"] == p)
           for k in ("rr_p50_us", "set_rps", "get_rps")} for p in ("memloop", "podman")}
ratio = {
    "rr_64B": med["podman"]["rr_p50_us"] / med["memloop"]["rr_p50_us"],
    "redis_set": med["memloop"]["set_rps"] / med["podman"]["set_rps"],
    "redis_get": med["memloop"]["get_rps"] / med["podman"]["get_rps"],
}
json.dump({"date": datetime.date.today().isoformat(), "rounds": rounds, "medians": med,
           "ratios": ratio, "rows": rows}, open(out + ".json", "w"), indent=2)
lines = [
    f"# memloop between two podman containers vs podman's bridge ({rounds} rounds, medians)",
    "",
    "Server container on CPU 1 (redis-server, `memloop bench serve`), client container on CPU 0;",
    "memloop: both annotated `io.memloop.region` (the OCI hook); podman: the same, not annotated.",
    "",
    "| figure | memloop | podman bridge | ratio | target |",
    "| --- | --- | --- | --- | --- |",
    f"| RR 64 B, p50 round trip (µs) | {med['memloop']['rr_p50_us']:.2f} | {med['podman']['rr_p50_us']:.1f} | {ratio['rr_64B']:.1f}× | ≥ 50× |",
    f"| redis-benchmark SET (req/s) | {med['memloop']['set_rps']:.0f} | {med['podman']['set_rps']:.0f} | {ratio['redis_set']:.2f}× | ≥ 2× |",
    f"| redis-benchmark GET (req/s) | {med['memloop']['get_rps']:.0f} | {med['podman']['get_rps']:.0f} | {ratio['redis_get']:.2f}× | ≥ 2× |",
]
open(out + ".md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
