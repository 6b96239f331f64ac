//! A memory snapshot drawn as a segment map (SVG): per pool a heading with
//! its figures, one bar per chunk, its blocks coloured live / cached / free.

use cumem::manager::human_bytes;
use cumem::pool::BlockState;
use cumem::{Error, MemorySnapshot, Result};
use plotters::prelude::*;

const LIVE: RGBColor = RGBColor(214, 39, 40);
const CACHED: RGBColor = RGBColor(255, 160, 40);
const FREE: RGBColor = RGBColor(160, 210, 160);
/// The most chunks drawn per pool (the rest are counted in a line).
const MAX_ROWS: usize = 48;

fn draw_err<E: std::fmt::Display>(e: E) -> Error {
    Error::InvalidState(format!("drawing the segment map: {e}"))
}

/// The segment map as an SVG document: per pool a heading with its
/// figures, then one bar per chunk (up to 48 per pool), its blocks laid
/// along it in address order and coloured by state (live red, cached
/// orange, free green), each bar labelled with the chunk's size.
///
/// # Errors
/// [`Error::InvalidState`] when drawing fails.
pub fn snapshot_svg(snapshot: &MemorySnapshot) -> Result<String> {
    const W: i32 = 1000;
    const BAR: i32 = 16;
    const ROW: i32 = 22;
    const HEAD: i32 = 40;
    const LEFT: i32 = 110;
    let rows: usize = snapshot.pools.iter().map(|p| p.snapshot.chunks.len().min(MAX_ROWS) + 1).sum();
    let height = 40 + HEAD * snapshot.pools.len() as i32 + ROW * rows as i32;
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (W as u32, height as u32)).into_drawing_area();
        root.fill(&WHITE).map_err(draw_err)?;
        let text = |s: String, x: i32, y: i32, size: u32| Text::new(s, (x, y), ("sans-serif", size).into_font());
        root.draw(&text("cumem memory snapshot: live (red), cached (orange), free (green)".into(), 10, 8, 16))
            .map_err(draw_err)?;
        let mut y = 40;
        for pool in &snapshot.pools {
            let s = &pool.stats;
            let head = format!(
                "{} ({}): {} chunk(s), reserved {}, in use {}, cached {}, largest free {}",
                pool.name,
                pool.upstream,
                pool.snapshot.chunks.len(),
                human_bytes(s.reserved),
                human_bytes(s.in_use),
                human_bytes(s.cached),
                human_bytes(s.largest_free)
            );
            root.draw(&text(head, 10, y + 12, 14)).map_err(draw_err)?;
            y += HEAD;
            for (i, chunk) in pool.snapshot.chunks.iter().enumerate().take(MAX_ROWS) {
                root.draw(&text(human_bytes(chunk.size), 10, y + 2, 12)).map_err(draw_err)?;
                let span = (W - LEFT - 10) as f64;
                let x_of = |addr: usize| LEFT + ((addr - chunk.addr) as f64 / chunk.size as f64 * span) as i32;
                for b in pool.snapshot.blocks.iter().filter(|b| b.chunk == i) {
                    let color = match b.state {
                        BlockState::Live => LIVE,
                        BlockState::Cached => CACHED,
                        BlockState::Free => FREE,
                    };
                    let (x0, x1) = (x_of(b.addr), x_of(b.addr + b.size).max(x_of(b.addr) + 1));
                    root.draw(&Rectangle::new([(x0, y), (x1, y + BAR)], color.filled())).map_err(draw_err)?;
                    root.draw(&Rectangle::new([(x0, y), (x1, y + BAR)], WHITE.stroke_width(1))).map_err(draw_err)?;
                }
                y += ROW;
            }
            let more = pool.snapshot.chunks.len().saturating_sub(MAX_ROWS);
            if more > 0 {
                root.draw(&text(format!("... and {more} more chunk(s)"), 10, y + 2, 12)).map_err(draw_err)?;
            }
            y += ROW;
        }
        root.present().map_err(draw_err)?;
    }
    Ok(out)
}
