//! `memloop bench tcp` results as tables: the paths side by side with ratios, the preload's cost
//! on traffic that cannot use a ring, and the brief's targets.

use super::{MEMLOOP, MEMLOOP6, MEMLOOP_LO, REMOTE, TCP_LO, UNIX, VETH, VETH6};
use crate::bench::report::{fmt_num, Record};
use crate::units::fmt_size;
use serde::Serialize;

// Units, as in the JSON records.
/// Round-trip time, µs (p50 in `value`, p99 in `p99`).
pub const RTT: &str = "rtt_us";
/// Request/response transactions per second.
pub const TPS: &str = "trans/s";
/// Short connections per second.
pub const CPS: &str = "conn/s";
/// Time of one short connection (connect, exchange, close), µs.
pub const CONN: &str = "conn_us";
pub const GBIT: &str = "Gbit/s";
pub const MSGS: &str = "msg/s";

/// Main table columns.
const COLUMNS: [&str; 7] = [MEMLOOP, VETH, MEMLOOP6, VETH6, MEMLOOP_LO, TCP_LO, UNIX];
/// Ratio columns: (heading, column of the memloop path, column of the baseline).
const RATIOS: [(&str, usize, usize); 4] = [
    ("memloop vs veth", 0, 1),
    ("memloop vs lo", 0, 5),
    ("memloop-lo vs lo", 4, 5),
    ("v6: memloop vs veth", 2, 3),
];

fn lower_is_better(unit: &str) -> bool {
    matches!(unit, RTT | CONN)
}

fn metric(unit: &str, p99: bool) -> String {
    let q = if p99 { " p99" } else { " p50" };
    match unit {
        RTT => format!("RTT µs{q}"),
        CONN => format!("µs/conn{q}"),
        u => u.to_string(),
    }
}

struct Row {
    test: &'static str,
    size: u64,
    metric: String,
    unit: &'static str,
    values: [Option<f64>; COLUMNS.len()],
}

fn rows(records: &[Record]) -> Vec<Row> {
    let mut rows: Vec<Row> = Vec::new();
    for r in records {
        let Some(col) = COLUMNS.iter().position(|p| *p == r.path) else {
            continue;
        };
        let mut put = |metric: String, v: f64| {
            let i = rows
                .iter()
                .position(|x| x.test == r.test && x.size == r.size && x.metric == metric)
                .unwrap_or_else(|| {
                    rows.push(Row {
                        test: r.test,
                        size: r.size,
                        metric,
                        unit: r.unit,
                        values: [None; COLUMNS.len()],
                    });
                    rows.len() - 1
                });
            rows[i].values[col] = Some(v);
        };
        match r.p99 {
            Some(p99) => {
                put(metric(r.unit, false), r.value);
                put(metric(r.unit, true), p99);
            }
            None => put(metric(r.unit, false), r.value),
        }
    }
    rows
}

/// How many times better `a` is than `b` (>1: `a` wins).
pub fn ratio(unit: &str, a: f64, b: f64) -> Option<f64> {
    (a > 0.0 && b > 0.0).then(|| if lower_is_better(unit) { b / a } else { a / b })
}

fn fmt_ratio(r: Option<f64>) -> String {
    match r {
        Some(r) if r >= 100.0 => format!("{r:.0}×"),
        Some(r) if r >= 10.0 => format!("{r:.1}×"),
        Some(r) => format!("{r:.2}×"),
        None => "-".into(),
    }
}

pub fn main_table(records: &[Record]) -> String {
    let mut head: Vec<String> = ["test", "size", "metric"].map(String::from).into();
    head.extend(COLUMNS.map(String::from));
    head.extend(RATIOS.map(|r| r.0.to_string()));
    let mut lines = vec![head];
    for row in rows(records) {
        let mut line = vec![row.test.to_string(), fmt_size(row.size), row.metric.clone()];
        line.extend(row.values.iter().map(|v| v.map_or("n/a".into(), fmt_num)));
        for (_, a, b) in RATIOS {
            let r = row.values[a]
                .zip(row.values[b])
                .and_then(|(a, b)| ratio(row.unit, a, b));
            line.push(fmt_ratio(r));
        }
        lines.push(line);
    }
    align(&lines, 3)
}

