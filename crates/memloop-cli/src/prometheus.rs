//! `memloop status --format prometheus`: the region's figures in the Prometheus text exposition
//! format (for node_exporter's textfile collector, or a scrape through any small HTTP server).
//! Rendered from the same object as `--json`, so the two never disagree.

use serde_json::Value;
use std::fmt::Write;

/// One metric family: its help line, type and samples (`labels`, value).
struct Family<'a> {
    name: &'a str,
    help: &'a str,
    counter: bool,
    samples: Vec<(String, f64)>,
}

impl Family<'_> {
    fn render(&self, out: &mut String) {
        let kind = if self.counter { "counter" } else { "gauge" };
        let _ = writeln!(out, "# HELP {} {}", self.name, self.help);
        let _ = writeln!(out, "# TYPE {} {kind}", self.name);
        for (labels, v) in &self.samples {
            let _ = writeln!(out, "{}{labels} {v}", self.name);
        }
    }
}

/// `{region="…",k="v"}` with the label values escaped as the format wants.
fn labels(region: &str, extra: &[(&str, &str)]) -> String {
    let esc = |s: &str| {
        s.replace('\\', "\\\\")
            .replace('"', "\\\"")
            .replace('\n', "\\n")
    };
    let mut parts = vec![format!("region=\"{}\"", esc(region))];
    parts.extend(extra.iter().map(|(k, v)| format!("{k}=\"{}\"", esc(v))));
    format!("{{{}}}", parts.join(","))
}

fn num(v: &Value) -> f64 {
    v.as_f64().unwrap_or(0.0)
}

/// Ring memory by ring size, from the object's summary (none without one).
fn ring_memory(s: &Value, region: &str) -> Vec<(String, f64)> {
    let groups = s["summary"]["ring_memory"]["by_ring_size"].as_array();
    groups
        .map_or(&[][..], Vec::as_slice)
        .iter()
        .map(|g| {
            let size = g["ring_size"].to_string();
            (labels(region, &[("ring_size", &size)]), num(&g["bytes"]))
        })
        .collect()
}

