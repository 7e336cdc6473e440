//! `memloop bench study [--quick] [--out DIR] [--only N,..]`: the residency study reproduced on
//! every path in one run — message sizes, mixed local:remote flows, the cost of interception,
//! core placement, ring sizes, CPU cost, connection setup, real programs (redis-benchmark,
//! pgbench, nginx with ab), and the seed papers' ratios next to ours — written as
//! DIR/report.md, DIR/results.json and one SVG figure per experiment.
//!
//! Experiments 1-7 use the unmodified socket programs of `memloop bench tcp`
//! (`tcp-peer`) in network-namespace domains, so the figures are those any TCP program
//! would see; experiment 8 runs the Debian programs themselves (or says they are unavailable).

mod exps;
mod headline;
mod lab;
mod plot;
pub(crate) mod progs;
mod report;
mod rounds;
mod seeds;
mod vblk;
mod vlink;
mod vms;
mod vpipe;

use crate::error::{fail, CliResult, Context};
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args)]
pub struct StudyArgs {
    /// Short measurements (0.1 s each, fewer sizes): the whole study within 2 minutes (CI).
    #[arg(long)]
    quick: bool,
    /// Where report.md, results.json and the figures go.
    #[arg(long, value_name = "DIR", default_value = "study-results")]
    out: PathBuf,
    /// Only these experiments (numbers, comma separated).
    #[arg(long, value_delimiter = ',', value_name = "N")]
    only: Option<Vec<u32>>,
    /// Rounds of the whole study; every figure is the median of its rounds (default 3, 1 with
    /// --quick).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=20))]
    repeat: Option<u32>,
}

/// One figure of results.json.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Rec {
    pub experiment: u32,
    pub test: String,
    pub path: String,
    /// Message size in bytes (or the varied size: ring bytes, endpoint count).
    pub size: u64,
    pub unit: String,
    pub value: f64,
    /// What else this figure depends on (placement, mix, endpoint count, end).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub variant: Option<String>,
    /// Remote cost: % change of the preloaded run against the plain runs around it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub change_pct: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// With --repeat > 1: how many rounds measured this figure, and their extremes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rounds: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max: Option<f64>,
}

impl Rec {
    pub fn new(exp: u32, test: &str, path: &str, size: u64, unit: &str, value: f64) -> Rec {
        Rec {
            experiment: exp,
            test: test.into(),
            path: path.into(),
            size,
            unit: unit.into(),
            value,
            variant: None,
            change_pct: None,
            note: None,
            rounds: None,
            min: None,
            max: None,
        }
    }

    pub fn variant(mut self, v: impl Into<String>) -> Rec {
        self.variant = Some(v.into());
        self
    }
}

/// The outcome of one experiment.
#[derive(Serialize, Clone, Debug)]
pub struct Outcome {
    pub id: u32,
    pub title: &'static str,
    /// "measured", "failed: …", "unavailable: …" (8), "not measured: …" (9 without 1, 3, 8).
    pub status: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub plot: Option<String>,
    pub seconds: f64,
}

