//! Pictures of replays: live and reserved bytes over a trace, one panel per
//! trace, one line per target (`cumem-replay --plot FILE.svg`).
//!
//! The live line is the trace's own demand (the sum of the requested sizes
//! of live allocations after each operation); each target adds the bytes
//! it holds from the driver (reserved) at the same points: the pool's
//! `reserved` for cumem's sync pool, the host fallback and the simulated
//! device, the native pool's `CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT` for
//! the stream-ordered modes. The raw driver targets report no reserved
//! figure and are left out (with a reason).

use plotters::prelude::*;

use super::{fresh_mode_pool, run_ops, AddressRange, Target};
use crate::trace::Trace;
use cumem::pool::{Pool, StreamTag, BLOCK_ALIGN};
use cumem::Stream;
use cumem::{BackendChoice, Config, MemoryManager};
use cumem::{Error, Result};

/// One line of a panel: `(operation index, bytes)` points.
///
/// # Examples
/// See [`render_svg`].
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// The legend's text ("live (trace)", "reserved: sync_pool", ...).
    pub name: String,
    /// The points, in operation order.
    pub points: Vec<(usize, usize)>,
}

/// One trace's panel.
///
/// # Examples
/// See [`render_svg`].
#[derive(Debug, Clone, PartialEq)]
pub struct Panel {
    /// The trace's name (the panel's caption).
    pub trace: String,
    /// The live line first, then one reserved line per target.
    pub series: Vec<Series>,
}

/// The operation indices at which a trace of `ops` operations is sampled
/// (about `samples` of them, always the last).
fn sample_points(ops: usize, samples: usize) -> impl Fn(usize) -> bool {
    let step = (ops / samples.max(1)).max(1);
    move |i| i % step == 0 || i + 1 == ops
}

/// The trace's live bytes after each sampled operation.
fn live_series(trace: &Trace, samples: usize) -> Series {
    let take = sample_points(trace.ops.len(), samples);
    let points = trace.live_bytes().enumerate().filter(|&(i, _)| take(i)).collect();
    Series { name: "live (trace)".into(), points }
}

/// Replays `trace` through `target`, reading `reserved()` at each sample.
fn replay_sampled(
    trace: &Trace,
    samples: usize,
    mut alloc: impl FnMut(usize) -> Option<u64>,
    mut free: impl FnMut(u64),
    reserved: impl Fn() -> usize,
) -> Vec<(usize, usize)> {
    let take = sample_points(trace.ops.len(), samples);
    let points = std::cell::RefCell::new(Vec::new());
    let sample = |i| take(i).then(|| points.borrow_mut().push((i, reserved())));
    let mut ptrs = vec![0u64; trace.slots];
    let allocate = |i, size| {
        let p = alloc(size);
        sample(i);
        p
    };
    run_ops(trace, &mut ptrs, allocate, |i, p| {
        free(p);
        sample(i);
        true
    });
    ptrs.into_iter().filter(|p| *p != 0).for_each(free);
    points.into_inner()
}

/// The reserved line of one target.
///
/// # Errors
/// [`Error::NeedsGpu`] for a GPU target without a GPU,
/// [`Error::InvalidState`] for the raw targets (nothing to read), and
/// errors creating the manager, stream or pool.
pub fn reserved_series(trace: &Trace, target: Target, base: &Config, samples: usize) -> Result<Series> {
    if target.needs_gpu() && cumem::cuda::driver_status().devices() == 0 {
        return Err(Error::NeedsGpu("this replay target"));
    }
    let points = match target {
        Target::RawCuMemAlloc | Target::RawCuMemAllocAsync => {
            return Err(Error::InvalidState(format!("{target}: the driver reports no reserved bytes to plot")));
        }
        Target::Simulated => {
            let pool = Pool::new(AddressRange::new(), base.device_pool_config());
            replay_sampled(
                trace,
                samples,
                |size| pool.allocate(size, BLOCK_ALIGN).ok().map(|a| a.addr as u64),
                |p| drop(pool.deallocate(p as usize, StreamTag::NONE)),
                || pool.stats().reserved,
            )
        }
        Target::Host | Target::Mode(_) => {
            let config = match target {
                Target::Mode(m) => base.clone().backend(BackendChoice::Auto).mode(m),
                _ => base.clone().backend(BackendChoice::Host),
            };
            let ordinal = config.device;
            let mm = MemoryManager::new(config)?;
            let dev = mm.default_device()?;
            let mode = dev.effective_mode();
            let stream = match dev.context() {
                Some(_) => Some(Stream::new_on(ordinal)?),
                None => None,
            };
            fresh_mode_pool(dev, mode)?;
            let points = replay_sampled(
                trace,
                samples,
                |size| match &stream {
                    Some(s) => mm.allocate_device_on(size, s).ok(),
                    None => mm.allocate_device(size).ok(),
                },
                |p| {
                    let _ = match &stream {
                        Some(s) => mm.free_device_on(p, s),
                        None => mm.free_device(p),
                    };
                },
                || dev.stats().mode_memory(mode).reserved,
            );
            if let Some(s) = &stream {
                s.synchronize()?;
            }
            mm.release_cached()?;
            points
        }
    };
    Ok(Series { name: format!("reserved: {target}"), points })
}

