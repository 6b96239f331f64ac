//! The soak's figures: what it prints every interval and the verdict.

use std::sync::atomic::Ordering;

use crate::Soak;

/// One sample of the figures that must stay flat.
#[derive(Clone)]
pub struct Figures {
    /// Device memory cumem holds from the driver (physical): the sync
    /// pool's mapped pages, the graph pools and the driver's pools.
    pub reserved: u64,
    /// The sync pool's address space (its chunks).
    pub pool_reserved: u64,
    /// The sync pool's mapped pages.
    pub mapped: u64,
    /// The pinned pool's chunks.
    pub pinned: u64,
    /// The process's resident host memory (`VmRSS`).
    pub rss: u64,
    /// cumem's internal tables: (name, entries).
    pub tables: Vec<(&'static str, u64)>,
}

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

impl Figures {
    pub fn now(s: &Soak) -> Figures {
        let device = s.mm.config().device;
        let d = s.mm.device_stats(device).expect("the device's figures");
        let natives: u64 =
            [d.native_pool.as_ref(), d.default_pool.as_ref()].iter().flatten().map(|a| a.reserved_current).sum();
        let pinned = s.mm.pinned_stats();
        Figures {
            reserved: (d.pool.mapped + d.graphs.reserved) as u64 + natives,
            pool_reserved: d.pool.reserved as u64,
            mapped: d.pool.mapped as u64,
            pinned: pinned.reserved as u64,
            rss: rss_bytes(),
            tables: tables(s, &d.pool, &pinned),
        }
    }

    pub fn header() -> String {
        "soak: t(s) | ops | errors | wrong | threads | streams | graphs | ipc | reserved MiB | pool MiB | mapped MiB \
         | pinned MiB | RSS MiB | tables"
            .into()
    }

    pub fn row(&self, t: f64, s: &Soak) -> String {
        format!(
            "soak: {t:.0} | {} | {} | {} | {} | {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {}",
            s.ops.load(Ordering::Relaxed),
            s.errors.load(Ordering::Relaxed),
            s.wrong.load(Ordering::Relaxed),
            s.threads_started.load(Ordering::Relaxed),
            s.streams_made.load(Ordering::Relaxed),
            s.graphs_made.load(Ordering::Relaxed),
            s.ipc_rounds.load(Ordering::Relaxed),
            mib(self.reserved),
            mib(self.pool_reserved),
            mib(self.mapped),
            mib(self.pinned),
            mib(self.rss),
            self.tables.iter().map(|(n, v)| format!("{n}={v}")).collect::<Vec<_>>().join(" "),
        )
    }

    pub fn describe(&self) -> String {
        format!(
            "reserved {:.1} MiB (pool address space {:.1} MiB, mapped {:.1} MiB), pinned {:.1} MiB, RSS {:.1} MiB",
            mib(self.reserved),
            mib(self.pool_reserved),
            mib(self.mapped),
            mib(self.pinned),
            mib(self.rss)
        )
    }
}

/// The sizes of cumem's internal tables that the public API shows.
fn tables(s: &Soak, pool: &cumem::pool::PoolStats, pinned: &cumem::pool::PoolStats) -> Vec<(&'static str, u64)> {
    let device = s.mm.config().device;
    let exported = s.mm.device(device).map(|d| d.exported_blocks()).unwrap_or(0);
    let t = s.mm.table_sizes();
    let mut raw_streams = 0usize;
    // SAFETY: `raw_streams` is valid for a write.
    let _ = unsafe { cumem_c::cumem_stream_table_size(&mut raw_streams) };
    vec![
        ("raw_streams", raw_streams as u64),
        ("streams_live", t.streams_live as u64),
        ("streams_retired", t.streams_retired as u64),
        ("chunks", pool.chunks as u64),
        ("free_blocks", pool.free_blocks as u64),
        ("live_blocks", pool.live_blocks as u64),
        ("pinned_chunks", pinned.chunks as u64),
        ("exports", exported as u64),
    ]
}

/// Counts of what is in flight at the moment of the sample (streams in
/// use, live blocks): bounded by the work, not expected to stay within 5%.
const IN_FLIGHT: [&str; 4] = ["raw_streams", "streams_live", "live_blocks", "exports"];

/// Prints, for each figure, its range after the first interval and whether
/// it stayed within 5% (in-flight counts: its range only); returns the exit
/// code (non-zero on an error, a wrong value or reserved memory not back at
/// its start after release).
pub fn verdict(s: &Soak, start: &Figures, samples: &[Figures], after: &Figures) -> i32 {
    // samples[0] is the start; samples[1] the first report (one interval in).
    let steady = if samples.len() > 2 { &samples[1..] } else { samples };
    let mut flat = true;
    let mut series: Vec<(String, Vec<u64>, bool)> = vec![
        ("reserved".into(), steady.iter().map(|f| f.reserved).collect(), true),
        ("RSS".into(), steady.iter().map(|f| f.rss).collect(), true),
        ("pinned".into(), steady.iter().map(|f| f.pinned).collect(), true),
    ];
    for (i, (name, _)) in steady[0].tables.iter().enumerate() {
        let v = steady.iter().map(|f| f.tables[i].1).collect();
        series.push((format!("table {name}"), v, !IN_FLIGHT.contains(name)));
    }
    for (name, v, held) in &series {
        let (lo, hi) = (*v.iter().min().unwrap(), *v.iter().max().unwrap());
        let spread = if hi == 0 { 0.0 } else { (hi - lo) as f64 / hi as f64 };
        let verdict = match (held, spread <= 0.05) {
            (false, _) => "in flight",
            (true, true) => "flat",
            (true, false) => "NOT FLAT",
        };
        flat &= !held || spread <= 0.05;
        println!(
            "soak: steady {name}: first {} last {} min {lo} max {hi} spread {:.1}% {verdict}",
            v[0],
            v[v.len() - 1],
            spread * 100.0
        );
    }
    let errors = s.errors.load(Ordering::Relaxed);
    let wrong = s.wrong.load(Ordering::Relaxed);
    let back = after.reserved == start.reserved && after.pinned == start.pinned;
    println!(
        "soak: {} ops, {errors} errors, {wrong} wrong values; reserved {:.1} -> {:.1} MiB, pinned {:.1} -> {:.1} MiB \
         after release ({}); figures {}",
        s.ops.load(Ordering::Relaxed),
        mib(start.reserved),
        mib(after.reserved),
        mib(start.pinned),
        mib(after.pinned),
        if back { "back at the start" } else { "NOT back at the start" },
        if flat { "flat" } else { "not flat" }
    );
    let pass = errors == 0 && wrong == 0 && back;
    println!("soak: {}", if pass { "PASS" } else { "FAIL" });
    i32::from(!pass)
}
