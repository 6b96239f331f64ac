//! `cumem-synth`: writes synthetic traces (see `cumem_replay::synth`) in
//! RMM's log format, gzip-compressed when the file name ends in `.gz`, for
//! replays by other tools (PyTorch's or RMM's, on a GPU machine).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use cumem_replay::synth::{Spec, Workload};

/// Write synthetic allocation traces as RMM log CSV
/// (Thread,Time,Action,Pointer,Size,Stream).
#[derive(Parser, Debug)]
#[command(name = "cumem-synth", version, about)]
struct Args {
    /// Traces to write: `NAME`, `NAME:SEED` or `synth:NAME[:SEED]` (NAME:
    /// pinned_top, kv_cache, moe, two_streams, loop_fixed, loop_change, loop_two,
    /// loop_lengths, loop_depart; SEED defaults to 1).
    #[arg(required_unless_present = "list")]
    specs: Vec<String>,
    /// The output folder; files are named like `synth_kv_cache_s7.csv.gz`.
    #[arg(long, short = 'd', default_value = ".")]
    dir: PathBuf,
    /// Write plain CSV (`.csv`) instead of gzip (`.csv.gz`).
    #[arg(long)]
    plain: bool,
    /// List the workloads and exit.
    #[arg(long)]
    list: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.list {
        for w in Workload::ALL {
            println!("{w}");
        }
        return ExitCode::SUCCESS;
    }
    for text in &args.specs {
        let spec: Spec = match text.parse() {
            Ok(s) => s,
            Err(e) => {
                eprintln!("cumem-synth: {e}");
                return ExitCode::FAILURE;
            }
        };
        let trace = spec.trace();
        let path = args.dir.join(format!("{}.{}", trace.name, if args.plain { "csv" } else { "csv.gz" }));
        if let Err(e) = trace.write(&path) {
            eprintln!("cumem-synth: {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
        println!(
            "{}: {} records, peak live {:.1} MiB, {} stream(s)",
            path.display(),
            trace.records.len(),
            trace.peak_live as f64 / (1 << 20) as f64,
            trace.streams()
        );
    }
    ExitCode::SUCCESS
}