/// Left-aligns the first `left` columns and right-aligns the rest.
fn align(lines: &[Vec<String>], left: usize) -> String {
    let ncol = lines[0].len();
    let widths: Vec<usize> = (0..ncol)
        .map(|c| {
            lines
                .iter()
                .map(|l| l[c].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for l in lines {
        let cells: Vec<String> = l
            .iter()
            .enumerate()
            .map(|(c, s)| {
                if c < left {
                    format!("{s:<w$}", w = widths[c])
                } else {
                    format!("{s:>w$}", w = widths[c])
                }
            })
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}

// ---------------------------------------------------------------------------------------------
// The preload's cost on traffic that cannot use a ring.

/// One veth+bridge, veth+preload, veth+bridge triple of runs (the records of each).
pub struct Triple {
    pub a1: Vec<Record>,
    pub b: Vec<Record>,
    pub a2: Vec<Record>,
}

#[derive(Serialize, Clone, Debug)]
pub struct RemoteRow {
    pub test: &'static str,
    pub size: u64,
    pub metric: String,
    /// veth+bridge without the preload (median over the triples' plain runs).
    pub plain: f64,
    /// veth+bridge with the preload on both ends, no ring (median).
    pub preload: f64,
    /// How much worse the preload makes it, % (negative: better): the median over the triples
    /// of the preloaded run against the mean of its two plain neighbours.
    pub cost_pct: f64,
    /// The noise floor, %: the median difference between the two plain runs of a triple.
    pub noise_pct: f64,
    /// Number of triples.
    pub triples: usize,
    /// The brief's limit on `cost_pct`.
    pub target_pct: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn remote_rows(triples: &[Triple]) -> Vec<RemoteRow> {
    let metrics = [
        ("rr", RTT, false, 2.0),
        ("rr", RTT, true, 2.0),
        ("rr", TPS, false, 2.0),
        ("stream", GBIT, false, 1.0),
        ("udp-rr", RTT, false, 2.0),
        ("udp-rr", RTT, true, 2.0),
    ];
    let mut out = Vec::new();
    for (test, unit, p99, target) in metrics {
        let pick = |recs: &[Record]| {
            let r = recs.iter().find(|r| r.test == test && r.unit == unit)?;
            if p99 {
                r.p99
            } else {
                Some(r.value)
            }
        };
        // Relative cost of `b` against `a`, %.
        let cost = |a: f64, b: f64| {
            if lower_is_better(unit) {
                (b - a) / a * 100.0
            } else {
                (a - b) / a * 100.0
            }
        };
        let (mut plain, mut pre, mut costs, mut noise) = (vec![], vec![], vec![], vec![]);
        for t in triples {
            let (Some(a1), Some(b), Some(a2)) = (pick(&t.a1), pick(&t.b), pick(&t.a2)) else {
                continue;
            };
            if a1 <= 0.0 || a2 <= 0.0 {
                continue;
            }
            let a = (a1 + a2) / 2.0;
            plain.push(a);
            pre.push(b);
            costs.push(cost(a, b));
            noise.push(cost(a1, a2).abs());
        }
        if costs.is_empty() {
            continue;
        }
        out.push(RemoteRow {
            test,
            size: 64,
            metric: metric(unit, p99),
            triples: costs.len(),
            plain: median(plain),
            preload: median(pre),
            cost_pct: median(costs),
            noise_pct: median(noise),
            target_pct: target,
        });
    }
    out
}

pub fn remote_table(rows: &[RemoteRow]) -> String {
    let mut lines: Vec<Vec<String>> = vec![[
        "test", "size", "metric", VETH, REMOTE, "cost", "target", "noise",
    ]
    .map(String::from)
    .into()];
    for r in rows {
        lines.push(vec![
            r.test.to_string(),
            fmt_size(r.size),
            r.metric.clone(),
            fmt_num(r.plain),
            fmt_num(r.preload),
            format!("{:+.1}%", r.cost_pct),
            format!("≤ {:.0}%", r.target_pct),
            format!("±{:.1}%", r.noise_pct),
        ]);
    }
    align(&lines, 3)
}

// ---------------------------------------------------------------------------------------------
// Targets.

/// The brief's targets this run speaks to, one line each (only those with data).
pub fn targets(records: &[Record], remote: &[RemoteRow]) -> Vec<String> {
    let get = |path: &str, test: &str, size: u64, unit: &str| {
        records
            .iter()
            .find(|r| r.path == path && r.test == test && r.size == size && r.unit == unit)
    };
    let vs = |a: &str, b: &str, test: &str, size: u64, unit: &str, p99: bool| {
        let (x, y) = (get(a, test, size, unit)?, get(b, test, size, unit)?);
        let (x, y) = if p99 {
            (x.p99?, y.p99?)
        } else {
            (x.value, y.value)
        };
        ratio(unit, x, y)
    };
    let sizes = |test: &str| {
        let mut s: Vec<u64> = records
            .iter()
            .filter(|r| r.test == test && r.path == MEMLOOP)
            .map(|r| r.size)
            .collect();
        s.sort_unstable();
        s.dedup();
        s
    };
    let x = |r: Option<f64>| fmt_ratio(r);
    let mut out = Vec::new();
    if let Some(&s) = sizes("rr").first() {
        out.push(format!(
            "TCP RR {} RTT p50: memloop {} loopback TCP (target ≥ 5×), {} veth+bridge (target ≥ 8×); memloop-lo {} loopback TCP",
            fmt_size(s),
            x(vs(MEMLOOP, TCP_LO, "rr", s, RTT, false)),
            x(vs(MEMLOOP, VETH, "rr", s, RTT, false)),
            x(vs(MEMLOOP_LO, TCP_LO, "rr", s, RTT, false)),
        ));
    }
    if let Some(&s) = sizes("stream").last() {
        out.push(format!(
            "TCP STREAM {}: memloop {} loopback TCP (target ≥ 2×), {} veth+bridge; memloop-lo {} loopback TCP",
            fmt_size(s),
            x(vs(MEMLOOP, TCP_LO, "stream", s, GBIT, false)),
            x(vs(MEMLOOP, VETH, "stream", s, GBIT, false)),
            x(vs(MEMLOOP_LO, TCP_LO, "stream", s, GBIT, false)),
        ));
    }
    let (rr_sizes, stream_sizes) = (sizes("rr"), sizes("stream"));
    // (64 B where measured: the RR size.)
    let rr = rr_sizes.iter().find(|&&s| s == 64).or(rr_sizes.first());
    if let (Some(&rr), Some(&st)) = (rr, stream_sizes.last()) {
        if get(MEMLOOP6, "rr", rr, RTT).is_some() {
            out.push(format!(
                "TCP over IPv6 across domains (target: the IPv4 ratios, within noise): RR {} RTT p50 \
                 memloop-v6 {} veth+bridge-v6 (IPv4: {}); STREAM {} {} (IPv4: {})",
                fmt_size(rr),
                x(vs(MEMLOOP6, VETH6, "rr", rr, RTT, false)),
                x(vs(MEMLOOP, VETH, "rr", rr, RTT, false)),
                fmt_size(st),
                x(vs(MEMLOOP6, VETH6, "stream", st, GBIT, false)),
                x(vs(MEMLOOP, VETH, "stream", st, GBIT, false)),
            ));
        }
    }
    if get(MEMLOOP, "crr", 1, CPS).is_some() {
        out.push(format!(
            "connection setup rate: memloop {} veth+bridge, memloop-lo {} loopback TCP (target ≥ 0.8×)",
            x(vs(MEMLOOP, VETH, "crr", 1, CPS, false)),
            x(vs(MEMLOOP_LO, TCP_LO, "crr", 1, CPS, false)),
        ));
    }
    if get(MEMLOOP, "sleep-rr", 64, RTT).is_some() {
        out.push(format!(
            "one end sleeps (64 B, {} µs pauses), RTT p50/p99: memloop {}/{} veth+bridge, memloop-lo {}/{} loopback TCP (target: never below 1×)",
            super::SLEEP_US,
            x(vs(MEMLOOP, VETH, "sleep-rr", 64, RTT, false)),
            x(vs(MEMLOOP, VETH, "sleep-rr", 64, RTT, true)),
            x(vs(MEMLOOP_LO, TCP_LO, "sleep-rr", 64, RTT, false)),
            x(vs(MEMLOOP_LO, TCP_LO, "sleep-rr", 64, RTT, true)),
        ));
    }
    if get(MEMLOOP, "udp-rr", 64, RTT).is_some() {
        out.push(format!(
            "UDP RR 64 B RTT p50: memloop {} loopback UDP (target ≥ 50×), {} veth+bridge (target ≥ 50×); memloop-lo {} loopback UDP; p99: {} / {}",
            x(vs(MEMLOOP, TCP_LO, "udp-rr", 64, RTT, false)),
            x(vs(MEMLOOP, VETH, "udp-rr", 64, RTT, false)),
            x(vs(MEMLOOP_LO, TCP_LO, "udp-rr", 64, RTT, false)),
            x(vs(MEMLOOP, TCP_LO, "udp-rr", 64, RTT, true)),
            x(vs(MEMLOOP, VETH, "udp-rr", 64, RTT, true)),
        ));
    }
    if let Some(&s) = sizes("udp-stream").first() {
        out.push(format!(
            "UDP stream {} datagrams, delivered msg/s: memloop {} loopback UDP (target ≥ 10×), {} veth+bridge; memloop-lo {} loopback UDP",
            fmt_size(s),
            x(vs(MEMLOOP, TCP_LO, "udp-stream", s, MSGS, false)),
            x(vs(MEMLOOP, VETH, "udp-stream", s, MSGS, false)),
            x(vs(MEMLOOP_LO, TCP_LO, "udp-stream", s, MSGS, false)),
        ));
    }
    for r in remote.iter().filter(|r| !r.metric.contains("p99")) {
        out.push(format!(
            "preload on remote traffic, {} {} {}: cost {:+.1}% (target ≤ {:.0}%; noise ±{:.1}%)",
            r.test,
            fmt_size(r.size),
            r.metric,
            r.cost_pct,
            r.target_pct,
            r.noise_pct
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(test: &'static str, path: &'static str, unit: &'static str, v: f64) -> Record {
        let mut r = Record::new(test, path, 64, unit, v);
        if unit == RTT {
            r.p99 = Some(v * 2.0);
        }
        r
    }

    #[test]
    fn main_table_puts_paths_side_by_side_with_ratios() {
        let t = main_table(&[
            rec("rr", MEMLOOP, RTT, 2.0),
            rec("rr", VETH, RTT, 40.0),
            rec("rr", TCP_LO, RTT, 30.0),
            rec("stream", MEMLOOP_LO, GBIT, 8.0),
            rec("stream", TCP_LO, GBIT, 2.0),
            rec("rr", REMOTE, RTT, 41.0),
        ]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 4, "{t}");
        assert!(
            lines[1].contains("RTT µs p50") && lines[1].contains("20.0×"),
            "{t}"
        );
        assert!(
            lines[1].contains("15.0×") && lines[1].contains("n/a"),
            "{t}"
        );
        assert!(lines[3].contains("4.00×"), "{t}");
        assert!(!t.contains(REMOTE), "{t}");
    }

    #[test]
    fn remote_cost_is_positive_when_the_preload_is_slower() {
        let run =
            |rtt: f64, gbit: f64| vec![rec("rr", VETH, RTT, rtt), rec("stream", VETH, GBIT, gbit)];
        // Load drifts up over each triple; the preloaded run sits 2% / 1% above the drift.
        let triples = [
            Triple {
                a1: run(50.0, 10.0),
                b: run(51.5, 9.8),
                a2: run(51.0, 9.8),
            },
            Triple {
                a1: run(40.0, 10.0),
                b: run(40.8, 9.9),
                a2: run(40.0, 10.0),
            },
            Triple {
                a1: run(60.0, 10.0),
                b: run(61.2, 9.9),
                a2: run(60.0, 10.0),
            },
        ];
        let rows = remote_rows(&triples);
        let got: Vec<(String, i64, i64)> = rows
            .iter()
            .map(|r| {
                let tenth = |x: f64| (x * 10.0).round() as i64;
                (r.metric.clone(), tenth(r.cost_pct), tenth(r.noise_pct))
            })
            .collect();
        assert_eq!(
            got,
            [
                ("RTT µs p50".to_string(), 20, 0),
                ("RTT µs p99".to_string(), 20, 0),
                ("Gbit/s".to_string(), 10, 0)
            ]
        );
        assert!(rows.iter().all(|r| r.triples == 3 && r.plain > 0.0));
        assert_eq!(targets(&[], &rows).len(), 2);
    }
}