/// The exposition of a `memloop status --json` object.
pub fn render(s: &Value) -> String {
    let region = s["region"]["path"].as_str().unwrap_or("");
    let one = |extra: &[(&str, &str)], v: &Value| vec![(labels(region, extra), num(v))];
    let by = |obj: &Value, key: &str| -> Vec<(String, f64)> {
        obj.as_object()
            .map(|m| {
                m.iter()
                    .map(|(k, v)| (labels(region, &[(key, k)]), num(v)))
                    .collect()
            })
            .unwrap_or_default()
    };
    // (Borrowed: a region's lists may hold tens of thousands of entries.)
    let members = s["members"].as_array().map_or(&[][..], Vec::as_slice);
    let alive = members.iter().filter(|m| m["alive"] == true).count();
    let channels = s["channels"].as_array().map_or(&[][..], Vec::as_slice);
    let on = |path: &str| channels.iter().filter(|c| c["path"] == path).count();
    let usage = &s["usage"];
    let params = &s["region"]["params"];
    let tables = [
        ("members", "max_members"),
        ("endpoints", "max_endpoints"),
        ("channels", "max_channels"),
    ];
    let families = [
        Family {
            name: "memloop_region_size_bytes",
            help: "Size of the region's shared memory.",
            counter: false,
            samples: one(&[], &s["region"]["size"]),
        },
        Family {
            name: "memloop_members",
            help: "Members of the region, by liveness.",
            counter: false,
            samples: vec![
                (labels(region, &[("alive", "true")]), alive as f64),
                (
                    labels(region, &[("alive", "false")]),
                    (members.len() - alive) as f64,
                ),
            ],
        },
        Family {
            name: "memloop_channels",
            help: "Channels (connections with rings) by the path their bytes take now.",
            counter: false,
            samples: vec![
                (labels(region, &[("path", "ring")]), on("ring") as f64),
                (labels(region, &[("path", "tcp")]), on("tcp") as f64),
            ],
        },
        Family {
            name: "memloop_table_used",
            help: "Entries in use in the region's fixed tables.",
            counter: false,
            samples: tables
                .iter()
                .map(|(t, _)| (labels(region, &[("table", t)]), num(&usage[*t])))
                .chain([(
                    labels(region, &[("table", "ring_segments")]),
                    num(&usage["segments_used"]),
                )])
                .collect(),
        },
        Family {
            name: "memloop_table_capacity",
            help: "Size of the region's fixed tables.",
            counter: false,
            samples: tables
                .iter()
                .map(|(t, p)| (labels(region, &[("table", t)]), num(&params[*p])))
                .chain([(
                    labels(region, &[("table", "ring_segments")]),
                    num(&usage["segments_total"]),
                )])
                .collect(),
        },
        Family {
            name: "memloop_ring_memory_bytes",
            help: "Ring memory held by channels, by the size of their rings.",
            counter: false,
            samples: ring_memory(s, region),
        },
        Family {
            name: "memloop_fallbacks_total",
            help: "Connections left on TCP, by reason.",
            counter: true,
            samples: by(&s["fallbacks"], "reason"),
        },
        Family {
            name: "memloop_switches_total",
            help: "Live connections moved between ring and TCP, by reason.",
            counter: true,
            samples: by(&s["switches"], "reason"),
        },
        Family {
            name: "memloop_ring_connections_total",
            help: "Connections that took a ring.",
            counter: true,
            samples: one(&[], &s["ring_connections"]),
        },
        Family {
            name: "memloop_ring_bytes_total",
            help: "Bytes carried by rings (live connections included).",
            counter: true,
            samples: one(&[], &s["ring_bytes"]),
        },
        Family {
            name: "memloop_tcp_bytes_total",
            help: "Bytes of recorded connections carried by TCP.",
            counter: true,
            samples: one(&[], &s["tcp_bytes"]),
        },
        Family {
            name: "memloop_doorbells_total",
            help: "Wake-ups sent as doorbell bytes over TCP.",
            counter: true,
            samples: one(&[], &s["doorbells"]),
        },
        Family {
            name: "memloop_wake_fallbacks_total",
            help: "Wake-ups that could not use the sleeper's wake socket.",
            counter: true,
            samples: one(&[], &s["wake_fallback"]),
        },
        Family {
            name: "memloop_failures_total",
            help: "Late rings and pidfd_getfd handoffs that did not happen.",
            counter: true,
            samples: vec![
                (
                    labels(region, &[("what", "late_ring")]),
                    num(&s["late_failed"]),
                ),
                (
                    labels(region, &[("what", "pidfd_getfd")]),
                    num(&s["pidfd_failed"]),
                ),
                (
                    labels(region, &[("what", "conn_record_dropped")]),
                    num(&s["conn_records_dropped"]),
                ),
            ],
        },
    ];
    let mut out = String::new();
    for f in &families {
        f.render(&mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn families_have_help_type_and_labelled_samples() {
        let s = json!({
            "region": {"path": "/dev/shm/memloop-x", "size": 1024, "params":
                {"max_members": 64, "max_endpoints": 8, "max_channels": 16}},
            "usage": {"members": 2, "endpoints": 1, "channels": 1, "segments_used": 4,
                      "segments_total": 100},
            "members": [{"alive": true}, {"alive": false}],
            "channels": [{"path": "ring"}],
            "fallbacks": {"region_full": 3, "no_offer": 0},
            "switches": {"operator": 1},
            "summary": {"ring_memory": {"by_ring_size": [{"ring_size": 65536, "channels": 2,
                                                           "bytes": 270336}]}},
            "ring_connections": 5, "ring_bytes": 4096, "tcp_bytes": 7, "doorbells": 2,
            "wake_fallback": 0, "late_failed": 0, "pidfd_failed": 0, "conn_records_dropped": 0,
        });
        let t = render(&s);
        assert!(t.contains("# TYPE memloop_fallbacks_total counter\n"));
        assert!(t.contains(
            "memloop_fallbacks_total{region=\"/dev/shm/memloop-x\",reason=\"region_full\"} 3\n"
        ));
        assert!(t.contains("memloop_members{region=\"/dev/shm/memloop-x\",alive=\"false\"} 1\n"));
        assert!(t.contains(
            "memloop_table_capacity{region=\"/dev/shm/memloop-x\",table=\"ring_segments\"} 100\n"
        ));
        assert!(t.contains("memloop_ring_bytes_total{region=\"/dev/shm/memloop-x\"} 4096\n"));
        assert!(t.contains(
            "memloop_ring_memory_bytes{region=\"/dev/shm/memloop-x\",ring_size=\"65536\"} 270336\n"
        ));
        // Every sample line belongs to a family announced before it.
        let mut typed = std::collections::HashSet::new();
        for line in t.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                typed.insert(rest.split(' ').next().unwrap().to_string());
            } else if !line.starts_with('#') {
                let name = line.split('{').next().unwrap();
                assert!(typed.contains(name), "{line}");
            }
        }
    }
}
