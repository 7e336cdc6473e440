//! The headline ratios at the top of the report: what a reader decides on. Computed from the
//! (merged) records of this run; a ratio whose inputs were not measured is left out.

use super::Rec;
use crate::units::fmt_size;
use serde::Serialize;

#[derive(Serialize, Clone, Debug, PartialEq)]
pub struct Line {
    pub figure: String,
    /// memloop's figure over the baseline's (higher is better for memloop).
    pub ratio: f64,
    pub detail: String,
}

fn find(r: &[Rec], exp: u32, test: &str, path: &str, size: Option<u64>) -> Option<f64> {
    r.iter()
        .find(|x| {
            x.experiment == exp
                && x.test == test
                && x.path == path
                && x.variant.is_none()
                && size.is_none_or(|s| x.size == s)
        })
        .map(|x| x.value)
}

/// memloop against each baseline for one figure of experiments 1 and 7.
fn versus(r: &[Rec], exp: u32, test: &str, size: Option<u64>, what: &str, out: &mut Vec<Line>) {
    let Some(m) = find(r, exp, test, "memloop", size) else {
        return;
    };
    for base in ["tcp-loopback", "veth+bridge"] {
        if let Some(b) = find(r, exp, test, base, size).filter(|b| *b > 0.0) {
            out.push(Line {
                figure: format!("{what} vs {base}"),
                ratio: m / b,
                detail: format!("{} vs {}", fmt(m), fmt(b)),
            });
        }
    }
}