/// A panel for `trace`: its live line and the reserved line of every
/// target that has one; targets without one are listed with the reason.
pub fn panel(trace: &Trace, targets: &[Target], base: &Config, samples: usize) -> (Panel, Vec<String>) {
    let mut series = vec![live_series(trace, samples)];
    let mut skipped = Vec::new();
    for &t in targets {
        match reserved_series(trace, t, base, samples) {
            Ok(s) => series.push(s),
            Err(e) => skipped.push(format!("{} on {t}: {e}", trace.name)),
        }
    }
    (Panel { trace: trace.name.clone(), series }, skipped)
}

const COLORS: [RGBColor; 8] = [
    RGBColor(0, 0, 0),
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(23, 190, 207),
];

fn plot_err<E: std::fmt::Display>(e: E) -> Error {
    Error::InvalidState(format!("drawing the plot: {e}"))
}

/// The panels as one SVG document: a chart per trace, MiB over operations.
///
/// # Errors
/// [`Error::InvalidState`] when drawing fails.
///
/// # Examples
/// ```
/// use cumem_replay::replay::plot::{render_svg, Panel, Series};
/// let p = Panel { trace: "t".into(), series: vec![Series { name: "live (trace)".into(), points: vec![(0, 1 << 20), (1, 0)] }] };
/// let svg = render_svg(&[p])?;
/// assert!(svg.starts_with("<svg") && svg.contains("live (trace)"));
/// # Ok::<(), cumem::Error>(())
/// ```
pub fn render_svg(panels: &[Panel]) -> Result<String> {
    let mut out = String::new();
    {
        let height = 360 * panels.len().max(1) as u32;
        let root = SVGBackend::with_string(&mut out, (1000, height)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err)?;
        let areas = root.split_evenly((panels.len().max(1), 1));
        for (panel, area) in panels.iter().zip(areas) {
            let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
            let max_x = panel.series.iter().flat_map(|s| s.points.iter().map(|p| p.0)).max().unwrap_or(0) + 1;
            let max_y = panel.series.iter().flat_map(|s| s.points.iter().map(|p| mib(p.1))).fold(1.0, f64::max);
            let mut chart = ChartBuilder::on(&area)
                .caption(format!("{}: live and reserved MiB", panel.trace), ("sans-serif", 18))
                .margin(12)
                .x_label_area_size(36)
                .y_label_area_size(64)
                .build_cartesian_2d(0..max_x, 0.0..max_y * 1.08)
                .map_err(plot_err)?;
            chart.configure_mesh().x_desc("operation").y_desc("MiB").draw().map_err(plot_err)?;
            for (i, s) in panel.series.iter().enumerate() {
                let color = COLORS[i % COLORS.len()];
                let width = if i == 0 { 2 } else { 1 };
                chart
                    .draw_series(LineSeries::new(s.points.iter().map(|&(x, y)| (x, mib(y))), color.stroke_width(width)))
                    .map_err(plot_err)?
                    .label(s.name.clone())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
            }
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperLeft)
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .draw()
                .map_err(plot_err)?;
        }
        root.present().map_err(plot_err)?;
    }
    Ok(out)
}
