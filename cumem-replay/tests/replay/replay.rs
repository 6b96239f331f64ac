//! The event log, the trace reader and the replay engine, end to end.

use std::path::PathBuf;

use cumem::{BackendChoice, Config, DeviceAllocatorMode, MemoryManager};
use cumem_replay::replay::{self, Pass, Target};
use cumem_replay::trace::{Action, Trace};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

fn temp_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("cumem-test-{}-{name}", std::process::id()))
}

/// Random device allocations and frees through `mm`; returns the peak of
/// the requested bytes live, counted here.
fn workload(mm: &MemoryManager, seed: u64, ops: usize) -> usize {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut live: Vec<(u64, usize)> = Vec::new();
    let (mut bytes, mut peak) = (0usize, 0usize);
    for _ in 0..ops {
        if live.is_empty() || rng.gen_bool(0.55) {
            let size = if rng.gen_bool(0.1) { rng.gen_range(1..64 << 20) } else { rng.gen_range(1..64 << 10) };
            let p = mm.allocate_device(size).unwrap();
            live.push((p, size));
            bytes += size;
            peak = peak.max(bytes);
        } else {
            let (p, size) = live.swap_remove(rng.gen_range(0..live.len()));
            mm.free_device(p).unwrap();
            bytes -= size;
        }
    }
    // Half of what is live stays live at the end of the log.
    for (p, _) in live.drain(..).step_by(2) {
        mm.free_device(p).unwrap();
    }
    peak
}

