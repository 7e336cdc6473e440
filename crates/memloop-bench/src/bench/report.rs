//! Results: one record per measurement, a side-by-side table, and the JSON file.

use crate::error::{CliResult, Context};
use crate::units::fmt_size;
use serde::Serialize;
use std::path::Path;

/// Paths in table column order.
pub const PATHS: [&str; 4] = ["memloop", "unix", "tcp-loopback", "cacheline"];

#[derive(Serialize, Clone, Debug)]
pub struct Record {
    pub test: &'static str,
    pub path: &'static str,
    pub size: u64,
    pub unit: &'static str,
    pub value: f64,
    /// For latencies: the 99th percentile, same unit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub p99: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// Collapses repeated measurements of one (test, path, size, unit) into their median, keeping
/// the order in which each first appeared.
pub fn median_of_rounds(records: Vec<Record>) -> Vec<Record> {
    let mut groups: Vec<Vec<Record>> = Vec::new();
    for r in records {
        let key = |x: &Record| (x.test, x.path, x.size, x.unit);
        match groups.iter_mut().find(|g| key(&g[0]) == key(&r)) {
            Some(g) => g.push(r),
            None => groups.push(vec![r]),
        }
    }
    groups.into_iter().map(median_record).collect()
}

fn median_record(mut g: Vec<Record>) -> Record {
    let p99s: Vec<f64> = g.iter().filter_map(|r| r.p99).collect();
    g.sort_by(|a, b| a.value.total_cmp(&b.value));
    let mut m = g.swap_remove(g.len() / 2);
    if !p99s.is_empty() {
        m.p99 = Some(median(p99s));
    }
    m
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

impl Record {
    pub fn new(
        test: &'static str,
        path: &'static str,
        size: u64,
        unit: &'static str,
        value: f64,
    ) -> Self {
        Record {
            test,
            path,
            size,
            unit,
            value,
            p99: None,
            note: None,
        }
    }
}

pub fn write_json(records: &[Record], file: &Path) -> CliResult<()> {
    let json = serde_json::to_string_pretty(records)?;
    std::fs::write(file, json + "\n").context(format!("writing {}", file.display()))
}

/// Writes a bench's results document to `file` and says so.
pub fn write_results(v: &serde_json::Value, file: &Path) -> CliResult<()> {
    std::fs::write(file, serde_json::to_string_pretty(v)? + "\n")
        .context(format!("writing {}", file.display()))?;
    println!("results written to {}", file.display());
    Ok(())
}

/// One table row: a metric of one test and size, a value per path.
struct Row {
    test: &'static str,
    size: u64,
    metric: String,
    lower_is_better: bool,
    values: [Option<f64>; PATHS.len()],
}

fn rows(records: &[Record]) -> Vec<Row> {
    let mut rows: Vec<Row> = Vec::new();
    for r in records {
        let col = PATHS.iter().position(|p| *p == r.path).unwrap_or(0);
        let mut put = |metric: String, v: f64| {
            let i = match rows
                .iter()
                .position(|x| x.test == r.test && x.size == r.size && x.metric == metric)
            {
                Some(i) => i,
                None => {
                    let lower_is_better = matches!(r.unit, "us" | "cpu%");
                    rows.push(Row {
                        test: r.test,
                        size: r.size,
                        metric,
                        lower_is_better,
                        values: [None; 4],
                    });
                    rows.len() - 1
                }
            };
            rows[i].values[col] = Some(v);
        };
        let unit = if r.unit == "us" { "µs" } else { r.unit };
        match r.p99 {
            Some(p99) => {
                put(format!("{unit} p50"), r.value);
                put(format!("{unit} p99"), p99);
            }
            None => put(unit.to_string(), r.value),
        }
    }
    rows
}

/// Three significant figures, with k/M for large counts.
pub fn fmt_num(v: f64) -> String {
    match v.abs() {
        x if x >= 1e7 => format!("{:.1}M", v / 1e6),
        x if x >= 1e6 => format!("{:.2}M", v / 1e6),
        x if x >= 1e5 => format!("{:.0}k", v / 1e3),
        x if x >= 100.0 => format!("{v:.0}"),
        x if x >= 10.0 => format!("{v:.1}"),
        x if x >= 1.0 => format!("{v:.2}"),
        _ => format!("{v:.3}"),
    }
}

/// How many times better memloop is than `other` (>1: memloop wins).
fn ratio(row: &Row, other: usize) -> String {
    match (row.values[0], row.values[other]) {
        (Some(m), Some(o)) if m > 0.0 && o > 0.0 => {
            let r = if row.lower_is_better { o / m } else { m / o };
            match r {
                r if r >= 100.0 => format!("{r:.0}×"),
                r if r >= 10.0 => format!("{r:.1}×"),
                r => format!("{r:.2}×"),
            }
        }
        _ => "-".into(),
    }
}

pub fn table(records: &[Record]) -> String {
    let head = [
        "test",
        "size",
        "metric",
        PATHS[0],
        PATHS[1],
        PATHS[2],
        PATHS[3],
        "memloop vs tcp",
        "vs unix",
    ];
    let mut lines: Vec<Vec<String>> = vec![head.iter().map(|s| s.to_string()).collect()];
    for row in rows(records) {
        let size = if row.size == 0 {
            "-".into()
        } else {
            fmt_size(row.size)
        };
        let mut line = vec![row.test.to_string(), size, row.metric.clone()];
        line.extend(row.values.iter().map(|v| v.map_or("-".into(), fmt_num)));
        line.push(ratio(&row, 2));
        line.push(ratio(&row, 1));
        lines.push(line);
    }
    align(&lines)
}

/// Left-aligns the first three columns and right-aligns the numbers.
pub(crate) fn align(lines: &[Vec<String>]) -> String {
    let ncol = lines[0].len();
    let width = |c: usize| {
        lines
            .iter()
            .map(|l| l[c].chars().count())
            .max()
            .unwrap_or(0)
    };
    let widths: Vec<usize> = (0..ncol).map(width).collect();
    let mut out = String::new();
    for l in lines {
        let cells: Vec<String> = l
            .iter()
            .enumerate()
            .map(|(c, s)| {
                if c < 3 {
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

/// The targets this run speaks to (brief §5 and the foundation issue), as ratios.
pub fn targets(records: &[Record]) -> Vec<String> {
    let find = |test: &str, path: &str, unit: &str| {
        records
            .iter()
            .filter(|r| r.test == test && r.path == path && r.unit == unit)
            .min_by_key(|r| r.size)
    };
    let mut out = Vec::new();
    if let (Some(m), Some(c)) = (
        find("rr", "memloop", "us"),
        find("pingpong", "cacheline", "us"),
    ) {
        out.push(format!(
            "memloop one-way latency at {} is {:.1}× the cache-line ping-pong (targets: ≤ 3× issue, ≤ 5× brief)",
            fmt_size(m.size),
            m.value / c.value
        ));
    }
    if let Some(s) = find("stream", "memloop", "msg/s") {
        out.push(format!(
            "memloop stream at {}: {} msg/s (targets: ≥ 20M issue, ≥ 10M brief)",
            fmt_size(s.size),
            fmt_num(s.value)
        ));
    }
    let gbit = |path| {
        let big = records
            .iter()
            .filter(|r| r.test == "stream")
            .map(|r| r.size)
            .max()?;
        records
            .iter()
            .find(|r| r.test == "stream" && r.path == path && r.size == big && r.unit == "Gbit/s")
            .map(|r| (big, r.value))
    };
    if let (Some((size, m)), Some((_, t))) = (gbit("memloop"), gbit("tcp-loopback")) {
        out.push(format!(
            "memloop stream at {} is {:.1}× loopback TCP (target: ≥ 4×)",
            fmt_size(size),
            m / t
        ));
    }
    if let Some(i) = find("idle", "memloop", "cpu%") {
        out.push(format!(
            "memloop idle pair: {:.2}% of one CPU (target: < 1%)",
            i.value
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_collapse_to_their_median_in_first_seen_order() {
        let rec = |path, v| Record::new("stream", path, 64, "msg/s", v);
        let rounds = vec![
            rec("memloop", 9.0),
            rec("unix", 1.0),
            rec("memloop", 3.0),
            rec("memloop", 5.0),
            rec("unix", 2.0),
        ];
        let m = median_of_rounds(rounds);
        let got: Vec<(&str, f64)> = m.iter().map(|r| (r.path, r.value)).collect();
        assert_eq!(got, vec![("memloop", 5.0), ("unix", 2.0)]);
    }

    #[test]
    fn table_puts_paths_side_by_side_with_ratios() {
        let mut rr = Record::new("rr", "memloop", 64, "us", 1.0);
        rr.p99 = Some(2.0);
        let mut tcp = Record::new("rr", "tcp-loopback", 64, "us", 30.0);
        tcp.p99 = Some(40.0);
        let s1 = Record::new("stream", "memloop", 64, "Gbit/s", 8.0);
        let s2 = Record::new("stream", "unix", 64, "Gbit/s", 2.0);
        let t = table(&[rr, tcp, s1, s2]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 4, "{t}");
        assert!(
            lines[1].contains("µs p50") && lines[1].contains("30.0×"),
            "{t}"
        );
        assert!(lines[2].contains("20.0×"), "{t}");
        assert!(lines[3].contains("4.00×"), "{t}");
    }
}
