#!/usr/bin/env python3
"""Did a region carry ring traffic? The ONE place that reads `memloop status --json`.

  ringcheck.py watch   --memloop BIN --region R --state FILE [--interval S]
      samples the status until killed (SIGTERM), remembering the most bytes seen per channel
      (channels disappear once both ends close, so a final look can miss them);
  ringcheck.py summary --memloop BIN --region R [--state FILE]
      prints what the region shows now merged with what the watcher saw (one JSON object);
  ringcheck.py ring     ... : exit 0 iff the region carried ring traffic (summary on stdout);
  ringcheck.py fallback ... : exit 0 iff it carried none (the connection used plain TCP);
  ringcheck.py orphans --memloop BIN --region R
      prints the channels (now) whose one side closed while the other still holds them, as
      JSON lines; exit 0 iff there are none.

Evidence of ring traffic: a channel (live now, or seen by the watcher) with bytes in either
direction. A future global counter of accelerated connections can be added in ring_evidence().

Reported, never required: `fallbacks` (reason -> count) and `connections` (records of the
connections the preload left on TCP, with their reason; the watcher keeps those it saw), and
for live path switching `switches` (reason -> count) and the records of connections that
switched from their ring to TCP (`switched_records_seen`, by reason; `switched_with_ring_bytes`:
those that had carried ring bytes first, i.e. switched mid-stream).
With --strict, the ring check also fails when the region recorded any fallback.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time

def status(memloop, region):
    out = subprocess.run([memloop, "status", "--region", region, "--json"],
                         capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"memloop status --region {region}: {out.stderr.strip()}")
    return json.loads(out.stdout)


def channel_bytes(st):
    """{(idx, gen): bytes both ways} for the channels in one status."""
    seen = {}
    for c in st.get("channels") or []:
        if c.get("marker"):  # a decline marker, not a connection
            continue
        b = (c.get("bytes_c2s") or 0) + (c.get("bytes_s2c") or 0)
        seen[f"{c.get('idx')}.{c.get('gen')}"] = b
    return seen


def fallback_records(st):
    """{(idx, gen): record} for the TCP-fallback connection records in one status."""
    conns = st.get("connections")
    if not isinstance(conns, list):
        return {}
    return {f"{c.get('idx')}.{c.get('gen')}": {"reason": c.get("reason"), "path": c.get("path"),
                                                "tuple": c.get("tuple"),
                                                "switched": c.get("switched"),
                                                "ring_bytes": c.get("ring_bytes") or 0}
            for c in conns if isinstance(c, dict)}


def fallback_counts(st):
    """{reason: count} of the non-zero fallback counters."""
    fb = st.get("fallbacks")
    if not isinstance(fb, dict):
        return {}
    return {k: v for k, v in fb.items() if isinstance(v, int) and v > 0}


def switch_counts(st):
    """{reason: count} of the non-zero switch counters (live path switching; a request is
    counted once per connection, by whoever asked first)."""
    sw = st.get("switches")
    if not isinstance(sw, dict):
        return {}
    return {k: v for k, v in sw.items() if isinstance(v, int) and v > 0}


def orphans(st):
    """Channels of one status one side of which closed while the other still holds them: once
    every client is gone and the server closed its connections, there must be none."""
    out = []
    for c in st.get("channels") or []:
        if c.get("marker") or c.get("state") != "accepted":
            continue
        if bool(c.get("client_closed")) != bool(c.get("server_closed")):
            out.append(c)
    return out


def ring_evidence(state):
    """Bytes seen on rings (the sum over channels of the most each one showed)."""
    return sum(state["channels"].values())


def merge(state, st):
    for k, b in channel_bytes(st).items():
        state["channels"][k] = max(state["channels"].get(k, 0), b)
    state.setdefault("fallback_records", {}).update(fallback_records(st))
    state["max_members"] = max(state.get("max_members", 0), len(st.get("members") or []))
    state["samples"] = state.get("samples", 0) + 1
    return state


def region_ring_bytes(st):
    """Bytes the region's rings carried: freed channels plus the live ones (status's
    `ring_bytes`, by name: counter indices move when the layout grows)."""
    v = st.get("ring_bytes")
    return v if isinstance(v, int) else 0


def new_state():
    return {"channels": {}, "fallback_records": {}, "max_members": 0, "samples": 0}


def load_state(path):
    if not path:
        return new_state()
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return new_state()


def watch(a):
    state = new_state()
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    while not stop:
        try:
            merge(state, status(a.memloop, a.region))
            with open(a.state + ".tmp", "w") as f:
                json.dump(state, f)
            # Atomic: the reader never sees half a file.
            os.replace(a.state + ".tmp", a.state)
        except Exception as e:  # the region may not exist yet, or be momentarily busy
            state["errors"] = state.get("errors", 0) + 1
            state["last_error"] = str(e)
        time.sleep(a.interval)


def summary(a):
    state = load_state(a.state)
    final = status(a.memloop, a.region)
    merge(state, final)
    # Channels are sampled: a transfer that starts and ends between two samples (iperf3 moves
    # 256 MB in ~15 ms on a ring) leaves no sample, but its bytes are in the region's
    # ring_bytes (added when the channel is freed, even if its processes were killed).
    ring_bytes = max(ring_evidence(state), region_ring_bytes(final))
    # Records of connections that fell back at set-up, and of ring connections that switched to
    # TCP mid-stream (live path switching: `switched` names the reason); the watcher keeps both.
    every = state.get("fallback_records", {}).values()
    records = [r for r in every if not r.get("switched")]
    switched = [r for r in every if r.get("switched")]
    reasons = {}
    for r in records:
        reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    switched_reasons = {}
    for r in switched:
        switched_reasons[r["switched"]] = switched_reasons.get(r["switched"], 0) + 1
    return {
        "region": a.region,
        "ring_used": ring_bytes > 0,
        "ring_bytes_seen": ring_bytes,
        "channels_seen": len(state["channels"]),
        "channels_with_bytes": sum(1 for b in state["channels"].values() if b > 0),
        "fallbacks": fallback_counts(final),
        "fallback_records_seen": len(records),
        "fallback_record_reasons": reasons,
        "switches": switch_counts(final),
        "switched_records_seen": len(switched),
        "switched_record_reasons": switched_reasons,
        "switched_with_ring_bytes": sum(1 for r in switched if r.get("ring_bytes", 0) > 0),
        "members_now": len(final.get("members") or []),
        "max_members_seen": state["max_members"],
        "samples": state["samples"],
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("cmd", choices=("watch", "summary", "ring", "fallback", "orphans"))
    p.add_argument("--memloop", required=True)
    p.add_argument("--region", required=True)
    p.add_argument("--state")
    p.add_argument("--interval", type=float, default=0.1)
    p.add_argument("--strict", action="store_true",
                   help="ring: also fail if the region recorded any fallback")
    a = p.parse_args()
    if a.cmd == "watch":
        if not a.state:
            p.error("watch needs --state")
        watch(a)
        return
    if a.cmd == "orphans":
        left = orphans(status(a.memloop, a.region))
        for c in left:
            print(json.dumps(c, sort_keys=True))
        sys.exit(1 if left else 0)
    s = summary(a)
    print(json.dumps(s, sort_keys=True))
    if a.cmd == "ring" and not s["ring_used"]:
        sys.exit(1)
    if a.cmd == "ring" and a.strict and (s["fallbacks"] or s["fallback_records_seen"]):
        sys.exit(1)
    if a.cmd == "fallback" and s["ring_used"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
