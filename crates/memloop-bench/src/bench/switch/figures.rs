//! The figures of `memloop bench switch`: what each path collected, its percentiles (also in
//! round trips of the slower path), the table and the lines on the targets.

use super::logs::Events;
use super::peer::{Outcome, PromoteOutcome};
use super::Path;
use crate::bench::pingpong::percentile;
use crate::bench::report::fmt_num;
use crate::bench::tcp::{MEMLOOP, MEMLOOP_LO, TCP_LO, VETH};
use serde::Serialize;
use serde_json::json;

/// What one path collected over its repetitions, in µs.
#[derive(Default)]
pub(super) struct Samples {
    rtt_before: Vec<f64>,
    rtt_after: Vec<f64>,
    /// Per variant (0 busy, 1 idle).
    cost: [Vec<f64>; 2],
    peer_done: [Vec<f64>; 2],
    peer_noticed: [Vec<f64>; 2],
    left: [Vec<f64>; 2],
    first_rtt: [Vec<f64>; 2],
    /// Busy, per receiving end (0 client, 1 server).
    stall: [Vec<f64>; 2],
    typical: [Vec<f64>; 2],
    before_max: [Vec<f64>; 2],
    /// Promotion: round trips after it (the ring again); per variant: trigger → this side
    /// back on the ring, → the peer back, → the driver saw the switch word quiet, the first
    /// round trip after.
    rtt_promoted: Vec<f64>,
    back: [Vec<f64>; 2],
    peer_back: [Vec<f64>; 2],
    word_quiet: [Vec<f64>; 2],
    p_first_rtt: [Vec<f64>; 2],
    /// Busy, per receiving end: the largest gap after the promotion's trigger, and the sum of
    /// the two stalls (demote + promote) of one repetition.
    p_stall: [Vec<f64>; 2],
    both_stall: [Vec<f64>; 2],
    /// Busy: streamed bytes and time, for the rate.
    bytes: u64,
    pub(super) switched: usize,
    pub(super) promoted: usize,
    pub(super) reps: usize,
}

impl Samples {
    /// One repetition's outcome (`busy` or idle) and what the log said about it.
    pub(super) fn add(&mut self, o: &Outcome, ev: Option<&Events>, busy: bool) {
        let k = usize::from(!busy);
        self.reps += 1;
        self.rtt_before.extend(o.rtt_before.iter().map(|&x| us(x)));
        self.rtt_after.extend(o.rtt_after.iter().map(|&x| us(x)));
        self.cost[k].push(us(o.cost_ns));
        if let Some(&first) = o.rtt_after.first() {
            self.first_rtt[k].push(us(first));
        }
        for (i, g) in [o.rx_client, o.rx_server].into_iter().enumerate() {
            let Some(g) = g else { continue };
            self.stall[i].push(us(g.after_max));
            self.typical[i].push(us(g.typical));
            self.before_max[i].push(us(g.before_max));
        }
        self.bytes += o.bytes_c2s + o.bytes_s2c;
        if let Some(p) = &o.promote {
            self.add_promote(o, p, k);
        }
        let Some(ev) = ev else { return };
        self.switched += usize::from(ev.switched);
        self.promoted += usize::from(ev.back.is_some());
        let put = |v: &mut [Vec<f64>; 2], x: Option<f64>| v[k].extend(x);
        put(&mut self.left, ev.left);
        put(&mut self.peer_noticed, ev.peer_noticed);
        put(&mut self.peer_done, ev.peer_done);
        put(&mut self.back, ev.back);
        put(&mut self.peer_back, ev.peer_back);
    }

