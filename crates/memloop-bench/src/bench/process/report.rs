//! What `memloop bench process` collects and prints: the region's counter activity, the
//! results of all rounds, the table, the ring verification and the JSON file.

use super::figures::{fig_index, fmt_cost, fmt_ratio, median, Fig, Group, Variant, FIGS, GROUPS};
use super::{Config, ProcessArgs};
use crate::bench::report::{align, fmt_num, write_results, Record};
use crate::error::CliResult;
use memloop::registry::{counter_name, COUNTER_RING_CONNS};
use serde_json::{json, Value};
use std::time::Duration;

/// What the region's counters did during one group's runs of one variant.
#[derive(Default, Clone)]
pub(super) struct Activity {
    runs: u64,
    deltas: Vec<u64>,
}

impl Activity {
    pub(super) fn add(&mut self, before: &[u64], after: &[u64]) {
        self.runs += 1;
        if self.deltas.len() < after.len() {
            self.deltas.resize(after.len(), 0);
        }
        for (i, (a, b)) in after.iter().zip(before).enumerate() {
            self.deltas[i] += a.saturating_sub(*b);
        }
    }

    fn rings(&self) -> u64 {
        self.deltas.get(COUNTER_RING_CONNS).copied().unwrap_or(0)
    }

    /// The counters that moved, by name.
    fn moved(&self) -> Vec<(String, u64)> {
        self.deltas
            .iter()
            .enumerate()
            .filter(|(_, &d)| d > 0)
            .map(|(i, &d)| (counter_name(i).map_or(format!("#{i}"), String::from), d))
            .collect()
    }
}

/// The results: per figure and variant the value of each round; per group and variant what
/// the region's counters did; per group why its preload runs stopped, if they did.
pub(super) struct Results {
    pub(super) samples: Vec<[Vec<f64>; 2]>,
    pub(super) activity: Vec<[Activity; 2]>,
    pub(super) failed: Vec<Option<String>>,
}

/// One figure's medians and verdict.
struct Row {
    fig: &'static Fig,
    plain: Option<f64>,
    preload: Option<f64>,
}

impl Row {
    fn ratio(&self) -> Option<f64> {
        match (self.plain, self.preload) {
            (Some(p), Some(l)) if p > 0.0 => Some(l / p),
            _ => None,
        }
    }

    fn met(&self) -> Option<bool> {
        Some(self.fig.target?.met(self.ratio()?))
    }
}

fn rows(res: &Results) -> Vec<Row> {
    FIGS.iter()
        .zip(&res.samples)
        .map(|(fig, s)| {
            let m = |v: &Vec<f64>| (!v.is_empty()).then(|| median(v));
            Row {
                fig,
                plain: m(&s[0]),
                preload: m(&s[1]),
            }
        })
        .collect()
}

fn table(rows: &[Row]) -> String {
    let head = [
        "figure",
        "library in",
        "unit",
        "plain",
        "preload",
        "ratio",
        "cost",
        "target",
        "",
    ];
    let mut lines: Vec<Vec<String>> = vec![head.iter().map(|s| s.to_string()).collect()];
    for r in rows {
        let num = |v: Option<f64>| v.map_or("-".into(), fmt_num);
        let ratio = r.ratio();
        let verdict = match r.met() {
            Some(true) => "ok",
            Some(false) => "MISSED",
            None => "",
        };
        lines.push(vec![
            r.fig.name.into(),
            r.fig.lib_in.into(),
            "µs".into(),
            num(r.plain),
            num(r.preload),
            ratio.map_or("-".into(), fmt_ratio),
            ratio.map_or("-".into(), fmt_cost),
            r.fig.target.map_or("-".into(), |t| t.show()),
            verdict.into(),
        ]);
    }
    align(&lines)
}