pub fn run(a: &StudyArgs) -> CliResult<()> {
    let t0 = Instant::now();
    std::fs::create_dir_all(&a.out).context(format!("creating {}", a.out.display()))?;
    let wanted = |id: u32| a.only.as_ref().is_none_or(|o| o.contains(&id));
    let exps: Vec<&exps::Exp> = exps::ALL.iter().filter(|e| wanted(e.id)).collect();
    let repeat = a.repeat.unwrap_or(if a.quick { 1 } else { 3 });
    let mut lab = lab::Lab::up(a.quick)?;
    let steps: u64 = exps.iter().map(|e| (e.steps)(&lab)).sum::<u64>().max(1);
    let bar = ProgressBar::new(steps * u64::from(repeat));
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} [{elapsed_precise}, ~{eta} left] {msg}")
            .expect("valid template"),
    );
    // Per experiment: its records of every round, and how its rounds went.
    let mut per_exp: Vec<(Vec<Vec<Rec>>, Vec<String>, f64)> =
        exps.iter().map(|_| (Vec::new(), Vec::new(), 0.0)).collect();
    for round in 1..=repeat {
        for (e, acc) in exps.iter().zip(per_exp.iter_mut()) {
            let start = Instant::now();
            bar.set_message(format!("round {round}/{repeat}: {}. {}", e.id, e.title));
            let mut mine = Vec::new();
            let status = match (e.run)(&mut lab, &bar, &mut mine) {
                Ok(()) if mine.is_empty() => "no figures (its paths are unavailable)".to_owned(),
                Ok(()) => "measured".into(),
                Err(err) if err.to_string().starts_with("unavailable") => err.to_string(),
                Err(err) if repeat > 1 => format!("failed in round {round}: {err}"),
                Err(err) => format!("failed: {err}"),
            };
            acc.0.push(mine);
            acc.1.push(status);
            acc.2 += start.elapsed().as_secs_f64();
        }
    }
    let mut records: Vec<Rec> = Vec::new();
    let mut outcomes = Vec::new();
    for (e, (rounds, statuses, seconds)) in exps.iter().zip(per_exp) {
        let mine = rounds::merge(&rounds);
        // The worst round speaks for the experiment: a failure is never hidden by a median.
        let status = statuses
            .iter()
            .find(|s| s.starts_with("failed"))
            .or_else(|| statuses.iter().find(|s| *s != "measured"))
            .cloned()
            .unwrap_or_else(|| "measured".into());
        let plot = if mine.is_empty() {
            None
        } else {
            let name = format!("exp{}-{}.svg", e.id, e.slug);
            plot::draw(&(e.figures)(&mine), &a.out.join(&name))?;
            Some(name)
        };
        records.extend(mine);
        outcomes.push(Outcome {
            id: e.id,
            title: e.title,
            status,
            plot,
            seconds,
        });
    }
    bar.finish_and_clear();
    if wanted(exps::SEEDS.0) {
        let start = Instant::now();
        let mine = seeds::records(&records);
        let (status, plot) = if mine.is_empty() {
            (
                "not measured: needs experiments 1, 3 and 8 in the same run (--only 1,3,8,9)"
                    .to_owned(),
                None,
            )
        } else {
            let name = "exp9-seeds.svg".to_owned();
            plot::draw(&exps::fig9(&mine), &a.out.join(&name))?;
            ("measured".to_owned(), Some(name))
        };
        records.extend(mine);
        outcomes.push(Outcome {
            id: exps::SEEDS.0,
            title: exps::SEEDS.1,
            status,
            plot,
            seconds: start.elapsed().as_secs_f64(),
        });
    }
    let ctx = report::Context {
        quick: a.quick,
        only: a.only.clone(),
        repeat,
        machine: lab::machine(),
        pinning: lab.pinning(),
        dur: lab.dur,
        preload: lab.preload.clone().err(),
        unavailable: lab.unavailable.clone(),
        notes: unique(&lab.notes),
        seconds: t0.elapsed().as_secs_f64(),
    };
    drop(lab);
    report::write(&a.out, &ctx, &outcomes, &records)?;
    println!(
        "memloop bench study: {} figures from {} experiments in {:.1} s; report in {}",
        records.len(),
        outcomes.iter().filter(|o| o.status == "measured").count(),
        t0.elapsed().as_secs_f64(),
        a.out.join("report.md").display()
    );
    let failed: Vec<String> = outcomes
        .iter()
        .filter(|o| o.status.starts_with("failed"))
        .map(|o| format!("experiment {}: {}", o.id, o.status))
        .collect();
    if failed.is_empty() {
        Ok(())
    } else {
        Err(fail(failed.join("; ")))
    }
}

/// Notes in first-seen order, each once (rounds repeat them).
fn unique(notes: &[(&'static str, String)]) -> Vec<(&'static str, String)> {
    let mut seen = std::collections::HashSet::new();
    notes.iter().filter(|n| seen.insert(*n)).cloned().collect()
}
