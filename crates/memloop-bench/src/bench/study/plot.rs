//! One SVG figure per experiment (plotters, SVG backend only): lines over message sizes on a
//! log₂ axis, or grouped bars over named categories.

use crate::error::{fail, CliResult};
use crate::units::fmt_size;
use plotters::prelude::*;
use std::path::Path;

/// A named series of (x, y) points: x is a message size in bytes (line charts) or a category
/// index (bar charts).
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

pub enum XAxis {
    /// Message sizes in bytes, drawn on a log₂ scale.
    Bytes,
    /// Named categories; x is the index.
    Categories(Vec<String>),
}

pub struct Figure {
    pub title: String,
    pub x: XAxis,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
}

fn err<E: std::fmt::Display>(file: &Path) -> impl Fn(E) -> crate::error::CliError + '_ {
    move |e| fail(format!("drawing {}: {e}", file.display()))
}

/// Draws `figs` one above the other into the SVG file `file`.
pub fn draw(figs: &[Figure], file: &Path) -> CliResult<()> {
    let h = 520 * figs.len().max(1) as u32;
    let root = SVGBackend::new(file, (960, h)).into_drawing_area();
    root.fill(&WHITE).map_err(err(file))?;
    let areas = root.split_evenly((figs.len().max(1), 1));
    for (fig, area) in figs.iter().zip(&areas) {
        draw_on(fig, area, file)?;
    }
    root.present().map_err(err(file))?;
    Ok(())
}

fn draw_on(
    fig: &Figure,
    root: &DrawingArea<SVGBackend, plotters::coord::Shift>,
    file: &Path,
) -> CliResult<()> {
    let ymax = fig
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .filter(|v| v.is_finite())
        .fold(0.0f64, f64::max);
    let ymax = if ymax > 0.0 { ymax * 1.12 } else { 1.0 };
    let (x0, x1) = match &fig.x {
        XAxis::Bytes => {
            let xs = fig
                .series
                .iter()
                .flat_map(|s| s.points.iter().map(|p| p.0.max(1.0).log2()));
            let (lo, hi) = xs.fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(x), b.max(x)));
            if lo <= hi {
                (lo - 0.3, hi + 0.3)
            } else {
                (0.0, 1.0)
            }
        }
        XAxis::Categories(c) => (-0.5, c.len().max(1) as f64 - 0.5),
    };
    let mut chart = ChartBuilder::on(root)
        .caption(&fig.title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(80)
        .build_cartesian_2d(x0..x1, 0.0..ymax)
        .map_err(err(file))?;
    let cats = match &fig.x {
        XAxis::Categories(c) => c.clone(),
        XAxis::Bytes => Vec::new(),
    };
    let xfmt = |x: &f64| -> String {
        match fig.x {
            XAxis::Bytes => fmt_size(x.exp2().round() as u64),
            XAxis::Categories(_) => {
                let i = x.round();
                if (x - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < cats.len() {
                    cats[i as usize].clone()
                } else {
                    String::new()
                }
            }
        }
    };
    let xlabels = match &fig.x {
        XAxis::Bytes => ((x1 - x0).ceil() as usize + 1).max(2),
        XAxis::Categories(c) => c.len() + 1,
    };
    chart
        .configure_mesh()
        .x_desc(&fig.x_label)
        .y_desc(&fig.y_label)
        .x_labels(xlabels)
        .x_label_formatter(&xfmt)
        .y_label_formatter(&|y| tick(*y))
        .draw()
        .map_err(err(file))?;
    let n = fig.series.len().max(1) as f64;
    for (i, s) in fig.series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        match fig.x {
            XAxis::Bytes => {
                let pts: Vec<(f64, f64)> = s
                    .points
                    .iter()
                    .map(|&(x, y)| (x.max(1.0).log2(), y))
                    .collect();
                chart
                    .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
                    .map_err(err(file))?
                    .label(&s.name)
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                    });
                chart
                    .draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled())))
                    .map_err(err(file))?;
            }
            XAxis::Categories(_) => {
                let w = 0.8 / n;
                chart
                    .draw_series(s.points.iter().map(|&(x, y)| {
                        let left = x - 0.4 + w * i as f64;
                        Rectangle::new([(left, 0.0), (left + w * 0.9, y)], color.filled())
                    }))
                    .map_err(err(file))?
                    .label(&s.name)
                    .legend(move |(x, y)| {
                        Rectangle::new([(x, y - 5), (x + 14, y + 5)], color.filled())
                    });
            }
        }
    }
    if !fig.series.is_empty() {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperRight)
            .draw()
            .map_err(err(file))?;
    }
    Ok(())
}

/// A y-axis label: integers for large values, a few decimals for small ones.
fn tick(y: f64) -> String {
    if y.abs() >= 100.0 {
        format!("{y:.0}")
    } else if y.abs() >= 1.0 {
        format!("{y:.1}")
    } else {
        format!("{y:.3}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_both_kinds_of_figure() {
        let dir = std::env::temp_dir().join(format!("study-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (k, x) in [
            XAxis::Bytes,
            XAxis::Categories(vec!["a".into(), "b".into()]),
        ]
        .into_iter()
        .enumerate()
        {
            let fig = Figure {
                title: "t".into(),
                x,
                x_label: "x".into(),
                y_label: "y".into(),
                series: vec![Series {
                    name: "s".into(),
                    points: vec![(1.0, 2.0), (64.0, 3.0)],
                }],
            };
            let f = dir.join(format!("{k}.svg"));
            draw(&[fig], &f).unwrap();
            let s = std::fs::read_to_string(&f).unwrap();
            assert!(s.starts_with("<svg") && s.contains("</svg>"), "{s}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
