//! Experiment 9: the seed papers' published ratios next to ours from the same run. Only numbers
//! the papers state (table ids quoted); ours come from experiments 1, 3 and 8 of this run.

use super::Rec;

/// One row: a paper's ratio and the pair of our figures it compares with.
pub struct Row {
    pub source: &'static str,
    pub setting: &'static str,
    /// The paper's two numbers (numerator, denominator) as printed.
    pub paper: (f64, f64),
    pub ours_pair: &'static str,
    /// Our figures: (experiment, test, size, unit, numerator path, denominator path); for
    /// experiment 3, the "preloaded/plain" record itself (denominator path unused).
    pub ours: (
        u32,
        &'static str,
        u64,
        &'static str,
        &'static str,
        &'static str,
    ),
    pub differs: &'static str,
}

impl Row {
    pub fn paper_ratio(&self) -> f64 {
        self.paper.0 / self.paper.1
    }

    pub fn ours(&self, recs: &[Rec]) -> Option<f64> {
        let (exp, test, size, unit, num, den) = self.ours;
        let get = |path: &str| {
            recs.iter()
                .find(|r| {
                    r.experiment == exp
                        && r.test == test
                        && r.size == size
                        && r.unit == unit
                        && r.path == path
                        && r.variant.is_none()
                })
                .map(|r| r.value)
        };
        if exp == 3 {
            return get(num);
        }
        Some(get(num)? / get(den)?)
    }
}

const XEN: &str = "Xen 3.2 guests on 2009 hardware, netperf's 1-byte TCP_RR, packets through \
                   netfront/netback or XenLoop's FIFOs; ours: network namespaces of one kernel, \
                   64-byte request/response of tcp-peer, veth+bridge vs the preload's rings";
const XEN_BW: &str = "Xen guests on 2009 hardware, netperf TCP_STREAM with its default message; \
                      ours: namespaces of one kernel, a stream of 64 KB messages";
const PIVOT: &str = "Xen guests on a modern kernel, netperf TCP_RR (mean of 5 runs); ours: \
                     namespaces of one kernel, 64-byte request/response";
const PIVOT_REMOTE: &str = "Xen guests on a modern kernel, netperf TCP_RR to dom0 through \
                            PIVOT's hooked but not redirected path; ours: namespaces of one \
                            kernel, 4-byte request/response on veth+bridge with the preload \
                            loaded in both ends (ends in different regions)";
const STUDY: &str = "Xen guests, XenLoop-style lookup per packet in the kernel, streams of small \
                     UDP/TCP messages; ours: the preload's lookup once per connection (ends in \
                     different regions, so traffic stays on TCP over veth+bridge)";
const FIDO: &str = "TPC-C (tpmC, 50 warehouses, one hour) on a storage appliance, MMNet/MMBlk \
                    zero-copy between Xen VMs; ours: pgbench TPC-B-like, scale 1, 4 clients, \
                    network only (the database's disk is local in every case)";

const XEN_UDP: &str = "Xen 3.2 guests on 2009 hardware, netperf's UDP_RR (1 byte) through \
                       netfront/netback or XenLoop's FIFOs; ours: network namespaces of one \
                       kernel, 64-byte UDP request/response of tcp-peer";
const XEN_UDP_BW: &str = "Xen guests on 2009 hardware, netperf UDP_STREAM with its default \
                          message; ours: namespaces of one kernel, 16 KB datagrams, counted \
                          where they are delivered";
const PIVOT_UDP: &str = "Xen guests on a modern kernel, netperf UDP_RR (mean of 5 runs); ours: \
                         namespaces of one kernel, 64-byte UDP request/response";
const PIVOT_UDP_REMOTE: &str = "Xen guests on a modern kernel, netperf UDP_RR to dom0 through \
                                PIVOT's hooked but not redirected path (the table's five runs \
                                averaged here); ours: 64-byte UDP request/response on \
                                veth+bridge with the preload loaded in both ends (ends in \
                                different regions)";

