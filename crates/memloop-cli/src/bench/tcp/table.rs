//! `memloop bench tcp` results as tables: the paths side by side with ratios, the preload's cost
//! on traffic that cannot use a ring, and the brief's targets.

use super::{MEMLOOP, MEMLOOP_LO, REMOTE, TCP_LO, UNIX, VETH};
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
const COLUMNS: [&str; 5] = [MEMLOOP, VETH, MEMLOOP_LO, TCP_LO, UNIX];
/// Ratio columns: (heading, column of the memloop path, column of the baseline).
const RATIOS: [(&str, usize, usize); 3] = [
    ("memloop vs veth", 0, 1),
    ("memloop vs lo", 0, 3),
    ("memloop-lo vs lo", 2, 3),
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

/// Round-to-round spread of one figure, before taking the median.
pub struct Spread {
    test: &'static str,
    path: &'static str,
    size: u64,
    unit: &'static str,
    /// (max - min) / median, %; `None` with a single round.
    pct: Option<f64>,
}

/// Spreads of the figures the remote-cost comparison uses.
pub fn spreads(raw: &[Record]) -> Vec<Spread> {
    let mut out: Vec<Spread> = Vec::new();
    for r in raw.iter().filter(|r| r.path == VETH || r.path == REMOTE) {
        let same =
            |x: &&Record| (x.test, x.path, x.size, x.unit) == (r.test, r.path, r.size, r.unit);
        if out
            .iter()
            .any(|s| (s.test, s.path, s.size, s.unit) == (r.test, r.path, r.size, r.unit))
        {
            continue;
        }
        let mut v: Vec<f64> = raw.iter().filter(same).map(|x| x.value).collect();
        v.sort_by(f64::total_cmp);
        let med = v[v.len() / 2];
        let pct = (v.len() > 1 && med > 0.0).then(|| (v[v.len() - 1] - v[0]) / med * 100.0);
        out.push(Spread {
            test: r.test,
            path: r.path,
            size: r.size,
            unit: r.unit,
            pct,
        });
    }
    out
}

#[derive(Serialize, Clone, Debug)]
pub struct RemoteRow {
    pub test: &'static str,
    pub size: u64,
    pub metric: String,
    /// veth+bridge without the preload.
    pub plain: f64,
    /// veth+bridge with the preload on both ends, no ring.
    pub preload: f64,
    /// How much worse the preload makes it, % (negative: better).
    pub cost_pct: f64,
    /// Round-to-round spread of `plain` alone, % (the noise floor; null with one round).
    pub plain_spread_pct: Option<f64>,
    /// The brief's limit on `cost_pct`.
    pub target_pct: f64,
}

pub fn remote_rows(records: &[Record], spreads: &[Spread]) -> Vec<RemoteRow> {
    let find = |path: &str, test: &str, unit: &str| {
        records
            .iter()
            .find(|r| r.path == path && r.test == test && r.unit == unit && r.size == 64)
    };
    let spread = |test: &str, unit: &str| {
        spreads
            .iter()
            .find(|s| s.path == VETH && s.test == test && s.unit == unit && s.size == 64)
            .and_then(|s| s.pct)
    };
    let mut out = Vec::new();
    for (test, unit, target) in [("rr", RTT, 2.0), ("rr", TPS, 2.0), ("stream", GBIT, 1.0)] {
        let (Some(plain), Some(pre)) = (find(VETH, test, unit), find(REMOTE, test, unit)) else {
            continue;
        };
        let cost = |a: f64, b: f64| {
            if lower_is_better(unit) {
                (b - a) / a * 100.0
            } else {
                (a - b) / a * 100.0
            }
        };
        let spread = spread(test, unit);
        out.push(RemoteRow {
            test,
            size: 64,
            metric: metric(unit, false),
            plain: plain.value,
            preload: pre.value,
            cost_pct: cost(plain.value, pre.value),
            plain_spread_pct: spread,
            target_pct: target,
        });
        if let (Some(a), Some(b)) = (plain.p99, pre.p99) {
            out.push(RemoteRow {
                test,
                size: 64,
                metric: metric(unit, true),
                plain: a,
                preload: b,
                cost_pct: cost(a, b),
                plain_spread_pct: spread,
                target_pct: target,
            });
        }
    }
    out
}

pub fn remote_table(rows: &[RemoteRow]) -> String {
    let mut lines: Vec<Vec<String>> = vec![[
        "test",
        "size",
        "metric",
        VETH,
        REMOTE,
        "cost",
        "target",
        "veth spread",
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
            r.plain_spread_pct
                .map_or("-".into(), |p| format!("{p:.1}%")),
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
    for r in remote.iter().filter(|r| !r.metric.contains("p99")) {
        out.push(format!(
            "preload on remote traffic, {} {} {}: cost {:+.1}% (target ≤ {:.0}%{})",
            r.test,
            fmt_size(r.size),
            r.metric,
            r.cost_pct,
            r.target_pct,
            r.plain_spread_pct.map_or(String::new(), |p| format!(
                "; veth round-to-round spread {p:.1}%"
            ))
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
        let records = [
            rec("rr", VETH, RTT, 50.0),
            rec("rr", REMOTE, RTT, 51.0),
            rec("stream", VETH, GBIT, 10.0),
            rec("stream", REMOTE, GBIT, 9.9),
        ];
        let rows = remote_rows(&records, &spreads(&records));
        let cost: Vec<(String, i64)> = rows
            .iter()
            .map(|r| (r.metric.clone(), (r.cost_pct * 10.0).round() as i64))
            .collect();
        assert_eq!(
            cost,
            [
                ("RTT µs p50".to_string(), 20),
                ("RTT µs p99".to_string(), 20),
                ("Gbit/s".to_string(), 10)
            ]
        );
        assert_eq!(targets(&records, &rows).len(), 2);
    }
}
