//! Replays the shared PyTorch traces (`../shared/traces/*.csv.gz` or
//! `gpu-bin/traces/`, or the files in `CUMEM_TRACES`, a directory or a
//! comma-separated list) through
//! the host target and the simulated device range (`sim_device`), and
//! through every GPU target when a GPU is present.
//! Only the allocation and free calls are timed (each replay on a fresh
//! pool). A plain summary of the same replays, ns/op and peak reserved /
//! peak live, follows criterion's output.

use std::path::PathBuf;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion};
use cumem::cuda::{driver_status, DriverStatus};
use cumem::Config;
use cumem_replay::replay::{self, Pass, ReplayReport, Target};
use cumem_replay::trace::Trace;

/// The trace files: `CUMEM_TRACES` (folders or files, comma-separated),
/// else the first folder that exists of gpu-bin/traces (the GPU suite's
/// copy) and ../shared/traces from here or from the crate.
fn trace_paths() -> Vec<PathBuf> {
    let spec = std::env::var("CUMEM_TRACES").unwrap_or_else(|_| {
        let candidates =
            ["gpu-bin/traces", "../shared/traces", concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/traces")];
        candidates.into_iter().find(|d| std::path::Path::new(d).is_dir()).unwrap_or_default().to_string()
    });
    let is_trace = |p: &PathBuf| p.is_file() && [".csv.gz", ".csv"].iter().any(|e| p.to_string_lossy().ends_with(e));
    let mut paths: Vec<PathBuf> = spec
        .split(',')
        .map(PathBuf::from)
        .flat_map(|item| match std::fs::read_dir(&item) {
            Ok(dir) => dir.filter_map(|e| e.ok().map(|e| e.path())).collect(),
            Err(_) => vec![item],
        })
        .filter(is_trace)
        .collect();
    paths.sort();
    paths
}

fn main() {
    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(200))
        .measurement_time(Duration::from_secs(1))
        .without_plots()
        .configure_from_args();
    let traces: Vec<Trace> = trace_paths()
        .iter()
        .filter_map(|p| Trace::read(p).map_err(|e| println!("replay bench: skipping {}: {e}", p.display())).ok())
        .collect();
    if traces.is_empty() {
        println!("replay bench: no traces found (set CUMEM_TRACES to a directory or files)");
        return;
    }
    let mut targets: Vec<Target> = match driver_status() {
        DriverStatus::Available { .. } => Target::ALL.to_vec(),
        DriverStatus::Unavailable(why) => {
            println!("replay bench: no GPU ({why}); only the host and simulated targets run");
            vec![Target::Host]
        }
    };
    // The pool over a simulated device range (expandable by default).
    targets.push(Target::Simulated);
    let base = Config::new();
    let mut summary = Vec::new();
    for trace in &traces {
        let mut g = c.benchmark_group(format!("replay/{}", trace.name));
        g.throughput(criterion::Throughput::Elements(trace.operations() as u64));
        // A replay takes milliseconds (raw cuMemAlloc: about a second):
        // flat sampling runs the same few replays per sample.
        g.sampling_mode(criterion::SamplingMode::Flat);
        for &target in &targets {
            let (mut failed, mut measured) = (None, Vec::new());
            g.bench_function(BenchmarkId::from_parameter(target.name()), |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        match replay::replay_once(trace, target, &base, Pass::default()) {
                            Ok(m) => {
                                total += Duration::from_nanos(m.elapsed_ns);
                                measured.push(m);
                            }
                            Err(e) => failed = Some(e.to_string()),
                        }
                    }
                    total
                })
            });
            match failed {
                Some(e) => println!("replay bench: {} on {target} failed: {e}", trace.name),
                // Nothing measured: criterion's filter left it out.
                None if measured.is_empty() => {}
                None => summary.push(ReplayReport::new(trace, target, Pass::default(), &measured)),
            }
        }
        g.finish();
    }
    c.final_summary();
    println!();
    println!("replay summary (median of criterion's replays; ratio = peak reserved / peak live)");
    for r in &summary {
        println!(
            "{:<16} {:<20} {:>6} ops {:>9.1} ns/op  live {:>12} B (trace {:>12} B)  reserved {:>14}  ratio {}",
            r.trace,
            r.target,
            r.operations,
            r.ns_per_op,
            r.last.peak_live,
            r.trace_peak_live,
            r.last.peak_reserved.map_or_else(|| "n/a".to_string(), |b| format!("{b} B")),
            r.ratio.map_or_else(|| "n/a".to_string(), |x| format!("{x:.3}"))
        );
    }
}