fn fmt(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

/// Median % change of the preloaded remote runs (experiment 3) per test: rr and stream over the
/// sizes, connection setup over the registered-endpoint counts.
fn remote_cost(r: &[Rec], out: &mut Vec<Line>) {
    for test in ["rr", "stream", "crr"] {
        let changes: Vec<f64> = r
            .iter()
            .filter(|x| x.experiment == 3 && x.test == test)
            .filter(|x| x.variant.is_none() || test == "crr")
            .filter_map(|x| x.change_pct)
            .collect();
        let (Some(med), Some(worst)) = (
            super::rounds::median(changes.clone()),
            changes.iter().copied().reduce(f64::min),
        ) else {
            continue;
        };
        out.push(Line {
            figure: format!("remote {test} with the preload loaded (not co-resident)"),
            ratio: 1.0 + med / 100.0,
            detail: format!(
                "median change {med:+.1} % over {} {}, worst {worst:+.1} %",
                changes.len(),
                if test == "crr" {
                    "endpoint counts"
                } else {
                    "sizes"
                }
            ),
        });
    }
}

/// Experiment 2: memloop's aggregate over veth's, per remote:local mix.
fn mixes(r: &[Rec], out: &mut Vec<Line>) {
    for m in r
        .iter()
        .filter(|x| x.experiment == 2 && x.path == "memloop")
    {
        let base = r.iter().find(|x| {
            x.experiment == 2 && x.path == "veth+bridge" && x.variant == m.variant && x.value > 0.0
        });
        if let Some(b) = base {
            out.push(Line {
                figure: format!("five 1 KB flows, {}", m.variant.as_deref().unwrap_or("mix")),
                ratio: m.value / b.value,
                detail: format!("{} vs {} Gbit/s", fmt(m.value), fmt(b.value)),
            });
        }
    }
}

/// Experiment 4: memloop against veth+bridge with both ends on one core and on two.
fn placement(r: &[Rec], out: &mut Vec<Line>) {
    for m in r
        .iter()
        .filter(|x| x.experiment == 4 && x.path == "memloop")
    {
        let Some(place) = m.variant.as_deref().filter(|v| !v.contains(',')) else {
            continue; // the per-end CPU figures
        };
        let base = r.iter().find(|x| {
            x.experiment == 4
                && x.path == "veth+bridge"
                && x.test == m.test
                && x.variant == m.variant
                && x.value > 0.0
        });
        if let Some(b) = base {
            out.push(Line {
                figure: format!(
                    "{} {}, ends on {place}, vs veth+bridge",
                    m.test,
                    fmt_size(m.size)
                ),
                ratio: m.value / b.value,
                detail: format!("{} vs {} {}", fmt(m.value), fmt(b.value), m.unit),
            });
        }
    }
}

/// Experiment 10: memloop (native and transparent) against virtio-net between VMs. Round trips
/// are times (lower is better), so their ratio is the baseline's over ours.
fn vms(r: &[Rec], out: &mut Vec<Line>) {
    for m in r
        .iter()
        .filter(|x| x.experiment == 10 && x.path.starts_with("memloop"))
    {
        let Some(b) = r.iter().find(|x| {
            x.experiment == 10
                && x.path == "virtio-net"
                && x.test == m.test
                && x.variant == m.variant
        }) else {
            continue;
        };
        let ratio = if m.test == "rr" {
            b.value / m.value
        } else {
            m.value / b.value
        };
        out.push(Line {
            figure: format!(
                "VMs, {}: {} {} vs virtio-net",
                m.variant.as_deref().unwrap_or(""),
                m.path,
                if m.test == "rr" {
                    "64 B round trip"
                } else {
                    "64 KB stream"
                }
            ),
            ratio,
            detail: format!("{} vs {} {}", fmt(m.value), fmt(b.value), m.unit),
        });
    }
}

/// Experiment 6: CPU per transaction of both ends (lower is better: the baseline's over ours).
fn cpu_cost(r: &[Rec], out: &mut Vec<Line>) {
    let both = |path: &str, test: &str| {
        r.iter()
            .find(|x| {
                x.experiment == 6
                    && x.test == test
                    && x.path == path
                    && x.variant.as_deref() == Some("both ends")
            })
            .map(|x| x.value)
    };
    for (test, what) in [
        ("rr", "CPU per 64 B transaction"),
        ("sleep-rr", "CPU per 64 B transaction, one end sleeping"),
    ] {
        let Some(m) = both("memloop", test).filter(|m| *m > 0.0) else {
            continue;
        };
        for base in ["tcp-loopback", "veth+bridge"] {
            if let Some(b) = both(base, test) {
                out.push(Line {
                    figure: format!("{what} vs {base}"),
                    ratio: b / m,
                    detail: format!("{} vs {} µs", fmt(m), fmt(b)),
                });
            }
        }
    }
}

/// Experiment 11: memloop's aggregate over each baseline's.
fn oversubscribed(r: &[Rec], out: &mut Vec<Line>) {
    let Some(m) = r.iter().find(|x| x.experiment == 11 && x.path == "memloop") else {
        return;
    };
    for base in ["tcp-loopback", "veth+bridge"] {
        let b = r
            .iter()
            .find(|x| x.experiment == 11 && x.path == base && x.value > 0.0);
        if let Some(b) = b {
            out.push(Line {
                figure: format!(
                    "oversubscribed 64 B request/response ({}) vs {base}",
                    m.variant.as_deref().unwrap_or("")
                ),
                ratio: m.value / b.value,
                detail: format!("{} vs {} transactions/s", fmt(m.value), fmt(b.value)),
            });
        }
    }
}

/// Experiment 8's ratio records.
fn programs(r: &[Rec], out: &mut Vec<Line>) {
    for x in r.iter().filter(|x| x.experiment == 8 && x.unit == "ratio") {
        out.push(Line {
            figure: format!("{} {}", x.test, x.path.replace("memloop/", "vs ")),
            ratio: x.value,
            detail: String::new(),
        });
    }
}

pub fn lines(r: &[Rec]) -> Vec<Line> {
    let mut out = Vec::new();
    versus(r, 1, "rr", Some(64), "64 B round trips/s", &mut out);
    versus(r, 1, "stream", Some(65536), "64 KB stream", &mut out);
    remote_cost(r, &mut out);
    mixes(r, &mut out);
    placement(r, &mut out);
    oversubscribed(r, &mut out);
    cpu_cost(r, &mut out);
    versus(r, 7, "crr", None, "connection setup rate", &mut out);
    programs(r, &mut out);
    vms(r, &mut out);
    out
}

/// The lines where memloop is behind its baseline (ratio below 0.95: inside 5 % is noise here).
pub fn losses(lines: &[Line]) -> Vec<&Line> {
    lines.iter().filter(|l| l.ratio < 0.95).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_from_records() {
        let r = vec![
            Rec::new(1, "rr", "memloop", 64, "transactions/s", 1000.0),
            Rec::new(1, "rr", "tcp-loopback", 64, "transactions/s", 10.0),
            Rec::new(1, "rr", "veth+bridge", 64, "transactions/s", 20.0),
            Rec::new(2, "stream", "memloop", 1024, "Gbit/s", 1.0).variant("5:0 remote:local"),
            Rec::new(2, "stream", "veth+bridge", 1024, "Gbit/s", 2.0).variant("5:0 remote:local"),
        ];
        let l = lines(&r);
        assert_eq!(l.len(), 3);
        assert_eq!((l[0].ratio, l[1].ratio), (100.0, 50.0));
        assert_eq!(l[2].ratio, 0.5);
        assert_eq!(losses(&l), vec![&l[2]]);
    }
}
