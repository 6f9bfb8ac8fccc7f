//! `osprey bench chart`: SVG charts (plotters) from bench JSON files.
//!
//! - A `bench serve --out` file gives `<stem>-ttft.svg` (time to first token per request; for a
//!   conversation, per turn, with the cached share of the prompt beside it) and `<stem>-latency.svg`
//!   (the distribution of TTFT and inter-token gaps as empirical CDFs); a `long-images` run adds
//!   `<stem>-context.svg` (TTFT and the cached share against the turn's prompt tokens).
//! - `bench experts` reports (one JSON object per budget, one per line or per file, or a `--budgets
//!   --out` sweep) give `experts.svg`:
//!   decode tok/s and expert residency against the budget.

use std::path::{Path, PathBuf};

use plotters::prelude::*;
use serde_json::Value;

use crate::{Error, Result};

fn err(e: impl std::fmt::Display) -> Error {
    Error::Chart(e.to_string())
}

/// Writes the charts of `files` into `out`; returns the paths written.
pub fn charts(files: &[PathBuf], out: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(out).map_err(Error::io(out))?;
    let mut written = Vec::new();
    let mut experts: Vec<(f64, f64, f64)> = Vec::new();
    let mut turns: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(f).map_err(Error::io(f))?;
        let stem = f.file_stem().and_then(|s| s.to_str()).unwrap_or("run").to_string();
        // A serve report is one JSON document; experts reports are JSON lines.
        if let Ok(doc) = serde_json::from_str::<Value>(&text) {
            if let Some(samples) = doc["report"]["samples"].as_array() {
                written.push(ttft_chart(samples, &out.join(format!("{stem}-ttft.svg")))?);
                written.push(latency_chart(samples, &out.join(format!("{stem}-latency.svg")))?);
                if samples.iter().any(|s| s.get("turn").is_some()) {
                    written.push(context_chart(samples, &out.join(format!("{stem}-context.svg")))?);
                }
                let pts = samples
                    .iter()
                    .filter_map(|s| Some((s["index"].as_f64()? + 1.0, s["ttft_s"].as_f64()? * 1e3)))
                    .collect();
                turns.push((stem, pts));
                continue;
            }
            // A `bench experts --budgets --out` sweep.
            if let Some(runs) = doc["runs"].as_array() {
                experts.extend(runs.iter().filter_map(experts_point));
                continue;
            }
        }
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let v: Value = serde_json::from_str(line).map_err(|e| Error::Input(format!("{}: {e}", f.display())))?;
            experts.extend(experts_point(&v));
        }
    }
    if turns.len() > 1 {
        written.push(turns_chart(&turns, &out.join("ttft-runs.svg"))?);
    }
    if !experts.is_empty() {
        experts.sort_by(|a, b| a.0.total_cmp(&b.0));
        written.push(experts_chart(&experts, &out.join("experts.svg"))?);
    }
    if written.is_empty() {
        return Err(Error::Input("no bench serve or bench experts results in the files given".into()));
    }
    Ok(written)
}

/// TTFT per request (turn) of several serve runs in one chart, one line per run (its file name): e.g.
/// one conversation with the prefix cache and without it.
fn turns_chart(runs: &[(String, Vec<(f64, f64)>)], path: &Path) -> Result<PathBuf> {
    let n = runs.iter().flat_map(|r| r.1.iter().map(|p| p.0)).fold(1.0, f64::max);
    let top = runs.iter().flat_map(|r| r.1.iter().map(|p| p.1)).fold(1.0, f64::max) * 1.1;
    let root = SVGBackend::new(path, (720, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut c = ChartBuilder::on(&root)
        .caption("time to first token per request (turn), by run", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(0.5..n + 0.5, 0.0..top)
        .map_err(err)?;
    c.configure_mesh().x_desc("request / turn").y_desc("TTFT (ms)").draw().map_err(err)?;
    for (i, (name, pts)) in runs.iter().enumerate() {
        let colour = Palette99::pick(i).to_rgba();
        c.draw_series(LineSeries::new(pts.iter().copied(), colour))
            .map_err(err)?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], colour));
    }
    c.configure_series_labels().border_style(BLACK).background_style(WHITE).draw().map_err(err)?;
    root.present().map_err(err)?;
    Ok(path.to_path_buf())
}

/// (budget, decode tok/s, residency) of one `bench experts` report.
fn experts_point(v: &Value) -> Option<(f64, f64, f64)> {
    Some((v["budget_fraction"].as_f64()?, v["decode_tok_s"].as_f64()?, v["residency"].as_f64()?))
}

fn ttft_chart(samples: &[Value], path: &Path) -> Result<PathBuf> {
    let pts: Vec<(f64, f64, f64)> = samples
        .iter()
        .filter_map(|s| {
            let ttft = s["ttft_s"].as_f64()? * 1e3;
            let cached = match (s["cached_tokens"].as_f64(), s["prompt_tokens"].as_f64()) {
                (Some(c), Some(p)) if p > 0.0 => c / p,
                _ => 0.0,
            };
            Some((s["index"].as_f64()? + 1.0, ttft, cached))
        })
        .collect();
    let n = pts.len().max(1) as f64;
    let axes = Axes {
        caption: "time to first token per request (turn)",
        x: ("request / turn", 0.5..n + 0.5),
        left: ("TTFT (ms)", "TTFT (ms)"),
        right: ("cached share of the prompt", "cached share"),
        markers: true,
    };
    two_lines(path, &axes, &pts)
}

