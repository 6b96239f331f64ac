//! The memory summary table and the shutdown report.

use std::fmt::{self, Write as _};

use super::MemoryManager;
use crate::device::TagState;
use crate::error::PoolKind;
use crate::pool::{LiveBlock, PoolStats};

/// Formats a byte count for people (`1.50 MiB`).
pub fn human_bytes(bytes: usize) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.2} {}", UNITS[unit])
    }
}

/// An allocation still live at shutdown.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveAllocation {
    /// The pool it belongs to.
    pub pool: PoolKind,
    /// Its address.
    pub addr: usize,
    /// Its size (rounded to 256 B).
    pub size: usize,
    /// The size asked for.
    pub requested: usize,
    /// Where it was allocated (function and line), when
    /// `Config::track_allocations` is on.
    pub site: Option<String>,
    /// The device it is on (`None` for pinned memory).
    pub device: Option<usize>,
}

/// What [`MemoryManager::shutdown`] found still live.
///
/// # Examples
/// ```
/// let mm = cumem::MemoryManager::new(cumem::Config::new())?;
/// let p = mm.allocate_pinned(100)?;
/// let report = mm.shutdown()?;
/// assert_eq!(report.live_count, 1);
/// mm.free_pinned(p.as_ptr())?;
/// # Ok::<(), cumem::Error>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShutdownReport {
    /// Each live allocation.
    pub live: Vec<LiveAllocation>,
    /// How many allocations are live.
    pub live_count: usize,
    /// Their bytes (block sizes).
    pub live_bytes: usize,
    /// Bytes returned to the driver by this shutdown.
    pub released_bytes: usize,
}

impl ShutdownReport {
    pub(crate) fn push(&mut self, pool: PoolKind, device: Option<usize>, block: LiveBlock, site: Option<String>) {
        self.live_count += 1;
        self.live_bytes += block.size;
        let (addr, size, requested) = (block.addr, block.size, block.requested);
        self.live.push(LiveAllocation { pool, addr, size, requested, site, device });
    }

    /// Whether nothing was live.
    pub fn is_clean(&self) -> bool {
        self.live_count == 0
    }
}

impl fmt::Display for ShutdownReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "cumem shutdown: released {}, {} allocation(s) still live ({})",
            human_bytes(self.released_bytes),
            self.live_count,
            human_bytes(self.live_bytes)
        )?;
        for a in self.live.iter().take(20) {
            let pool = match a.device {
                Some(d) => format!("{} {d}", a.pool),
                None => a.pool.to_string(),
            };
            write!(
                f,
                "  {:>9} {:#014x} {:>12} (asked {})",
                pool,
                a.addr,
                human_bytes(a.size),
                human_bytes(a.requested)
            )?;
            match &a.site {
                Some(site) => writeln!(f, " allocated in {site}")?,
                None => writeln!(f)?,
            }
        }
        if self.live.len() > 20 {
            writeln!(f, "  ... and {} more", self.live.len() - 20)?;
        }
        Ok(())
    }
}

fn row(out: &mut String, name: &str, s: &PoolStats) {
    let _ = writeln!(
        out,
        "| {name:<16} | {:>11} | {:>11} | {:>11} | {:>11} | {:>7} | {:>7} | {:>11} | {:>9} | {:>9} | {:>5}/{:<5} | {:>5.3} |",
        human_bytes(s.in_use),
        human_bytes(s.peak_in_use),
        // Physical memory: with page remapping less than the address space.
        human_bytes(s.mapped),
        human_bytes(s.peak_mapped),
        s.live_blocks,
        s.free_blocks,
        human_bytes(s.largest_free),
        s.allocations,
        s.frees,
        s.upstream_allocs,
        s.upstream_frees,
        s.fragmentation(),
    );
}

pub(super) fn render(mm: &MemoryManager) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "cumem memory summary: backend {}", mm.backend());
    let _ = writeln!(
        out,
        "| {:<16} | {:>11} | {:>11} | {:>11} | {:>11} | {:>7} | {:>7} | {:>11} | {:>9} | {:>9} | {:>11} | {:>5} |",
        "pool",
        "in use",
        "peak in use",
        "reserved",
        "peak resvd",
        "live",
        "free",
        "largest free",
        "allocs",
        "frees",
        "chunks +/-",
        "frag"
    );
    let _ = writeln!(out, "|{}|", "-".repeat(150));
    row(&mut out, "pinned", &mm.pinned_stats());
    if let Some(s) = mm.managed_stats() {
        row(&mut out, "managed", &s);
    }
    let tags = mm.tag_usage();
    for d in mm.initialised_devices() {
        let st = d.stats();
        row(&mut out, &format!("device {} pool", d.ordinal()), &st.pool);
        for u in tags.iter().filter(|u| u.device == d.ordinal()) {
            // A memory tag's pool: its own row, and where its memory is.
            let name: String = u.name.chars().take(12).collect();
            row(&mut out, &format!("tag {name}"), &u.pool);
            if u.state != TagState::Awake || u.offloaded > 0 {
                let _ = writeln!(
                    out,
                    "| device {} tag {}: {}, {} offloaded to pinned memory",
                    d.ordinal(),
                    u.name,
                    u.state,
                    human_bytes(u.offloaded)
                );
            }
        }
        let a = &st.stream_ordered;
        if a.allocations > 0 {
            let _ = writeln!(
                out,
                "| device {} async  | {:>11} | {:>11} | live {:>6} | allocs {:>9} | frees {:>9} | oom retries {}",
                d.ordinal(),
                human_bytes(a.in_use),
                human_bytes(a.peak_in_use),
                a.live,
                a.allocations,
                a.frees,
                a.oom_retries
            );
        }
        for (name, attrs) in [("native pool", st.native_pool), ("default pool", st.default_pool)] {
            if let Some(p) = attrs {
                let _ = writeln!(
                    out,
                    "| device {} {name}: reserved {} (high {}), used {} (high {}), release threshold {}",
                    d.ordinal(),
                    human_bytes(p.reserved_current as usize),
                    human_bytes(p.reserved_high as usize),
                    human_bytes(p.used_current as usize),
                    human_bytes(p.used_high as usize),
                    if p.release_threshold == u64::MAX {
                        "max".to_string()
                    } else {
                        human_bytes(p.release_threshold as usize)
                    }
                );
            }
        }
        let g = &st.graphs;
        if g.pools > 0 {
            let _ = writeln!(
                out,
                "| device {} graphs: {} private pool(s), reserved {} (peak {}), in use {}, held for graphs {}",
                d.ordinal(),
                g.pools,
                human_bytes(g.reserved),
                human_bytes(g.peak_reserved),
                human_bytes(g.in_use),
                human_bytes(g.held)
            );
        }
        let peers = if d.context().is_some() { crate::cuda::peers_of(d.ordinal()) } else { Vec::new() };
        let peers = if peers.is_empty() {
            "none".to_string()
        } else {
            peers.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(", ")
        };
        let _ = writeln!(
            out,
            "device {}: mode {} (requested {}), upstream {}, OOM retries {}, devices with peer access: {peers}",
            d.ordinal(),
            d.effective_mode(),
            d.requested_mode(),
            d.pool().upstream().name(),
            st.pool.oom_retries
        );
    }
    if mm.is_shut_down() {
        let _ = writeln!(out, "(shut down)");
    }
    out
}
