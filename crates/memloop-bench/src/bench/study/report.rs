//! DIR/report.md and DIR/results.json.

use super::exps::{ALL, SEEDS};
use super::headline::{losses, Line};
use super::lab::Kind;
use super::seeds::ROWS;
use super::{Outcome, Rec};
use crate::error::{CliResult, Context as _};
use crate::units::fmt_size;
use serde_json::json;
use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

pub struct Context {
    pub quick: bool,
    pub only: Option<Vec<u32>>,
    pub repeat: u32,
    pub machine: Vec<(String, String)>,
    pub pinning: String,
    pub dur: Duration,
    pub preload: Option<String>,
    pub unavailable: Vec<(&'static str, String)>,
    pub notes: Vec<(&'static str, String)>,
    pub seconds: f64,
}

fn command(ctx: &Context, id: Option<u32>) -> String {
    let mut c = "sudo memloop bench study".to_owned();
    if ctx.quick {
        c.push_str(" --quick");
    }
    if ctx.repeat != if ctx.quick { 1 } else { 3 } {
        let _ = write!(c, " --repeat {}", ctx.repeat);
    }
    match id {
        // Experiment 9 reads the figures of 1, 3 and 8.
        Some(9) => c.push_str(" --only 1,3,8,9"),
        Some(id) => {
            let _ = write!(c, " --only {id}");
        }
        None => {}
    }
    c + " --out DIR"
}

/// The spread of a figure's rounds, "min–max", when there was more than one.
fn spread(r: &Rec) -> String {
    match (r.rounds, r.min, r.max) {
        (Some(n), Some(lo), Some(hi)) if n > 1 => {
            format!("{}–{} ({n} rounds)", value(lo), value(hi))
        }
        _ => String::new(),
    }
}

/// The headline ratios, then where memloop loses.
fn headline(md: &mut String, lines: &[Line]) {
    if lines.is_empty() {
        return;
    }
    let _ = writeln!(
        md,
        "## Headline\n\nmemloop's figure over the baseline's in this run (above 1: memloop is \
         better).\n\n| figure | ratio | detail |\n| --- | ---: | --- |"
    );
    for l in lines {
        let _ = writeln!(md, "| {} | {:.2}× | {} |", l.figure, l.ratio, l.detail);
    }
    let losses = losses(lines);
    if losses.is_empty() {
        let _ = writeln!(
            md,
            "\nmemloop is behind its baseline (by more than 5 %) nowhere.\n"
        );
        return;
    }
    let _ = writeln!(md, "\nWhere memloop loses (by more than 5 %):\n");
    for l in losses {
        let _ = writeln!(md, "- {}: {:.2}×", l.figure, l.ratio);
    }
    let _ = writeln!(md);
}

fn value(v: f64) -> String {
    if v.abs() >= 1000.0 {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

/// Experiment 9: one row per seed ratio, ours from this run's records.
fn seeds_table(md: &mut String, records: &[Rec]) {
    let _ = writeln!(
        md,
        "| # | paper | paper's setting and numbers | paper's ratio | our pair | our ratio | what differs |\n\
         | ---: | --- | --- | ---: | --- | ---: | --- |"
    );
    for (i, row) in ROWS.iter().enumerate() {
        let ours = row
            .ours(records)
            .map_or("not measured in this run".into(), |v| format!("{v:.3}"));
        let _ = writeln!(
            md,
            "| {} | {} | {} | {:.3} | {} | {} | {} |",
            i + 1,
            row.source,
            row.setting,
            row.paper_ratio(),
            row.ours_pair,
            ours,
            row.differs
        );
    }
    let _ = writeln!(
        md,
        "\nNot reproduced: flood ping and lmbench latencies, netpipe-mpich, the residency \
         study's 10-lookup column (our lookup is per connection or per UDP destination, not per \
         packet), and its UDP rows on shared vs separate cores (experiment 4 places TCP only)."
    );
}

pub fn write(dir: &Path, ctx: &Context, outcomes: &[Outcome], records: &[Rec]) -> CliResult<()> {
    let lines = super::headline::lines(records);
    let mut md = String::new();
    let _ = writeln!(md, "# memloop residency study\n");
    let _ = writeln!(md, "## Machine\n");
    for (k, v) in &ctx.machine {
        let _ = writeln!(md, "- **{k}**: {v}");
    }
    let _ = writeln!(
        md,
        "\n## Run\n\n- command: `{}`\n- {} s per measurement (plus a fifth of that as warm-up), \
         {}{}\n- {}\n- whole run: {:.1} s\n",
        command(ctx, None),
        ctx.dur.as_secs_f64(),
        if ctx.repeat > 1 {
            format!(
                "{} rounds of the whole study one after the other; every figure is the median \
                 of its rounds (spread in the tables and in results.json)",
                ctx.repeat
            )
        } else {
            "one round".to_owned()
        },
        if ctx.quick {
            " (`--quick`: a smoke run, not figures to quote)"
        } else {
            ""
        },
        ctx.pinning,
        ctx.seconds
    );
    headline(&mut md, &lines);
    let _ = writeln!(md, "## Paths\n");
    let _ = writeln!(md, "| path | what | state |\n| --- | --- | --- |");
    for k in [
        Kind::Memloop,
        Kind::Veth,
        Kind::Loopback,
        Kind::Unix,
        Kind::VethPreload,
    ] {
        let state = ctx
            .unavailable
            .iter()
            .find(|(n, _)| *n == k.name())
            .map(|(_, w)| w.clone())
            .or_else(|| {
                matches!(k, Kind::Memloop | Kind::VethPreload)
                    .then(|| ctx.preload.clone())
                    .flatten()
            })
            .unwrap_or_else(|| "measured".into());
        let _ = writeln!(md, "| {} | {} | {} |", k.name(), k.what(), state);
    }
    if !ctx.notes.is_empty() {
        let _ = writeln!(md, "\nNotes:\n");
        for (p, n) in &ctx.notes {
            let _ = writeln!(md, "- {p}: {n}");
        }
    }
    let mut sorted: Vec<&Outcome> = outcomes.iter().collect();
    sorted.sort_by_key(|o| o.id);
    for o in sorted {
        let _ = writeln!(md, "\n## {}. {}\n", o.id, o.title);
        if let Some(e) = ALL.iter().find(|e| e.id == o.id) {
            let _ = writeln!(md, "{}\n", e.about);
        } else if o.id == SEEDS.0 {
            let _ = writeln!(md, "{}\n", SEEDS.2);
        }
        if o.status != "measured" {
            let _ = writeln!(md, "**{}**\n", o.status);
        }
        if let Some(p) = &o.plot {
            let _ = writeln!(md, "![experiment {}]({p})\n", o.id);
        }
        if o.status != "not yet measured" {
            let _ = writeln!(
                md,
                "Reproduce: `{}` ({:.1} s in this run)\n",
                command(ctx, Some(o.id)),
                o.seconds
            );
        }
        let mine: Vec<&Rec> = records.iter().filter(|r| r.experiment == o.id).collect();
        if mine.is_empty() {
            continue;
        }
        if o.id == SEEDS.0 {
            seeds_table(&mut md, records);
            continue;
        }
        let _ = writeln!(
            md,
            "| test | path | size | variant | value | unit | spread | note |\n| --- | --- | ---: | --- | ---: | --- | --- | --- |"
        );
        for r in mine {
            let size = if o.id == 3 && r.test == "crr" {
                "-".to_string()
            } else if o.id == super::vpipe::ID && r.test.starts_with("fairness") {
                format!("{} tenants", r.size)
            } else if o.id == super::vlink::ID
                && crate::bench::link::PER_SIDE.contains(&r.test.as_str())
            {
                format!("{} sides", r.size)
            } else {
                fmt_size(r.size)
            };
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                r.test,
                r.path,
                size,
                r.variant.as_deref().unwrap_or(""),
                value(r.value),
                r.unit,
                spread(r),
                r.note.as_deref().unwrap_or("")
            );
        }
    }
    let file = dir.join("report.md");
    std::fs::write(&file, md).context(format!("writing {}", file.display()))?;

    let machine: serde_json::Map<String, serde_json::Value> = ctx
        .machine
        .iter()
        .map(|(k, v)| (k.clone(), json!(v)))
        .collect();
    let v = json!({
        "study": "memloop residency study",
        "quick": ctx.quick,
        "only": ctx.only,
        "machine": machine,
        "duration_s": ctx.dur.as_secs_f64(),
        "rounds": ctx.repeat,
        "headline": lines,
        "pinning": ctx.pinning,
        "unavailable": ctx.unavailable.iter().map(|(p, w)| json!({"path": p, "reason": w})).collect::<Vec<_>>(),
        "notes": ctx.notes.iter().map(|(p, w)| json!({"path": p, "note": w})).collect::<Vec<_>>(),
        "experiments": outcomes,
        "records": records,
    });
    let file = dir.join("results.json");
    std::fs::write(&file, serde_json::to_string_pretty(&v)? + "\n")
        .context(format!("writing {}", file.display()))
}
