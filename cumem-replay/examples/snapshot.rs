//! Replays a trace up to its peak of live bytes through the manager's
//! device pool, then draws every pool as a segment map (SVG).
//!
//! ```text
//! cargo run --release -p cumem-replay --example snapshot -- TRACE.csv.gz OUT.svg
//! ```
//!
//! Without arguments it looks for `bert_train.csv.gz` in `gpu-bin/traces/`
//! or `../shared/traces/` and writes `snapshot.svg` into `$OUT` (or the
//! temporary directory).
//!
//! On the host fallback the device pool holds host address space; on a GPU
//! it is real device memory (the sync pool).

use cumem::{MemoryManager, Stream};
use cumem_replay::trace::{Op, Trace};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let default_trace = ["gpu-bin/traces/bert_train.csv.gz", "../shared/traces/bert_train.csv.gz"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .map(String::from);
    let Some(trace_path) = args.next().or(default_trace) else {
        println!("snapshot: skipped, no trace given and none found (usage: snapshot TRACE.csv[.gz] OUT.svg)");
        return Ok(());
    };
    let out = args.next().unwrap_or_else(|| {
        let dir = std::env::var_os("OUT").map_or_else(std::env::temp_dir, std::path::PathBuf::from);
        dir.join("snapshot.svg").display().to_string()
    });
    let trace = Trace::read(&trace_path)?;
    let mm = MemoryManager::global()?;
    println!("snapshot of {} on {}", trace.name, mm.backend());
    // The operation after which the trace's live bytes peak.
    let (mut peak, mut peak_at) = (0usize, 0usize);
    for (i, live) in trace.live_bytes().enumerate() {
        if live > peak {
            (peak, peak_at) = (live, i);
        }
    }
    let stream = Stream::new()?;
    let mut ptrs = vec![0u64; trace.slots];
    for op in &trace.ops[..=peak_at] {
        match *op {
            Op::Allocate { slot, size } => ptrs[slot as usize] = mm.allocate_device_on(size, &stream)?,
            Op::Free { slot } => mm.free_device_on(std::mem::take(&mut ptrs[slot as usize]), &stream)?,
        }
    }
    let snap = mm.memory_snapshot();
    std::fs::write(&out, cumem_replay::snapshot_svg(&snap)?)?;
    for p in &snap.pools {
        println!(
            "{}: {} chunk(s), {} blocks, reserved {} B, in use {} B",
            p.name,
            p.snapshot.chunks.len(),
            p.snapshot.blocks.len(),
            p.stats.reserved,
            p.stats.in_use
        );
    }
    println!("wrote {out} (after operation {peak_at} of {}, {peak} B live)", trace.ops.len());
    for p in ptrs.into_iter().filter(|p| *p != 0) {
        mm.free_device_on(p, &stream)?;
    }
    Ok(())
}
