//! What `memloop bench process` measures and against what: the variants, the groups of runs,
//! the figures with their targets, and how medians, ratios and costs are computed and shown.

use super::{Config, SPAWN_WARMUP};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Variant {
    Plain = 0,
    Preload = 1,
}

impl Variant {
    pub(super) fn name(self) -> &'static str {
        match self {
            Variant::Plain => "plain",
            Variant::Preload => "preload",
        }
    }

    /// Round `r`'s order: plain first in even rounds, preload first in odd ones.
    pub(super) fn order(r: usize) -> [Variant; 2] {
        if r.is_multiple_of(2) {
            [Variant::Plain, Variant::Preload]
        } else {
            [Variant::Preload, Variant::Plain]
        }
    }
}

/// One kind of run; a run gives one or two figures.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Group {
    ForkBare,
    ForkHold,
    ConnOut,
    ConnIn,
    ConnFork,
    Fresh,
    Noop,
    Script,
}

pub(super) const GROUPS: [Group; 8] = [
    Group::ForkBare,
    Group::ForkHold,
    Group::ConnOut,
    Group::ConnIn,
    Group::ConnFork,
    Group::Fresh,
    Group::Noop,
    Group::Script,
];

impl Group {
    pub(super) fn label(self) -> &'static str {
        match self {
            Group::ForkBare => "fork loops, nothing open",
            Group::ForkHold => "fork loops holding a connection",
            Group::ConnOut => "short connections to a non-member",
            Group::ConnIn => "short connections to an iterative server",
            Group::ConnFork => "short connections to a fork-per-connection server",
            Group::Fresh => "fresh processes, one connection each",
            Group::Noop => "fresh processes doing nothing",
            Group::Script => "a shell script running a C program",
        }
    }

    /// Ring connections one preload run must make.
    pub(super) fn rings_per_run(self, cfg: &Config) -> u64 {
        match self {
            Group::ForkHold => 1,
            Group::Fresh => (SPAWN_WARMUP + cfg.spawns) as u64,
            _ => 0,
        }
    }
}

/// A target: the preload / plain ratio at most `max`; `cost` says it reads as a percentage.
#[derive(Clone, Copy, Debug)]
pub(super) struct Target {
    max: f64,
    cost: bool,
}

impl Target {
    pub(super) fn met(&self, ratio: f64) -> bool {
        ratio <= self.max
    }

    pub(super) fn show(&self) -> String {
        if self.cost {
            format!("≤ {:.0}%", (self.max - 1.0) * 100.0)
        } else {
            format!("≤ {:.2}×", self.max)
        }
    }
}

pub(super) struct Fig {
    pub(super) name: &'static str,
    pub(super) group: Group,
    /// Where the library is in the preload variant.
    pub(super) lib_in: &'static str,
    pub(super) target: Option<Target>,
}

const fn ratio_target(max: f64) -> Option<Target> {
    Some(Target { max, cost: false })
}

const fn cost_target(pct: f64) -> Option<Target> {
    Some(Target {
        max: 1.0 + pct / 100.0,
        cost: true,
    })
}

pub(super) const FIGS: [Fig; 10] = [
    Fig {
        name: "fork+exit",
        group: Group::ForkBare,
        lib_in: "forker (nothing open)",
        target: ratio_target(1.05),
    },
    Fig {
        name: "fork+_exit",
        group: Group::ForkBare,
        lib_in: "forker (nothing open)",
        target: ratio_target(1.05),
    },
    Fig {
        name: "fork+exit, conn held",
        group: Group::ForkHold,
        lib_in: "both ends (ring)",
        target: None,
    },
    Fig {
        name: "fork+_exit, conn held",
        group: Group::ForkHold,
        lib_in: "both ends (ring)",
        target: None,
    },
    Fig {
        name: "short conn → non-member",
        group: Group::ConnOut,
        lib_in: "client (server plain)",
        target: cost_target(3.0),
    },
    Fig {
        name: "short conn → iterative srv",
        group: Group::ConnIn,
        lib_in: "server (client plain)",
        target: cost_target(3.0),
    },
    Fig {
        name: "short conn → fork srv",
        group: Group::ConnFork,
        lib_in: "server (client plain)",
        target: cost_target(3.0),
    },
    Fig {
        name: "fresh process, first conn",
        group: Group::Fresh,
        lib_in: "both ends (ring)",
        target: ratio_target(1.3),
    },
    Fig {
        name: "fresh process, noop",
        group: Group::Noop,
        lib_in: "the process",
        target: None,
    },
    // Issue 16: start-up of a process that loads the library and opens no socket, ≤ 1.1×, as
    // in a script (`sh` forks and execs `/bin/true` over and over, both under the library).
    Fig {
        name: "script: sh → /bin/true",
        group: Group::Script,
        lib_in: "the shell and its children",
        target: ratio_target(1.1),
    },
];

pub(super) fn fig_index(name: &str) -> usize {
    FIGS.iter()
        .position(|f| f.name == name)
        .expect("a figure of FIGS")
}

/// The median (the mean of the middle two for an even count); NaN if empty.
pub(super) fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

pub(super) fn fmt_ratio(r: f64) -> String {
    format!("{r:.3}×")
}

/// A ratio as the cost it means: 1.021 → "+2.1%".
pub(super) fn fmt_cost(r: f64) -> String {
    format!("{:+.1}%", (r - 1.0) * 100.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&[7.0]), 7.0);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn ratios_and_costs_read_as_targets() {
        assert_eq!(fmt_ratio(1.0213), "1.021×");
        assert_eq!(fmt_cost(1.0213), "+2.1%");
        assert_eq!(fmt_cost(0.99), "-1.0%");
        let cost = cost_target(3.0).unwrap();
        assert_eq!(cost.show(), "≤ 3%");
        assert!(cost.met(1.029) && !cost.met(1.031));
        let ratio = ratio_target(1.3).unwrap();
        assert_eq!(ratio.show(), "≤ 1.30×");
        assert!(ratio.met(1.3) && !ratio.met(1.31));
    }

    #[test]
    fn rounds_alternate_which_variant_goes_first() {
        assert_eq!(Variant::order(0), [Variant::Plain, Variant::Preload]);
        assert_eq!(Variant::order(1), [Variant::Preload, Variant::Plain]);
    }
}
