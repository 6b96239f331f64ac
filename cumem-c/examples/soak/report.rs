//! The soak's figures: what it prints every interval and the verdict.

use std::sync::atomic::Ordering;

use crate::Soak;

/// What a figure counts, and whether it must stay flat.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    /// Bytes (printed in MiB), flat after the first interval.
    Bytes,
    /// Table entries, flat after the first interval.
    Count,
    /// What is in flight at the sample (streams in use, live blocks):
    /// bounded by the work, not expected to stay flat.
    InFlight,
}

/// One sample of the figures.
pub struct Figures(Vec<(&'static str, u64, Kind)>);

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kb = status.lines().find_map(|l| l.strip_prefix("VmRSS:")).map(|v| v.trim().trim_end_matches("kB").trim());
    kb.and_then(|v| v.parse::<u64>().ok()).map_or(0, |kb| kb * 1024)
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
        let (pinned, tables) = (s.mm.pinned_stats(), s.mm.table_sizes());
        let exports = s.mm.device(device).map_or(0, |d| d.exported_blocks());
        let mut raw_streams = 0usize;
        // SAFETY: `raw_streams` is valid for a write.
        let _ = unsafe { cumem_c::cumem_stream_table_size(&mut raw_streams) };
        use Kind::*;
        Figures(vec![
            // Device memory held from the driver: the sync pool's mapped
            // pages, the graph pools and the driver's pools.
            ("reserved", (d.pool.mapped + d.graphs.reserved) as u64 + natives, Bytes),
            ("pinned", pinned.reserved as u64, Bytes),
            ("RSS", rss_bytes(), Bytes),
            ("raw_streams", raw_streams as u64, InFlight),
            ("streams_live", tables.streams_live as u64, InFlight),
            ("streams_retired", tables.streams_retired as u64, Count),
            ("chunks", d.pool.chunks as u64, Count),
            ("free_blocks", d.pool.free_blocks as u64, Count),
            ("live_blocks", d.pool.live_blocks as u64, InFlight),
            ("pinned_chunks", pinned.chunks as u64, Count),
            ("exports", exports as u64, InFlight),
        ])
    }

    fn get(&self, name: &str) -> u64 {
        self.0.iter().find(|f| f.0 == name).map_or(0, |f| f.1)
    }

    pub fn row(&self, t: f64, s: &Soak) -> String {
        let counters = [
            ("ops", &s.ops),
            ("errors", &s.errors),
            ("wrong", &s.wrong),
            ("graphs", &s.graphs),
            ("ipc", &s.ipc_rounds),
        ];
        let mut row: Vec<String> = counters.iter().map(|(n, c)| format!("{n} {}", c.load(Ordering::Relaxed))).collect();
        row.extend(self.0.iter().map(|&(n, v, kind)| match kind {
            Kind::Bytes => format!("{n} {:.1} MiB", mib(v)),
            _ => format!("{n} {v}"),
        }));
        format!("soak: {t:.0} s | {}", row.join(" | "))
    }
}

/// Prints, for each figure, its range after the first interval and whether
/// it stayed within 5% (in-flight counts: its range only); returns the exit
/// code (non-zero on an error, a wrong value or reserved memory not back at
/// its start after release).
pub fn verdict(s: &Soak, samples: &[Figures], after: &Figures) -> i32 {
    // samples[0] is the start; samples[1] the first report (one interval in).
    let steady = if samples.len() > 2 { &samples[1..] } else { samples };
    let mut flat = true;
    for (i, &(name, _, kind)) in samples[0].0.iter().enumerate() {
        let v: Vec<u64> = steady.iter().map(|f| f.0[i].1).collect();
        let (lo, hi) = (*v.iter().min().unwrap(), *v.iter().max().unwrap());
        let spread = if hi == 0 { 0.0 } else { (hi - lo) as f64 / hi as f64 };
        let verdict = match (kind, spread <= 0.05) {
            (Kind::InFlight, _) => "in flight",
            (_, true) => "flat",
            (_, false) => "NOT FLAT",
        };
        flat &= kind == Kind::InFlight || spread <= 0.05;
        let (first, last) = (v[0], v[v.len() - 1]);
        println!(
            "soak: steady {name}: first {first} last {last} min {lo} max {hi} spread {:.1}% {verdict}",
            spread * 100.0
        );
    }
    let (errors, wrong) = (s.errors.load(Ordering::Relaxed), s.wrong.load(Ordering::Relaxed));
    let (start, end) =
        ([samples[0].get("reserved"), samples[0].get("pinned")], [after.get("reserved"), after.get("pinned")]);
    let back = start == end;
    println!(
        "soak: {} ops, {errors} errors, {wrong} wrong values; reserved {:.1} -> {:.1} MiB, pinned {:.1} -> {:.1} MiB \
         after release ({}); figures {}",
        s.ops.load(Ordering::Relaxed),
        mib(start[0]),
        mib(end[0]),
        mib(start[1]),
        mib(end[1]),
        if back { "back at the start" } else { "NOT back at the start" },
        if flat { "flat" } else { "not flat" }
    );
    let pass = errors == 0 && wrong == 0 && back;
    println!("soak: {}", if pass { "PASS" } else { "FAIL" });
    i32::from(!pass)
}