    fn add_promote(&mut self, o: &Outcome, p: &PromoteOutcome, k: usize) {
        self.rtt_promoted.extend(p.rtt_after.iter().map(|&x| us(x)));
        if let Some(&first) = p.rtt_after.first() {
            self.p_first_rtt[k].push(us(first));
        }
        self.word_quiet[k].extend(p.done_ns.map(us));
        let demote = [o.rx_client, o.rx_server];
        for (i, g) in [p.rx_client, p.rx_server].into_iter().enumerate() {
            let Some(g) = g else { continue };
            self.p_stall[i].push(us(g.after_max));
            if let Some(d) = demote[i] {
                self.both_stall[i].push(us(d.after_max + g.after_max));
            }
        }
    }

    /// The per-repetition figures the JSON keeps (µs).
    pub(super) fn per_rep_json(&self) -> serde_json::Value {
        json!({
            "busy_cost": self.cost[0], "idle_cost": self.cost[1],
            "busy_peer_on_tcp": self.peer_done[0], "idle_peer_on_tcp": self.peer_done[1],
            "busy_stall_client_rx": self.stall[0], "busy_stall_server_rx": self.stall[1],
            "busy_promote_back": self.back[0], "idle_promote_back": self.back[1],
            "busy_promote_peer_back": self.peer_back[0], "idle_promote_peer_back": self.peer_back[1],
            "busy_promote_stall_client_rx": self.p_stall[0],
            "busy_promote_stall_server_rx": self.p_stall[1],
            "busy_demote_promote_stall_client_rx": self.both_stall[0],
            "busy_demote_promote_stall_server_rx": self.both_stall[1],
        })
    }
}

fn us(ns: u64) -> f64 {
    ns as f64 / 1e3
}

/// p50 and p99 of `v` (None if empty).
fn stats(v: &[f64]) -> Option<(f64, f64)> {
    if v.is_empty() {
        return None;
    }
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    Some((percentile(&v, 0.5), percentile(&v, 0.99)))
}

/// One figure of the report and the JSON.
#[derive(Serialize, Clone)]
pub(super) struct Figure {
    path: &'static str,
    variant: &'static str,
    metric: &'static str,
    unit: &'static str,
    n: usize,
    p50: f64,
    p99: f64,
    /// In round trips of the slower path (times only).
    #[serde(skip_serializing_if = "Option::is_none")]
    rtts_p50: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    rtts_p99: Option<f64>,
}

// Metric names, as in the table and the JSON.
const RTT_BEFORE: &str = "round trip before the switch";
const RTT_AFTER: &str = "round trip after the switch";
const COST: &str = "trigger → return (this side on TCP)";
const LEFT: &str = "trigger → this side left the ring";
const PEER_NOTICED: &str = "trigger → peer left the ring";
const PEER_DONE: &str = "trigger → peer on TCP";
const FIRST_RTT: &str = "first round trip after";
const RTT_PROMOTED: &str = "round trip after the promotion";
const BACK: &str = "promote: trigger → this side on the ring";
const PEER_BACK: &str = "promote: trigger → peer on the ring";
const WORD_QUIET: &str = "promote: trigger → switch word quiet (polled)";
const P_FIRST_RTT: &str = "promote: first round trip after";
const P_STALL: [&str; 2] = [
    "promote stall: largest gap after, client rx",
    "promote stall: largest gap after, server rx",
];
const BOTH_STALL: [&str; 2] = [
    "demote + promote stall (sum), client rx",
    "demote + promote stall (sum), server rx",
];
const STALL: [&str; 2] = [
    "stall: largest gap after, client rx",
    "stall: largest gap after, server rx",
];
const TYPICAL: [&str; 2] = [
    "median gap before, client rx",
    "median gap before, server rx",
];
const BEFORE_MAX: [&str; 2] = [
    "largest gap before, client rx",
    "largest gap before, server rx",
];

/// The slower path's median round trip on `p`: the larger of before and after.
pub(super) fn slower_rtt(s: &Samples) -> Option<f64> {
    let b = stats(&s.rtt_before)?.0;
    let a = stats(&s.rtt_after)?.0;
    Some(b.max(a))
}