pub const ROWS: [Row; 16] = [
    Row {
        source: "XenLoop, Table 3",
        setting: "netperf TCP_RR trans/s: XenLoop / netfront-netback (28529 / 10236)",
        paper: (28529.0, 10236.0),
        ours_pair: "rr 64 B transactions/s: memloop / veth+bridge (exp. 1)",
        ours: (1, "rr", 64, "transactions/s", "memloop", "veth+bridge"),
        differs: XEN,
    },
    Row {
        source: "XenLoop, Table 3",
        setting: "netperf TCP_RR trans/s: native loopback / netfront-netback (31969 / 10236)",
        paper: (31969.0, 10236.0),
        ours_pair: "rr 64 B transactions/s: tcp-loopback / veth+bridge (exp. 1)",
        ours: (1, "rr", 64, "transactions/s", "tcp-loopback", "veth+bridge"),
        differs: XEN,
    },
    Row {
        source: "XenLoop, Table 3",
        setting: "netperf TCP_RR trans/s: XenLoop / native loopback (28529 / 31969)",
        paper: (28529.0, 31969.0),
        ours_pair: "rr 64 B transactions/s: memloop / tcp-loopback (exp. 1)",
        ours: (1, "rr", 64, "transactions/s", "memloop", "tcp-loopback"),
        differs: XEN,
    },
    Row {
        source: "XenLoop, Table 2",
        setting: "netperf TCP Mbps: XenLoop / netfront-netback (4143 / 2656)",
        paper: (4143.0, 2656.0),
        ours_pair: "stream 64 KB Gbit/s: memloop / veth+bridge (exp. 1)",
        ours: (1, "stream", 65536, "Gbit/s", "memloop", "veth+bridge"),
        differs: XEN_BW,
    },
    Row {
        source: "XenLoop, Table 2",
        setting: "netperf TCP Mbps: XenLoop / native loopback (4143 / 4666)",
        paper: (4143.0, 4666.0),
        ours_pair: "stream 64 KB Gbit/s: memloop / tcp-loopback (exp. 1)",
        ours: (1, "stream", 65536, "Gbit/s", "memloop", "tcp-loopback"),
        differs: XEN_BW,
    },
    Row {
        source: "PIVOT, Table I",
        setting:
            "TCP_RR trans/s domU to domU: ported XenLoop / netback-netfront (7627.19 / 3515.10)",
        paper: (7627.1884, 3515.1016),
        ours_pair: "rr 64 B transactions/s: memloop / veth+bridge (exp. 1)",
        ours: (1, "rr", 64, "transactions/s", "memloop", "veth+bridge"),
        differs: PIVOT,
    },
    Row {
        source: "PIVOT, Table III",
        setting: "TCP_RR trans/s domU to dom0 (not redirected): ported XenLoop / netback-netfront \
                  (7002.42 / 7054.10)",
        paper: (7002.419, 7054.0976),
        ours_pair: "rr 4 B transactions/s, remote: veth+preload / veth+bridge (exp. 3)",
        ours: (3, "rr", 4, "preloaded/plain", "veth+preload", ""),
        differs: PIVOT_REMOTE,
    },
    Row {
        source: "Residency study, Table 2",
        setting: "4-byte messages Mbps, remote traffic: 1 lookup / native (5.42 / 5.58)",
        paper: (5.42, 5.58),
        ours_pair: "stream 4 B Gbit/s, remote: veth+preload / veth+bridge (exp. 3)",
        ours: (3, "stream", 4, "preloaded/plain", "veth+preload", ""),
        differs: STUDY,
    },
    Row {
        source: "Residency study, Table 2",
        setting: "1 KB messages Mbps, remote traffic: 1 lookup / native (933.9 / 934.1)",
        paper: (933.9, 934.1),
        ours_pair: "stream 1 KB Gbit/s, remote: veth+preload / veth+bridge (exp. 3)",
        ours: (3, "stream", 1024, "preloaded/plain", "veth+preload", ""),
        differs: STUDY,
    },
    Row {
        source: "XenLoop, Table 3",
        setting: "netperf UDP_RR trans/s: XenLoop / netfront-netback (32803 / 12600)",
        paper: (32803.0, 12600.0),
        ours_pair: "udp-rr 64 B transactions/s: memloop / veth+bridge (exp. 1)",
        ours: (1, "udp-rr", 64, "transactions/s", "memloop", "veth+bridge"),
        differs: XEN_UDP,
    },
    Row {
        source: "XenLoop, Table 3",
        setting: "netperf UDP_RR trans/s: XenLoop / native loopback (32803 / 39623)",
        paper: (32803.0, 39623.0),
        ours_pair: "udp-rr 64 B transactions/s: memloop / loopback UDP (exp. 1)",
        ours: (1, "udp-rr", 64, "transactions/s", "memloop", "tcp-loopback"),
        differs: XEN_UDP,
    },
    Row {
        source: "XenLoop, Table 2",
        setting: "netperf UDP Mbps: XenLoop / netfront-netback (4380 / 707)",
        paper: (4380.0, 707.0),
        ours_pair: "udp-stream 16 KB Gbit/s delivered: memloop / veth+bridge (exp. 1)",
        ours: (1, "udp-stream", 16384, "Gbit/s", "memloop", "veth+bridge"),
        differs: XEN_UDP_BW,
    },
    Row {
        source: "PIVOT, Table II",
        setting: "UDP_RR trans/s domU to domU: PIVOT / netback-netfront (7815.66 / 4291.93)",
        paper: (7815.66, 4291.9314),
        ours_pair: "udp-rr 64 B transactions/s: memloop / veth+bridge (exp. 1)",
        ours: (1, "udp-rr", 64, "transactions/s", "memloop", "veth+bridge"),
        differs: PIVOT_UDP,
    },
    Row {
        source: "PIVOT, Table IV",
        setting: "UDP_RR trans/s domU to dom0 (not redirected): PIVOT / netback-netfront \
                  (6880.35 / 6789.19)",
        paper: (6880.3548, 6789.1882),
        ours_pair: "udp-rr 64 B transactions/s, remote: veth+preload / veth+bridge (exp. 3)",
        ours: (3, "udp-rr", 64, "preloaded/plain", "veth+preload", ""),
        differs: PIVOT_UDP_REMOTE,
    },
    Row {
        source: "Fido, Table 1",
        setting: "TPC-C tpmC: MM-Xen / Native-Xen (284.832 / 183.032)",
        paper: (284.832, 183.032),
        ours_pair: "pgbench transactions/s: memloop / veth+bridge (exp. 8)",
        ours: (8, "pgbench", 1, "transactions/s", "memloop", "veth+bridge"),
        differs: FIDO,
    },
    Row {
        source: "Fido, Table 1",
        setting: "TPC-C tpmC: MM-Xen / Monolithic (284.832 / 293.833)",
        paper: (284.832, 293.833),
        ours_pair: "pgbench transactions/s: memloop / monolithic (exp. 8)",
        ours: (8, "pgbench", 1, "transactions/s", "memloop", "monolithic"),
        differs: FIDO,
    },
];

/// The records of experiment 9: per row, the paper's ratio and ours (when this run measured it).
pub fn records(recs: &[Rec]) -> Vec<Rec> {
    let mut out = Vec::new();
    for (i, row) in ROWS.iter().enumerate() {
        let Some(ours) = row.ours(recs) else {
            continue;
        };
        let test = format!("row {}: {}", i + 1, row.source);
        let mut p = Rec::new(9, &test, "paper", 1, "ratio", row.paper_ratio()).variant("paper");
        p.note = Some(row.setting.into());
        let mut o = Rec::new(9, &test, row.ours_pair, 1, "ratio", ours).variant("ours");
        o.note = Some(row.differs.into());
        out.push(p);
        out.push(o);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_pair_the_papers_with_our_records() {
        let recs = vec![
            Rec::new(1, "rr", "memloop", 64, "transactions/s", 30.0),
            Rec::new(1, "rr", "veth+bridge", 64, "transactions/s", 10.0),
        ];
        let r = records(&recs);
        // Rows 1 and 6 use exactly these figures.
        assert_eq!(r.len(), 4);
        assert!((r[0].value - 28529.0 / 10236.0).abs() < 1e-9);
        assert!((r[1].value - 3.0).abs() < 1e-9);
    }
}
