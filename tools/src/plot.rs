//! PNG plot of perplexity against sparsity (plotters, DejaVu Sans from the
//! `dejavu` crate so no system font is needed).

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{anyhow, bail, Result};
use plotters::prelude::*;

use crate::quality::QualityRow;

fn register_font() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // Registration only fails for unparsable font bytes; the bundled font parses.
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular());
    });
}

/// Perplexity against target sparsity, one line per (criterion, predictor),
/// and the dense perplexity as a dashed horizontal line. Written to a
/// temporary file and renamed.
///
/// # Errors
/// No sparse rows; drawing or file errors.
pub fn perplexity_vs_sparsity(rows: &[QualityRow], out: &Path) -> Result<()> {
    register_font();
    let mut lines: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for r in rows.iter().filter(|r| r.predictor != "dense") {
        lines
            .entry(format!("{} / {} ({})", r.criterion, r.predictor, r.quant))
            .or_default()
            .push((100.0 * r.target_sparsity, r.sparse_ppl));
    }
    if lines.is_empty() {
        bail!("no sparse packs to plot: pass packs converted with --calib");
    }
    lines.values_mut().for_each(|v| v.sort_by(|a, b| a.0.total_cmp(&b.0)));
    // One dashed line per distinct dense reference (per FFN type).
    let mut denses: Vec<(String, f64)> = Vec::new();
    for r in rows {
        if !denses.iter().any(|(q, _)| *q == r.quant) {
            denses.push((r.quant.clone(), r.dense_ppl));
        }
    }
    let dense = denses.iter().map(|d| d.1).fold(f64::INFINITY, f64::min);
    let dense_max = denses.iter().map(|d| d.1).fold(dense, f64::max);
    let (x0, x1) = lines.values().flatten().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let ymax = lines.values().flatten().map(|p| p.1).fold(dense_max, f64::max);
    // The encoder picks the format from the extension, so the temporary name ends in .png.
    let name = out.file_name().map_or("plot".into(), |n| n.to_string_lossy().into_owned());
    let tmp = out.with_file_name(format!(".{name}.tmp.png"));
    let drawn = draw(&lines, &denses, (x0, x1, dense, ymax), &tmp, out);
    if drawn.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    drawn?;
    std::fs::rename(&tmp, out).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        anyhow!("cannot write the plot {}: {e}", out.display())
    })
}

/// Checks before any scoring that a plot can be written at `out`:
/// not a directory, parent directory created.
///
/// # Errors
/// `out` is a directory or its directory cannot be created.
pub fn check_path(out: &Path) -> Result<()> {
    if out.is_dir() {
        bail!("--plot {} is a directory; pass a file path such as {}", out.display(), out.join("ppl.png").display());
    }
    if out.extension().is_none_or(|e| !e.eq_ignore_ascii_case("png")) {
        bail!("--plot {} should end in .png (the plot is a PNG image)", out.display());
    }
    crate::output::check_out(out, "--plot", &[], &[])?;
    Ok(())
}

type Lines = BTreeMap<String, Vec<(f64, f64)>>;

fn draw(
    lines: &Lines,
    denses: &[(String, f64)],
    (x0, x1, dense, ymax): (f64, f64, f64, f64),
    tmp: &Path,
    out: &Path,
) -> Result<()> {
    {
        let root = BitMapBackend::new(tmp, (960, 640)).into_drawing_area();
        let err = |e: &dyn std::fmt::Display| anyhow!("plot {}: {e}", out.display());
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let mut chart = ChartBuilder::on(&root)
            .caption("Perplexity vs FFN sparsity (held-out text)", ("sans-serif", 24))
            .margin(16)
            .x_label_area_size(48)
            .y_label_area_size(64)
            .build_cartesian_2d((x0 - 5.0)..(x1 + 5.0), (dense * 0.95)..(ymax * 1.05))
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc("target sparsity (% of FFN neurons inactive)")
            .y_desc("perplexity")
            .draw()
            .map_err(|e| err(&e))?;
        for (q, d) in denses {
            chart
                .draw_series(DashedLineSeries::new(vec![(x0 - 5.0, *d), (x1 + 5.0, *d)], 6, 4, BLACK.stroke_width(1)))
                .map_err(|e| err(&e))?
                .label(format!("dense ({q}) {d:.2}"))
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK));
        }
        for (i, (name, pts)) in lines.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            chart
                .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
                .map_err(|e| err(&e))?
                .label(name.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
            chart.draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled()))).map_err(|e| err(&e))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| err(&e))?;
        root.present().map_err(|e| err(&e))?;
    }
    Ok(())
}
