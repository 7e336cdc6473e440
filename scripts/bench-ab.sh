#!/usr/bin/env bash
# Before/after benchmark in one sitting: runs the same `memloop bench` command with two builds,
# alternating them (ABBA) so a burst of noise on this shared machine cannot favour one, then
# prints each figure's median per build and the after/before ratio, with every run's value.
#
#   scripts/bench-ab.sh BEFORE_MEMLOOP AFTER_MEMLOOP ROUNDS -- tcp --quick
#   scripts/bench-ab.sh /tmp/old/memloop target/release/memloop 3 -- native --repeat 1
#
# Each build's `memloop` binary must have its `memloop-bench` (or built-in bench) and
# `libmemloop_preload.so` beside it, as `cargo build --release --workspace` leaves them.
set -euo pipefail
[ $# -ge 5 ] && [ "$4" = "--" ] || { sed -n '2,10p' "$0"; exit 2; }
before=$1 after=$2 rounds=$3
shift 4
out=$(mktemp -d /tmp/bench-ab.XXXXXX)
for r in $(seq 1 "$rounds"); do
  if [ $((r % 2)) = 1 ]; then order="before after"; else order="after before"; fi
  for w in $order; do
    bin=$before; [ "$w" = after ] && bin=$after
    "$bin" bench "$@" --json "$out/$w-$r.json" >"$out/$w-$r.txt" 2>&1 ||
      { echo "run $r of the $w build failed: $out/$w-$r.txt" >&2; exit 1; }
    echo "round $r: $w done" >&2
  done
done
python3 - "$out" "$rounds" <<'PY'
import json, statistics, sys
d, n = sys.argv[1], int(sys.argv[2])
def load(w):
    out = {}
    for r in range(1, n + 1):
        x = json.load(open(f"{d}/{w}-{r}.json"))
        for e in x["records"] if isinstance(x, dict) else x:
            out.setdefault((e["test"], e["path"], str(e["size"]), e["unit"]), []).append(e["value"])
    return out
b, a = load("before"), load("after")
print(f"{'test':9} {'path':13} {'size':>6} {'unit':8} {'before':>10} {'after':>10} {'a/b':>6}  runs before | after")
for k in sorted(b):
    if k not in a:
        continue
    mb, ma = statistics.median(b[k]), statistics.median(a[k])
    ratio = f"{ma / mb:6.2f}" if mb else "     -"
    runs = " ".join(f"{v:.3g}" for v in b[k]) + " | " + " ".join(f"{v:.3g}" for v in a[k])
    print(f"{k[0]:9} {k[1]:13} {k[2]:>6} {k[3]:8} {mb:10.4g} {ma:10.4g} {ratio}  {runs}")
PY
echo "raw results: $out" >&2