pub(super) fn figures(paths: &[Path]) -> Vec<Figure> {
    let mut out = Vec::new();
    for p in paths.iter().filter(|p| p.unavailable.is_none()) {
        let s = &p.s;
        let rtt = slower_rtt(s);
        let mut put = |variant, metric, v: &[f64], in_rtts: bool| {
            let Some((p50, p99)) = stats(v) else { return };
            let r = rtt.filter(|&r| in_rtts && r > 0.0);
            out.push(Figure {
                path: p.def.name,
                variant,
                metric,
                unit: "us",
                n: v.len(),
                p50,
                p99,
                rtts_p50: r.map(|r| p50 / r),
                rtts_p99: r.map(|r| p99 / r),
            });
        };
        put("-", RTT_BEFORE, &s.rtt_before, false);
        put("-", RTT_AFTER, &s.rtt_after, false);
        put("-", RTT_PROMOTED, &s.rtt_promoted, false);
        for (k, variant) in ["busy", "idle"].into_iter().enumerate() {
            put(variant, LEFT, &s.left[k], true);
            put(variant, COST, &s.cost[k], true);
            put(variant, PEER_NOTICED, &s.peer_noticed[k], true);
            put(variant, PEER_DONE, &s.peer_done[k], true);
            put(variant, FIRST_RTT, &s.first_rtt[k], true);
            put(variant, BACK, &s.back[k], true);
            put(variant, PEER_BACK, &s.peer_back[k], true);
            put(variant, WORD_QUIET, &s.word_quiet[k], true);
            put(variant, P_FIRST_RTT, &s.p_first_rtt[k], true);
        }
        for end in 0..2 {
            put("busy", STALL[end], &s.stall[end], true);
            put("busy", TYPICAL[end], &s.typical[end], false);
            put("busy", BEFORE_MAX[end], &s.before_max[end], false);
            put("busy", P_STALL[end], &s.p_stall[end], true);
            put("busy", BOTH_STALL[end], &s.both_stall[end], true);
        }
    }
    out
}

/// The table: one row per (variant, metric, p50|p99), one column per path, then each memloop
/// path's figure in round trips of its slower path.
pub(super) fn table(figs: &[Figure]) -> String {
    let cols = [MEMLOOP_LO, TCP_LO, MEMLOOP, VETH];
    let mut head: Vec<String> = ["variant", "metric (µs)", "stat"].map(String::from).into();
    head.extend(cols.iter().map(|c| c.to_string()));
    head.extend([
        format!("{MEMLOOP_LO} in RTTs"),
        format!("{MEMLOOP} in RTTs"),
    ]);
    let mut lines = vec![head];
    let mut keys: Vec<(&str, &str)> = Vec::new();
    for f in figs {
        if !keys.contains(&(f.variant, f.metric)) {
            keys.push((f.variant, f.metric));
        }
    }
    for (variant, metric) in keys {
        for (q, stat) in [(false, "p50"), (true, "p99")] {
            let find = |path: &str| {
                figs.iter()
                    .find(|f| f.path == path && f.variant == variant && f.metric == metric)
            };
            let mut line: Vec<String> = vec![variant.into(), metric.into(), stat.into()];
            for c in cols {
                line.push(find(c).map_or("-".into(), |f| fmt_num(if q { f.p99 } else { f.p50 })));
            }
            for c in [MEMLOOP_LO, MEMLOOP] {
                let r = find(c).and_then(|f| if q { f.rtts_p99 } else { f.rtts_p50 });
                line.push(r.map_or("-".into(), |r| format!("{r:.2}")));
            }
            lines.push(line);
        }
    }
    crate::bench::report::align(&lines)
}

