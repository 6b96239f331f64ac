use super::workloads::MIB;
use super::*;
use std::collections::HashMap;

const GIB: usize = 1 << 30;

/// Checks a trace against a shadow of its own: every free names a live
/// allocation of the same size, nothing is freed twice, times increase,
/// sizes are multiples of 512 and everything is freed by the end.
fn check_valid(t: &Trace) {
    let mut live: HashMap<u64, usize> = HashMap::new();
    let mut ever = std::collections::HashSet::new();
    let mut time = 0;
    for (i, r) in t.records.iter().enumerate() {
        assert!(r.time_us > time, "{}: record {i}: time {} after {time}", t.name, r.time_us);
        time = r.time_us;
        assert!(r.size > 0 && r.size % SIZE_STEP == 0, "{}: record {i}: size {}", t.name, r.size);
        assert!(r.stream <= 1, "{}: record {i}: stream {}", t.name, r.stream);
        match r.action {
            Action::Allocate => {
                assert!(ever.insert(r.pointer), "{}: record {i}: pointer {:#x} reused", t.name, r.pointer);
                live.insert(r.pointer, r.size);
            }
            Action::Free => {
                let size = live.remove(&r.pointer);
                assert_eq!(size, Some(r.size), "{}: record {i}: free of {:#x}", t.name, r.pointer);
            }
            Action::AllocateFailure => panic!("{}: record {i}: a failure", t.name),
        }
    }
    assert!(live.is_empty(), "{}: {} allocations live at the end", t.name, live.len());
    assert_eq!(
        (t.skipped_frees, t.duplicate_allocations, t.failures, t.zero_sizes, t.live_at_end),
        (0, 0, 0, 0, 0),
        "{}",
        t.name
    );
    assert_eq!(t.operations(), t.records.len(), "{}", t.name);
}

#[test]
fn every_workload_is_valid_and_sized_as_intended() {
    for w in Workload::ALL {
        for seed in [1, 2, 3] {
            let t = generate(w, seed);
            check_valid(&t);
            let ops = t.operations();
            assert!((10_000..80_000).contains(&ops), "{}: {ops} operations", t.name);
            assert!((GIB..8 * GIB).contains(&t.peak_live), "{}: peak live {} MiB", t.name, t.peak_live >> 20);
            println!("{}: {ops} operations, peak live {} MiB", t.name, t.peak_live >> 20);
        }
    }
}

#[test]
fn a_seed_gives_one_trace_and_seeds_differ() {
    for w in Workload::ALL {
        let a = generate(w, 7);
        assert_eq!(a, generate(w, 7), "{w}");
        let b = generate(w, 8);
        assert_ne!(a.records, b.records, "{w}");
        assert_ne!(a.peak_live, b.peak_live, "{w}: seeds should change the shapes");
    }
    assert_ne!(generate(Workload::PinnedTop, 7).records, generate(Workload::TwoStreams, 7).records);
}

#[test]
fn only_two_streams_uses_stream_1_and_frees_across() {
    for w in Workload::ALL {
        let t = generate(w, 5);
        if w == Workload::TwoStreams {
            assert_eq!(t.stream_ids, vec![0, 1]);
            let mut stream_of = HashMap::new();
            let mut across = 0;
            for r in &t.records {
                match r.action {
                    Action::Allocate => drop(stream_of.insert(r.pointer, r.stream)),
                    _ => across += usize::from(stream_of[&r.pointer] != r.stream),
                }
            }
            assert!(across >= 3 * 48, "{across} frees on another stream than the allocation's");
        } else {
            assert_eq!(t.stream_ids, vec![0], "{w}");
        }
    }
}

#[test]
fn the_workloads_have_their_shapes() {
    // kv_cache: caches grow by reallocation, a larger block allocated
    // right before the old one is freed, 32 tokens (2 MiB per
    // sequence) at a time.
    let kv = generate(Workload::KvCache, 1);
    let growths = kv
        .records
        .windows(2)
        .filter(|w| {
            let (a, f) = (w[0], w[1]);
            a.action == Action::Allocate
                && f.action == Action::Free
                && f.size >= 2 * MIB
                && a.size > f.size
                && (a.size - f.size) % (2 * MIB) == 0
        })
        .count();
    println!("kv_cache: {growths} growths");
    assert!(growths > 150, "kv_cache: {growths} growths");
    // moe: many distinct sizes, with a heavy tail.
    let moe = generate(Workload::Moe, 1);
    let sizes: std::collections::HashSet<usize> = moe.records.iter().map(|r| r.size).collect();
    assert!(sizes.len() > 2000, "moe: {} distinct sizes", sizes.len());
    // pinned_top: long-lived blocks above the activations leave the
    // top of the range far above the pages live blocks touch.
    // pinned_top: blocks allocated while the iteration's activations are
    // live (high in the range) that outlive several iterations.
    for seed in [1, 2, 3] {
        let t = generate(Workload::PinnedTop, seed);
        let pinning = long_lived_from_high(&t, 0.6, 2000, t.records.len() / 2);
        assert!((5..40).contains(&pinning), "{}: {pinning} pinning blocks", t.name);
        // The exact best fit of the page floor places around them
        // well; they matter to pools that can't.
        let f = crate::replay::page_floor(&t, 2 * MIB).unwrap();
        assert!(f.top >= f.touched, "{f:?}");
    }
}

/// Blocks allocated while live bytes were above `high` of the peak,
/// freed `min..max` records later.
fn long_lived_from_high(t: &Trace, high: f64, min: usize, max: usize) -> usize {
    let (mut live, mut born, mut count) = (0usize, HashMap::new(), 0);
    for (i, r) in t.records.iter().enumerate() {
        if r.action == Action::Allocate {
            live += r.size;
            born.insert(r.pointer, (i, live as f64 > high * t.peak_live as f64));
        } else {
            live -= r.size;
            let (at, was_high) = born[&r.pointer];
            count += usize::from(was_high && (min..max).contains(&(i - at)));
        }
    }
    count
}

#[test]
fn specs_parse() {
    let s: Spec = "synth:kv_cache:7".parse().unwrap();
    assert_eq!((s.workload, s.seed, s.name()), (Workload::KvCache, 7, "synth_kv_cache_s7".to_string()));
    assert_eq!(s.to_string(), "synth:kv_cache:7");
    assert_eq!(Spec::from_arg("synth:moe").unwrap().unwrap().seed, Spec::DEFAULT_SEED);
    assert!(Spec::from_arg("a/b.csv.gz").is_none());
    let e = Spec::from_arg("synth:nope").unwrap().unwrap_err().to_string();
    assert!(e.contains("nope") && e.contains("kv_cache"), "{e}");
    let e = Spec::from_arg("synth:moe:x").unwrap().unwrap_err().to_string();
    assert!(e.contains("'x'"), "{e}");
    assert_eq!(s.trace().name, "synth_kv_cache_s7");
}

#[test]
fn a_written_trace_reads_back_equal() {
    let t = generate(Workload::TwoStreams, 3);
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    t.write_csv(&mut gz).unwrap();
    let bytes = gz.finish().unwrap();
    let mut back = crate::trace::parse_reader(&bytes[..], "back").unwrap();
    back.name = t.name.clone();
    assert_eq!(back, t);
}