/// A long-images run: TTFT against the context (the turn's prompt tokens), with the cached share.
fn context_chart(samples: &[Value], path: &Path) -> Result<PathBuf> {
    let pts: Vec<(f64, f64, f64)> = samples
        .iter()
        .filter_map(|s| {
            let (p, c) = (s["prompt_tokens"].as_f64()?, s["cached_tokens"].as_f64().unwrap_or(0.0));
            Some((p, s["ttft_s"].as_f64()? * 1e3, if p > 0.0 { c / p } else { 0.0 }))
        })
        .collect();
    let right = pts.iter().map(|p| p.0).fold(1.0, f64::max) * 1.05;
    let axes = Axes {
        caption: "time to first token against the context (long images)",
        x: ("prompt tokens", 0.0..right),
        left: ("TTFT (ms)", "TTFT (ms)"),
        right: ("cached share of the prompt", "cached share"),
        markers: true,
    };
    two_lines(path, &axes, &pts)
}

fn cdf(mut v: Vec<f64>) -> Vec<(f64, f64)> {
    v.sort_by(f64::total_cmp);
    let n = v.len().max(1) as f64;
    v.into_iter().enumerate().map(|(i, x)| (x, (i + 1) as f64 / n)).collect()
}

fn latency_chart(samples: &[Value], path: &Path) -> Result<PathBuf> {
    let ttft = cdf(samples.iter().filter_map(|s| s["ttft_s"].as_f64()).map(|x| x * 1e3).collect());
    let itl = cdf(samples
        .iter()
        .filter_map(|s| s["itl_s"].as_array())
        .flatten()
        .filter_map(Value::as_f64)
        .map(|x| x * 1e3)
        .collect());
    let right = ttft.iter().chain(&itl).map(|p| p.0).fold(1.0, f64::max) * 1.05;
    let root = SVGBackend::new(path, (720, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut c = ChartBuilder::on(&root)
        .caption("latency distributions (empirical CDF)", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(48)
        .build_cartesian_2d(0.0..right, 0.0..1.0)
        .map_err(err)?;
    c.configure_mesh().x_desc("milliseconds").y_desc("fraction").draw().map_err(err)?;
    for (pts, colour, label) in [(&ttft, BLUE, "time to first token"), (&itl, GREEN, "inter-token gap")] {
        c.draw_series(LineSeries::new(pts.iter().copied(), colour))
            .map_err(err)?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], colour));
    }
    c.configure_series_labels().border_style(BLACK).background_style(WHITE).draw().map_err(err)?;
    root.present().map_err(err)?;
    Ok(path.to_path_buf())
}

fn experts_chart(pts: &[(f64, f64, f64)], path: &Path) -> Result<PathBuf> {
    let axes = Axes {
        caption: "decode speed and expert residency vs expert RAM budget",
        x: ("budget (fraction of expert bytes)", 0.0..1.05),
        left: ("decode tok/s", "decode tok/s"),
        right: ("residency", "residency"),
        markers: false,
    };
    two_lines(path, &axes, pts)
}

/// Axis titles, ranges and series labels of a [`two_lines`] chart.
struct Axes {
    caption: &'static str,
    /// Title and range of x.
    x: (&'static str, std::ops::Range<f64>),
    /// Left axis title and its series' label (range from the data).
    left: (&'static str, &'static str),
    /// Right axis title and its series' label (range 0..1).
    right: (&'static str, &'static str),
    /// Points on the left series.
    markers: bool,
}

/// Two lines over one x: `(x, left, right)` points, the left axis scaled to the data, the right one a
/// fraction in 0..1.
fn two_lines(path: &Path, a: &Axes, pts: &[(f64, f64, f64)]) -> Result<PathBuf> {
    let top = pts.iter().map(|p| p.1).fold(1.0, f64::max) * 1.1;
    let root = SVGBackend::new(path, (720, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut c = ChartBuilder::on(&root)
        .caption(a.caption, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .right_y_label_area_size(56)
        .build_cartesian_2d(a.x.1.clone(), 0.0..top)
        .map_err(err)?
        .set_secondary_coord(a.x.1.clone(), 0.0..1.0);
    c.configure_mesh().x_desc(a.x.0).y_desc(a.left.0).draw().map_err(err)?;
    c.configure_secondary_axes().y_desc(a.right.0).draw().map_err(err)?;
    c.draw_series(LineSeries::new(pts.iter().map(|p| (p.0, p.1)), &BLUE))
        .map_err(err)?
        .label(a.left.1)
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], BLUE));
    if a.markers {
        c.draw_series(pts.iter().map(|p| Circle::new((p.0, p.1), 3, BLUE.filled()))).map_err(err)?;
    }
    c.draw_secondary_series(LineSeries::new(pts.iter().map(|p| (p.0, p.2)), &RED))
        .map_err(err)?
        .label(a.right.1)
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], RED));
    c.configure_series_labels().border_style(BLACK).background_style(WHITE).draw().map_err(err)?;
    root.present().map_err(err)?;
    Ok(path.to_path_buf())
}