#[test]
fn a_recorded_log_replays_to_the_same_peak() {
    let path = temp_path("log.csv");
    // The GPU where there is one, else the host fallback.
    // Thread caches off: with them the pool's peak is an upper bound.
    let mm = MemoryManager::new(Config::new().log(&path).thread_cache(false)).unwrap();
    assert_eq!(mm.event_log().unwrap().path(), path.as_path());
    let peak = workload(&mm, 7, 3000);
    assert_eq!(mm.device_stats(0).unwrap().pool.peak_requested, peak);
    // A failed allocation is logged as one, and a bad free not at all.
    assert!(mm.allocate_device(usize::MAX / 2).is_err());
    assert!(mm.free_device(0x10).is_err());
    let p = mm.allocate_pinned(4096).unwrap();
    mm.free_pinned(p.as_ptr()).unwrap();
    mm.flush_event_log().unwrap();

    let trace = Trace::read(&path).unwrap();
    assert_eq!(trace.failures, 1);
    assert_eq!(trace.skipped_frees, 0);
    assert_eq!(trace.peak_live, peak, "the trace's own peak");
    assert!(trace.records.iter().any(|r| r.action == Action::Free && r.size == 4096));
    let report = replay::replay(&trace, Target::Host, &Config::new().thread_cache(false), 2, Pass::default()).unwrap();
    assert_eq!(report.last.peak_live, peak, "the replayed pool's peak");
    assert_eq!(report.trace_peak_live, peak);
    assert_eq!(report.last.failures, 0);
    assert_eq!(report.repeats, 2);
    let ratio = report.ratio.unwrap();
    assert!((1.0..4.0).contains(&ratio), "{ratio}");
    drop(mm);
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn dropping_the_manager_flushes_the_log() {
    let path = temp_path("drop.csv");
    let mm = MemoryManager::new(Config::new().backend(BackendChoice::Host).log(&path)).unwrap();
    for _ in 0..100 {
        let p = mm.allocate_device(1000).unwrap();
        mm.free_device(p).unwrap();
    }
    drop(mm);
    let trace = Trace::read(&path).unwrap();
    assert_eq!(trace.operations(), 200);
    assert_eq!(trace.peak_live, 1000);
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn the_log_key_parses() {
    let c: Config = "log=/tmp/x.csv,mode=sync_pool".parse().unwrap();
    assert_eq!(c.log_path, Some(PathBuf::from("/tmp/x.csv")));
    assert!("log=".parse::<Config>().is_err());
    let e = MemoryManager::new(Config::new().backend(BackendChoice::Host).log("/nonexistent/dir/x.csv")).unwrap_err();
    assert!(e.to_string().contains("event log"), "{e}");
}

#[test]
fn malformed_trace_files_name_the_line() {
    let path = temp_path("bad.csv");
    std::fs::write(
        &path,
        "Thread,Time,Action,Pointer,Size,Stream\n0,1,allocate,0x100,10,0\n0,2,allocate,0x200,ten,0\n",
    )
    .unwrap();
    let e = Trace::read(&path).unwrap_err().to_string();
    assert!(e.contains("line 3") && e.contains("'ten'"), "{e}");
    std::fs::remove_file(&path).unwrap();
    assert!(Trace::read(temp_path("missing.csv")).is_err());
}

/// The shared PyTorch traces, where this checkout has them beside it (or
/// the GPU suite's copy in `gpu-bin/traces`).
fn shared_traces() -> Vec<PathBuf> {
    let crate_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let dir = [crate_dir.join("../../shared/traces"), PathBuf::from("gpu-bin/traces")]
        .into_iter()
        .find(|d| d.is_dir())
        .unwrap_or_default();
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map(|d| {
            d.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.to_string_lossy().ends_with(".csv.gz")).collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn shared_traces_replay_on_the_host() {
    let traces = shared_traces();
    if traces.is_empty() {
        println!("shared_traces_replay_on_the_host: skipped, no ../shared/traces");
        return;
    }
    for path in traces {
        let trace = Trace::read(&path).unwrap();
        assert!(trace.operations() > 1000);
        let r = replay::replay(&trace, Target::Host, &Config::new(), 1, Pass::default()).unwrap();
        assert!(r.last.peak_live >= trace.peak_live, "{}", trace.name);
        let exact =
            replay::replay(&trace, Target::Host, &Config::new().thread_cache(false), 1, Pass::default()).unwrap();
        assert_eq!(exact.last.peak_live, trace.peak_live, "{}", trace.name);
        let ratio = r.ratio.unwrap();
        assert!((1.0..3.0).contains(&ratio), "{}: {ratio}", trace.name);
        // One range that grows in place (expandable segments): exact best
        // fit over it is never worse than over separate chunks. (On the
        // older shared traces it reaches about 1.004; on llama_generate
        // about 1.25, against a page floor of about 1.12: that gap is an
        // open issue, not a bound to hold here.)
        let sim = replay::replay(
            &trace,
            Target::Simulated,
            &Config::new().expandable(true).thread_cache(false),
            1,
            Pass::default(),
        )
        .unwrap();
        assert_eq!(sim.last.peak_live, trace.peak_live, "{}", trace.name);
        let sim_ratio = sim.ratio.unwrap();
        assert!((1.0..1.5).contains(&sim_ratio), "{} expandable: {sim_ratio}", trace.name);
        assert!(sim_ratio <= ratio + 0.005, "{} expandable {sim_ratio} against chunks {ratio}", trace.name);
    }
}

#[test]
fn gpu_targets_replay_a_trace() {
    let Some(_ctx) = cumem::cuda::gpu_for_test("gpu_targets_replay_a_trace") else {
        let e =
            replay::replay_once(&Trace::default(), Target::RawCuMemAlloc, &Config::new(), Pass::default()).unwrap_err();
        assert!(e.to_string().contains("needs a CUDA device"), "{e}");
        return;
    };
    let path = temp_path("gpu.csv");
    let mm = MemoryManager::new(Config::new().backend(BackendChoice::Host).log(&path)).unwrap();
    let peak = workload(&mm, 11, 2000);
    drop(mm);
    let trace = Trace::read(&path).unwrap();
    assert_eq!(trace.peak_live, peak);
    for target in Target::ALL {
        let r = replay::replay(&trace, target, &Config::new(), 2, Pass::default()).unwrap();
        assert_eq!(r.last.failures, 0, "{target}");
        assert_eq!(r.last.peak_live, peak, "{target}");
        if target != Target::RawCuMemAlloc {
            let reserved = r.last.peak_reserved.unwrap_or_else(|| panic!("{target}: no reserved figure"));
            assert!(reserved >= peak, "{target}: reserved {reserved} < live {peak}");
        }
        println!("{target}: {:.0} ns/op, ratio {:?}", r.ns_per_op, r.ratio);
    }
    let _ = DeviceAllocatorMode::ALL;
    std::fs::remove_file(&path).unwrap();
}

/// On `sim_device` each stream of a trace frees with a tag of its own: a
/// block freed on one stream and reused on the other counts as a wait;
/// with one stream nothing waits. Peaks do not depend on the streams.
#[test]
fn sim_device_honours_the_stream_column() {
    let text = "Thread,Time,Action,Pointer,Size,Stream\n\
                0,1,allocate,0x100,1000,0x1\n\
                0,2,free,0x100,1000,0x1\n\
                0,3,allocate,0x200,1000,0x2\n\
                0,4,free,0x200,1000,0x2\n\
                0,5,allocate,0x300,1000,0x2\n\
                0,6,free,0x300,1000,0x2\n";
    let trace = cumem_replay::trace::parse_str(text).unwrap();
    let base = Config::new().hot_block(false);
    let two = replay::replay(&trace, Target::Simulated, &base, 1, Pass::default()).unwrap();
    let one =
        replay::replay(&trace, Target::Simulated, &base, 1, Pass { one_stream: true, ..Pass::default() }).unwrap();
    // Stream 2 takes stream 1's freed block (a wait); its own free then
    // coalesces with the rest of that free range, still stream 1's, whose
    // work `sim_device` takes as complete (nothing runs on a simulated
    // device), so the merged block is stream 2's and its next reuse on
    // stream 2 waits for nothing.
    assert_eq!((two.streams, two.last.stream_waits), (2, 1));
    assert_eq!((one.streams, one.last.stream_waits), (1, 0));
    assert_eq!(one.last.peak_reserved, two.last.peak_reserved);
    // With the hot block (the default) stream 2's free waits uncoalesced
    // and its next request of that size takes it back with stream 2's own
    // tag: no second wait, same placement.
    let hot = replay::replay(&trace, Target::Simulated, &Config::new(), 1, Pass::default()).unwrap();
    assert_eq!((hot.streams, hot.last.stream_waits), (2, 1));
    assert_eq!(hot.last.peak_reserved, two.last.peak_reserved);
}

/// What the library records (`CUMEM_CONF` key `log`) this crate reads.
#[test]
fn the_librarys_event_log_reads_back_as_a_trace() {
    let path = std::env::temp_dir().join(format!("cumem-log-unit-{}.csv", std::process::id()));
    let log = cumem::log::EventLog::create(&path).unwrap();
    for i in 0..1000u64 {
        log.allocated(0x1000 + i * 256, 256, 0);
    }
    log.failed(1 << 40, 0x55);
    for i in 0..1000u64 {
        log.freed(0x1000 + i * 256, 256, 0);
    }
    log.flush().unwrap();
    let t = Trace::read(&path).unwrap();
    assert_eq!(t.records.len(), 2001);
    assert_eq!(t.failures, 1);
    assert_eq!(t.records[1000].stream, 0x55);
    assert_eq!(t.peak_live, 1000 * 256);
    assert_eq!(t.live_at_end, 0);
    drop(log);
    std::fs::remove_file(&path).unwrap();
}
