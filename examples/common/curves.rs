//! Loss curves as a PNG: one line per run, log-scale loss over steps.

use std::path::Path;

type PlotResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Draws `runs` (name, loss per step) into `path`, titled `title`.
pub fn draw_losses(path: &Path, title: &str, runs: &[(&str, &[f32])]) -> PlotResult<()> {
    use plotters::prelude::*;
    super::register_font();
    let finite = runs
        .iter()
        .flat_map(|(_, l)| l.iter().copied())
        .filter(|v| v.is_finite() && *v > 0.0);
    let (lo, hi) = finite.fold((f32::MAX, f32::MIN), |(lo, hi), v| (lo.min(v), hi.max(v)));
    let steps = runs.iter().map(|(_, l)| l.len()).max().unwrap_or(1);
    let root = BitMapBackend::new(path, (800, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0..steps, (lo..hi).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("loss")
        .label_style(("sans-serif", 14))
        .draw()?;
    let colors = [BLUE, RED, GREEN, MAGENTA, BLACK];
    for (i, (name, losses)) in runs.iter().enumerate() {
        let color = colors[i % colors.len()];
        chart
            .draw_series(LineSeries::new(
                losses
                    .iter()
                    .enumerate()
                    .filter(|(_, v)| v.is_finite() && **v > 0.0)
                    .map(|(i, v)| (i, *v)),
                color.stroke_width(2),
            ))?
            .label(*name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()?;
    root.present()?;
    Ok(())
}