/// The targets this run speaks to.
pub(super) fn targets(figs: &[Figure], paths: &[Path]) -> Vec<String> {
    let mut out = Vec::new();
    let fig = |path: &str, variant: &str, metric: &str| {
        figs.iter()
            .find(|f| f.path == path && f.variant == variant && f.metric == metric)
    };
    for p in paths
        .iter()
        .filter(|p| p.def.preload && p.unavailable.is_none())
    {
        let name = p.def.name;
        let rtt = fmt_num(slower_rtt(&p.s).unwrap_or(0.0));
        let find = |variant: &str, metric: &str| fig(name, variant, metric);
        // The kernel path's own first round trip after the same pause or stream: what a round
        // trip costs in the state the switch starts from (after an idle pause both CPUs have
        // gone to sleep, and waking one costs more than a warm round trip).
        let control = if name == MEMLOOP_LO { TCP_LO } else { VETH };
        for variant in ["busy", "idle"] {
            let same = fig(control, variant, FIRST_RTT)
                .map(|f| f.p50)
                .filter(|&r| r > 0.0);
            let cost = |what: &str, this: &str, peer: &str, peer_what: &str, note: &str| {
                let c = find(variant, this)?;
                let d = find(variant, peer);
                let peer = d.map_or("peer not observed".into(), |d| {
                    format!("{peer_what} {} RTTs", rts(d))
                });
                let same = same.map_or(String::new(), |r| {
                    let p50 = |f: &Figure| format!("{:.2}", f.p50 / r);
                    format!(
                        "; p50 in {control}'s first round trips after the same {} ({} µs): \
                         this side {}, peer {}",
                        if variant == "idle" { "pause" } else { "stream" },
                        fmt_num(r),
                        p50(c),
                        d.map_or("-".into(), p50),
                    )
                });
                Some(format!(
                    "{name}, {variant}: a {what} {} RTTs (p50 / p99; slower path's RTT {rtt} µs), \
                     {peer} (target: ≤ 2){note}{same}",
                    rts(c)
                ))
            };
            out.extend(cost("demote costs", COST, PEER_DONE, "peer on TCP", ""));
            // Idle, neither program calls into the library: their heartbeats notice the request.
            let note = if variant == "idle" {
                "; idle, the request is noticed at the ends' heartbeats"
            } else {
                ""
            };
            out.extend(cost(
                "promote costs (this side back on the ring)",
                BACK,
                PEER_BACK,
                "peer back on the ring",
                note,
            ));
        }
        let worse_on = |path: &str, metrics: &[&str; 2]| -> Option<(f64, f64)> {
            let f: Vec<&Figure> = metrics
                .iter()
                .filter_map(|m| fig(path, "busy", m))
                .collect();
            let max = |q: fn(&Figure) -> f64| f.iter().map(|&x| q(x)).fold(0.0, f64::max);
            (!f.is_empty()).then(|| (max(|x| x.p50), max(|x| x.p99)))
        };
        let worse = |metrics: &[&str; 2]| worse_on(name, metrics);
        if let Some((p50, p99)) = worse(&STALL) {
            // The same window on the kernel path, where the trigger is a no-op: the gaps the
            // machine's scheduling makes anyway (a switch cannot be told apart below them).
            let floor = worse_on(control, &STALL).map_or(String::new(), |(c50, c99)| {
                format!(
                    "; {control}, no switch: {} / {} µs",
                    fmt_num(c50),
                    fmt_num(c99)
                )
            });
            out.push(format!(
                "{name}, busy: a demote alone stalls the stream {} µs at the median, {} µs at p99 \
                 (worse direction){floor}",
                fmt_num(p50),
                fmt_num(p99)
            ));
        }
        if let Some((p50, p99)) = worse(&BOTH_STALL) {
            out.push(format!(
                "{name}, busy: demote + promote stall the stream {} µs at the median, {} µs at \
                 p99 (worse direction; sum of the largest gaps after each trigger) (target: \
                 < 1000 µs)",
                fmt_num(p50),
                fmt_num(p99)
            ));
        }
    }
    out
}

/// A figure in round trips: "p50 / p99".
fn rts(f: &Figure) -> String {
    format!(
        "{:.2} / {:.2}",
        f.rtts_p50.unwrap_or(0.0),
        f.rtts_p99.unwrap_or(0.0)
    )
}
