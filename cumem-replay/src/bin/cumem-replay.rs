//! `cumem-replay`: replays allocation traces (RMM's log CSV, gzip or plain)
//! through cumem's device modes, the host fallback and the raw driver calls,
//! and prints time per operation and fragmentation side by side.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use cumem::cuda::{driver_status, DriverStatus};
use cumem::Config;
use cumem_replay::replay::{self, Calls, PageFloor, Pass, ReplayReport, Target};
use cumem_replay::synth::Spec;
use cumem_replay::trace::Trace;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

/// Replay allocation traces: ns per operation, peak reserved / peak live.
#[derive(Parser, Debug)]
#[command(name = "cumem-replay", version, about)]
struct Args {
    /// Trace files (RMM log CSV: Thread,Time,Action,Pointer,Size,Stream),
    /// gzip-compressed or plain, or synthetic traces `synth:NAME[:SEED]`
    /// (NAME: pinned_top, kv_cache, moe, two_streams, loop_fixed, loop_change, loop_two, loop_lengths, loop_depart; SEED defaults to 1).
    #[arg(required = true)]
    traces: Vec<PathBuf>,
    /// Targets, comma-separated (`all` names every one but sim_device): sync_pool, async_stream_ordered,
    /// cuda_async_pool, host, raw_cumemalloc, raw_cumemallocasync; also
    /// sim_device (cumem's pool over a simulated 2 MiB-granular device
    /// address range that grows in place when expandable; not in `all`).
    #[arg(long, short, default_value = "all")]
    target: String,
    /// Replays per trace and target; the median time is reported.
    #[arg(long, short, default_value_t = 5)]
    repeat: usize,
    /// Warm replays: each fresh allocator first replays the trace once
    /// untimed, so the timed pass sees a pool that already holds its memory.
    #[arg(long)]
    warm: bool,
    /// Base configuration for the cumem targets, in `CUMEM_CONF` syntax
    /// (for instance `min_chunk=20MiB,expandable=false`); the target sets
    /// the mode and backend.
    #[arg(long, default_value = "")]
    conf: String,
    /// Replay every operation on one stream, ignoring the trace's `Stream`
    /// column (how the peers were measured). By default each stream of the
    /// trace replays on a CUDA stream of its own (`sim_device`: a stream
    /// tag of its own), and reuses across streams wait as they would in the
    /// program (counted and timed in the `waits` columns).
    #[arg(long)]
    one_stream: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// No progress bar.
    #[arg(long)]
    no_progress: bool,
    /// Also draw live and reserved bytes over each trace, one panel per
    /// trace and a line per target, into this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// Points per line in the plot.
    #[arg(long, default_value_t = 400)]
    plot_samples: usize,
    /// What fits, instead of the replays: the smallest simulated device
    /// (2 MiB steps) on which a cold `sim_device` replay of each trace
    /// fails no allocation, against its peak of live bytes (bisection:
    /// about a dozen replays a trace).
    #[arg(long)]
    fit: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cumem-replay: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> cumem::Result<()> {
    let base: Config = args.conf.parse()?;
    if args.fit {
        let traces = args.traces.iter().map(|p| read_trace(p)).collect::<cumem::Result<Vec<_>>>()?;
        return print_fits(&traces, &base, args);
    }
    let mut targets = Target::parse_list(&args.target)?;
    let mut skipped = Vec::new();
    let backend = match driver_status() {
        DriverStatus::Available { devices } => format!("CUDA ({devices} device(s))"),
        DriverStatus::Unavailable(why) => {
            let gpu: Vec<&str> = targets.iter().filter(|t| t.needs_gpu()).map(|t| t.name()).collect();
            if !gpu.is_empty() {
                let msg = format!("no GPU ({why}): skipping {}", gpu.join(", "));
                eprintln!("cumem-replay: {msg}");
                skipped.push(msg);
            }
            targets.retain(|t| !t.needs_gpu());
            format!("host fallback ({why})")
        }
    };
    let traces = args
        .traces
        .iter()
        .map(|p| read_trace(p).map_err(|e| cumem::Error::InvalidState(format!("{}: {e}", p.display()))))
        .collect::<cumem::Result<Vec<_>>>()?;
    let total = (traces.len() * targets.len() * args.repeat.max(1)) as u64;
    let bar = if args.no_progress || args.json { ProgressBar::hidden() } else { ProgressBar::new(total) };
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} replays {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let pass = Pass { warm: args.warm, one_stream: args.one_stream };
    let mut results = Vec::new();
    for trace in &traces {
        for &target in &targets {
            bar.set_message(format!("{} on {}", trace.name, target));
            let mut measured = Vec::new();
            for _ in 0..args.repeat.max(1) {
                match replay::replay_once(trace, target, &base, pass) {
                    Ok(m) => measured.push(m),
                    Err(e) => {
                        let msg = format!("{} on {}: {e}", trace.name, target);
                        bar.suspend(|| eprintln!("cumem-replay: {msg}"));
                        skipped.push(msg);
                        break;
                    }
                }
                bar.inc(1);
            }
            if !measured.is_empty() {
                results.push(ReplayReport::new(trace, target, pass, &measured));
            }
        }
    }
    bar.finish_and_clear();
    if let Some(path) = &args.plot {
        plot(path, &traces, &targets, &base, args)?;
    }
    // Exact best fit over one growing range, 2 MiB pages: the memory of
    // never unmapping, and the floor of unmapping free pages.
    let floors: Vec<_> = traces.iter().map(|t| replay::page_floor(t, 2 << 20)).collect();
    if args.json {
        let infos: Vec<_> = traces
            .iter()
            .zip(&args.traces)
            .zip(&floors)
            .map(|((t, path), floor)| {
                json!({
                    "name": t.name, "path": path.display().to_string(), "records": t.records.len(),
                    "operations": t.operations(), "streams": t.streams(), "peak_live": t.peak_live,
                    "skipped_frees": t.skipped_frees, "failures": t.failures,
                    "duplicate_allocations": t.duplicate_allocations, "zero_sizes": t.zero_sizes,
                    "live_at_end": t.live_at_end, "page_floor": floor,
                })
            })
            .collect();
        let out = json!({
            "backend": backend, "repeat": args.repeat.max(1), "warm": args.warm, "one_stream": args.one_stream,
            "conf": args.conf, "traces": infos, "results": results, "skipped": skipped,
        });
        let text = serde_json::to_string_pretty(&out).map_err(|e| cumem::Error::InvalidState(e.to_string()))?;
        println!("{text}");
    } else {
        print_table(&backend, &traces, &floors, &results, args);
    }
    Ok(())
}

/// `--fit`: per trace, the smallest simulated device it fits on.
fn print_fits(traces: &[Trace], base: &Config, args: &Args) -> cumem::Result<()> {
    let mut rows = Vec::new();
    for trace in traces {
        let (fits, unbounded) = replay::smallest_fit(trace, base, args.one_stream)?;
        let live = trace.peak_live.max(1) as f64;
        rows.push(json!({
            "trace": trace.name, "peak_live": trace.peak_live, "unbounded": unbounded, "fits": fits,
            "unbounded_ratio": unbounded as f64 / live, "fits_ratio": fits as f64 / live,
        }));
        if !args.json {
            println!(
                "{:<28} peak live {:>10} MiB  unbounded {:>10} MiB ({:.3})  fits in {:>10} MiB ({:.3})",
                trace.name,
                mib(trace.peak_live),
                mib(unbounded),
                unbounded as f64 / live,
                mib(fits),
                fits as f64 / live
            );
        }
    }
    if args.json {
        let out = json!({ "conf": args.conf, "one_stream": args.one_stream, "fits": rows });
        let text = serde_json::to_string_pretty(&out).map_err(|e| cumem::Error::InvalidState(e.to_string()))?;
        println!("{text}");
    }
    Ok(())
}

/// Reads the trace file at `path`, or makes the `synth:NAME[:SEED]` it names.
fn read_trace(path: &std::path::Path) -> cumem::Result<Trace> {
    match path.to_str().and_then(Spec::from_arg) {
        Some(spec) => Ok(spec?.trace()),
        None => Trace::read(path),
    }
}

/// Writes the `--plot` picture.
fn plot(path: &std::path::Path, traces: &[Trace], targets: &[Target], base: &Config, args: &Args) -> cumem::Result<()> {
    let mut panels = Vec::new();
    for trace in traces {
        let (panel, skipped) = replay::plot::panel(trace, targets, base, args.plot_samples);
        for s in skipped {
            eprintln!("cumem-replay: plot: {s}");
        }
        panels.push(panel);
    }
    let svg = replay::plot::render_svg(&panels)?;
    std::fs::write(path, svg).map_err(|e| cumem::Error::InvalidState(format!("{}: {e}", path.display())))?;
    if !args.json {
        eprintln!("cumem-replay: wrote {} ({} panel(s))", path.display(), panels.len());
    }
    Ok(())
}

fn mib(bytes: usize) -> String {
    format!("{:.1}", bytes as f64 / (1 << 20) as f64)
}

fn print_table(backend: &str, traces: &[Trace], floors: &[Option<PageFloor>], results: &[ReplayReport], args: &Args) {
    println!(
        "cumem-replay on {backend}; median of {} {} replay(s), {}; conf '{}'",
        args.repeat.max(1),
        if args.warm { "warm" } else { "cold (fresh allocator, growth timed)" },
        if args.one_stream { "one stream" } else { "the trace's streams" },
        args.conf
    );
    for (i, floor) in traces.iter().zip(floors) {
        println!(
            "trace {}: {} records, {} operations on {} stream(s), peak live {} MiB ({} B); skipped frees {}, \
             allocate failures {}, duplicate allocations {}, zero sizes {}, live at end {}",
            i.name,
            i.records.len(),
            i.operations(),
            i.streams(),
            mib(i.peak_live),
            i.peak_live,
            i.skipped_frees,
            i.failures,
            i.duplicate_allocations,
            i.zero_sizes,
            i.live_at_end
        );
        if let Some(f) = floor.filter(|_| i.peak_live > 0) {
            let ratio = |b: usize| b as f64 / i.peak_live as f64;
            println!(
                "  page floor of {} (exact best fit over one growing range, {} MiB pages): never unmapped {:.3}, \
                 touched pages {:.3} (peak reserved / peak live)",
                i.name,
                f.page >> 20,
                ratio(f.top),
                ratio(f.touched)
            );
        }
    }
    println!();
    // Each column: its header, its width (negative: aligned left), its cell.
    let na = || "n/a".to_string();
    let calls = |r: &ReplayReport, f: fn(&Calls) -> String| r.last.driver_calls.as_ref().map_or_else(na, f);
    type Column<'a> = (&'a str, isize, &'a dyn Fn(&ReplayReport) -> String);
    let columns: [Column; 18] = [
        ("trace", -16, &|r| r.trace.clone()),
        ("target", -20, &|r| r.target.clone()),
        ("ops", 7, &|r| r.operations.to_string()),
        ("ns/op", 10, &|r| format!("{:.1}", r.ns_per_op)),
        ("min ns/op", 10, &|r| format!("{:.1}", r.ns_per_op_min)),
        ("live MiB", 12, &|r| mib(r.last.peak_live)),
        ("trace MiB", 12, &|r| mib(r.trace_peak_live)),
        ("reserved MiB", 14, &|r| r.last.peak_reserved.map_or_else(na, mib)),
        ("ratio", 7, &|r| r.ratio.map_or_else(na, |x| format!("{x:.3}"))),
        ("fail", 5, &|r| r.last.failures.to_string()),
        // Driver map and unmap calls in the timed pass (growth and moves).
        ("map/unmap", 13, &|r| match (r.last.map_calls, r.last.unmap_calls) {
            (Some(m), Some(u)) => format!("{m}/{u}"),
            _ => na(),
        }),
        // Driver calls that moved memory in the timed pass, made by the
        // allocating thread (and its time in them) and by the mapper.
        ("drv/alloc", 9, &|r| calls(r, |c| c.allocating.total.to_string())),
        ("drv ms", 8, &|r| calls(r, |c| format!("{:.1}", c.allocating.total_ns as f64 / 1e6))),
        ("drv/bg", 9, &|r| calls(r, |c| c.background.total.to_string())),
        ("streams", 7, &|r| r.streams.to_string()),
        ("waits", 6, &|r| r.last.stream_waits.to_string()),
        ("wait ns", 9, &|r| r.last.stream_wait_ns.to_string()),
        ("elided", 7, &|r| r.last.stream_waits_elided.to_string()),
    ];
    let line = |cell: &dyn Fn(usize) -> String| {
        let cells = columns.iter().enumerate().map(|(i, &(_, w, _))| match w {
            w if w < 0 => format!("{:<1$}", cell(i), w.unsigned_abs()),
            w => format!("{:>1$}", cell(i), w as usize),
        });
        println!("{}", cells.collect::<Vec<_>>().join(" "));
    };
    line(&|i| columns[i].0.to_string());
    for r in results {
        line(&|i| (columns[i].2)(r));
    }
    // Ratios against the raw driver calls measured in this run.
    for trace in traces {
        let of = |name: &str| results.iter().find(|r| r.trace == trace.name && r.target == name);
        for raw in ["raw_cumemalloc", "raw_cumemallocasync"] {
            let Some(base) = of(raw) else { continue };
            let line: Vec<String> = results
                .iter()
                .filter(|r| r.trace == trace.name && !r.target.starts_with("raw_"))
                .map(|r| format!("{} {:.3}x", r.target, r.ns_per_op / base.ns_per_op))
                .collect();
            if !line.is_empty() {
                println!("{}: time vs {raw}: {}", trace.name, line.join(", "));
            }
        }
    }
}