/// What the region's counters say about group `g`'s runs; a warning where a ring was expected
/// and not used (or used where none could be).
fn verification(g: Group, act: &[Activity; 2], cfg: &Config) -> String {
    let (plain, pre) = (&act[0], &act[1]);
    let moved = |a: &Activity| {
        a.moved()
            .iter()
            .map(|(n, d)| format!("{n} +{d}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let expected = g.rings_per_run(cfg) * pre.runs;
    let mut s = if pre.runs == 0 {
        "no preload run".to_string()
    } else if expected > 0 && pre.rings() < expected {
        format!(
            "WARNING: the ring was not used: {} ring connection(s) in {} preload run(s), \
             expected {expected}",
            pre.rings(),
            pre.runs
        )
    } else if expected == 0 && pre.rings() > 0 {
        format!(
            "WARNING: unexpected ring connections ({}) where no ring can be used",
            pre.rings()
        )
    } else if expected > 0 {
        format!(
            "ring verified: {} ring connection(s) in {} preload run(s)",
            pre.rings(),
            pre.runs
        )
    } else {
        "no ring expected, none used".to_string()
    };
    let m = moved(pre);
    if !m.is_empty() {
        s += &format!("; region counters in the preload runs: {m}");
    }
    let m = moved(plain);
    if !m.is_empty() {
        s += &format!("; WARNING: the plain runs moved region counters: {m}");
    }
    s
}

pub(super) fn report(
    res: &Results,
    cfg: &Config,
    a: &ProcessArgs,
    region: &str,
    elapsed: Duration,
) -> CliResult<()> {
    println!(
        "memloop bench process: {} round(s) (plain and preload interleaved, alternating which \
         goes first), medians of the rounds; per run {} forks per loop, {} short connections \
         ({} to the fork-per-connection server; mean per connection), {} fresh processes \
         (median spawn → exit); 127.0.0.1, region {region}; ratio = preload / plain (> 1: the \
         library costs); {:.0} s",
        cfg.rounds,
        cfg.forks,
        cfg.conns,
        cfg.fork_conns,
        cfg.spawns,
        elapsed.as_secs_f64()
    );
    println!();
    let rows = rows(res);
    print!("{}", table(&rows));
    println!();
    let ver: Vec<(Group, String)> = GROUPS
        .iter()
        .zip(&res.activity)
        .map(|(&g, act)| (g, verification(g, act, cfg)))
        .collect();
    for ((g, v), failed) in ver.iter().zip(&res.failed) {
        println!("  {:<51} {v}", format!("{}:", g.label()));
        if let Some(e) = failed {
            println!("  {:<51} FAILED, preload runs stopped: {e}", "");
        }
    }
    let val = |name: &str| {
        let r = &rows[fig_index(name)];
        Some((r.plain?, r.preload?))
    };
    if let (Some((op, ol)), Some((np, nl))) =
        (val("fresh process, first conn"), val("fresh process, noop"))
    {
        println!();
        println!(
            "Fresh process: the library adds {:+.0} µs to spawn → first connection → exit, of \
             which {:+.0} µs load and exit alone (noop); joining the region and the first ring \
             connection: {:+.0} µs",
            ol - op,
            nl - np,
            (ol - op) - (nl - np)
        );
    }
    let with_target: Vec<&Row> = rows.iter().filter(|r| r.met().is_some()).collect();
    let missed: Vec<&str> = with_target
        .iter()
        .filter(|r| r.met() == Some(false))
        .map(|r| r.fig.name)
        .collect();
    println!(
        "Targets: {} of {} met{}",
        with_target.len() - missed.len(),
        with_target.len(),
        if missed.is_empty() {
            String::new()
        } else {
            format!("; missed: {}", missed.join(", "))
        }
    );
    if let Some(file) = &a.json {
        let records: Vec<Record> = rows
            .iter()
            .flat_map(|r| {
                let note = ver
                    .iter()
                    .find(|(g, _)| *g == r.fig.group)
                    .map(|(_, v)| v.clone());
                [(Variant::Plain, r.plain), (Variant::Preload, r.preload)]
                    .into_iter()
                    .filter_map(move |(v, x)| {
                        let mut rec = Record::new(r.fig.name, v.name(), 0, "us", x?);
                        rec.note = (v == Variant::Preload).then(|| note.clone()).flatten();
                        Some(rec)
                    })
            })
            .collect();
        let figures: Vec<Value> = rows
            .iter()
            .zip(&res.samples)
            .map(|(r, s)| {
                json!({
                    "name": r.fig.name,
                    "library_in": r.fig.lib_in,
                    "unit": "us",
                    "plain": r.plain,
                    "preload": r.preload,
                    "ratio": r.ratio(),
                    "cost_pct": r.ratio().map(|x| (x - 1.0) * 100.0),
                    "target": r.fig.target.map(|t| t.show()),
                    "met": r.met(),
                    "rounds": { "plain": s[0], "preload": s[1] },
                })
            })
            .collect();
        let groups: Vec<Value> = GROUPS
            .iter()
            .zip(&res.activity)
            .zip(&ver)
            .zip(&res.failed)
            .map(|(((g, act), (_, v)), failed)| {
                let counters = |a: &Activity| {
                    Value::Object(a.moved().into_iter().map(|(n, d)| (n, d.into())).collect())
                };
                json!({
                    "group": g.label(),
                    "verification": v,
                    "failed": failed,
                    "plain": { "runs": act[0].runs, "counters": counters(&act[0]) },
                    "preload": { "runs": act[1].runs, "counters": counters(&act[1]) },
                })
            })
            .collect();
        let v = json!({
            "bench": "process",
            "config": {
                "rounds": cfg.rounds,
                "forks_per_loop": cfg.forks,
                "conns_per_run": cfg.conns,
                "fork_server_conns_per_run": cfg.fork_conns,
                "spawns_per_run": cfg.spawns,
                "order": "plain, preload; preload, plain; … (alternating per round)",
                "region": region,
                "elapsed_s": elapsed.as_secs_f64(),
            },
            "figures": figures,
            "groups": groups,
            "records": records,
        });
        write_results(&v, file)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_ring_is_a_warning() {
        let cfg = Config::from_args(&ProcessArgs {
            quick: true,
            json: None,
            repeat: None,
            region: None,
        });
        let mut pre = Activity::default();
        let zero = vec![0u64; COUNTER_RING_CONNS + 1];
        pre.add(&zero, &zero);
        let act = [Activity::default(), pre.clone()];
        assert!(verification(Group::ForkHold, &act, &cfg).starts_with("WARNING"));
        assert!(verification(Group::ConnOut, &act, &cfg).starts_with("no ring expected"));
        let mut one = zero.clone();
        one[COUNTER_RING_CONNS] = 1;
        let mut pre = Activity::default();
        pre.add(&zero, &one);
        let act = [Activity::default(), pre];
        assert!(verification(Group::ForkHold, &act, &cfg).starts_with("ring verified"));
        assert!(verification(Group::ConnIn, &act, &cfg).starts_with("WARNING"));
    }
}
