//! Synthetic traces: deterministic workloads, named and seeded, that test
//! whether a page or placement policy holds beyond the few recorded traces.
//!
//! Each [`Workload`] models one way programs use device memory; [`generate`]
//! turns a workload and a seed into a [`Trace`] as if read from RMM's log
//! CSV, and [`Trace::write`] writes it as one, so replays elsewhere (PyTorch,
//! RMM) can read it. On the command line `cumem-replay` takes
//! `synth:NAME[:SEED]` wherever it takes a trace file (see [`Spec`]).
//!
//! | workload | what it models |
//! | --- | --- |
//! | `pinned_top` | training iterations whose activations change size with the batch; now and then a cached tensor allocated mid-iteration lives on for many iterations, high in the range |
//! | `kv_cache` | generation: overlapping requests of different batch sizes, each with a KV cache that grows by reallocation every 32 tokens, and small temporaries per token |
//! | `moe` | mixture-of-experts training: tokens per step vary, and so do the per-expert buffers, with a heavy-tailed load across experts |
//! | `two_streams` | `pinned_top` with a data loader: its buffers are allocated on stream 1 (thread 1) two iterations ahead and freed on stream 0 by the compute |
//! | `loop_fixed` | a 6-layer transformer trained for 60 iterations of one shape: a loop that repeats exactly |
//! | `loop_change` | `loop_fixed` whose sequence length changes halfway |
//! | `loop_two` | `loop_fixed` with an evaluation pass (forward only, another shape) after every second step: two loops interleaved |
//! | `loop_lengths` | `loop_fixed` with one of four sequence lengths per iteration, drawn at random (prompts of varying length) |
//! | `loop_depart` | `loop_fixed` with an extra block now and then (a quarter of the iterations, living 0 to 3 of them) and an extra temporary (a tenth) |
//!
//! Every workload has a few tens of thousands of operations and a peak live
//! of one to a few GiB, so that 2 MiB pages matter; sizes are multiples of 512 B.
//!
//! # Guarantees
//! - The same workload and seed give the same trace, on any machine.
//! - Every free names a live allocation, on a stream the trace uses;
//!   nothing is freed twice; **everything is freed by the end** (the
//!   trace's `live_at_end` is 0), so a warm replay starts from an empty
//!   pool.
//! - Pointers are unique (a bump counter from `0x7f00_0000_0000`, each
//!   allocation's size apart): the replayer maps trace pointers to its own
//!   allocations, so only their identity matters.
//! - Times increase strictly, by 1 to 40 µs per record.
//! - Streams are the small integers 0 and 1, as in the recorded traces;
//!   only `two_streams` uses 1.
//!
//! # Examples
//! ```
//! use cumem_replay::synth::{generate, Workload};
//! let trace = generate(Workload::KvCache, 7);
//! assert_eq!(trace.name, "synth_kv_cache_s7");
//! assert_eq!((trace.skipped_frees, trace.live_at_end), (0, 0));
//! assert!(trace.peak_live > 1 << 30);
//! ```
//!
//! # Implementation details
//! A small recorder hands out `Block`s, which are neither `Copy` nor
//! `Clone`: freeing one consumes it, so a workload can't free a block twice
//! or free one it never allocated. Randomness comes from SplitMix64, seeded
//! with the seed and the workload's name, so the library needs no `rand`.

use std::fmt;
use std::str::FromStr;

use cumem::{Error, Result};

use crate::trace::{Action, Record, Trace};

mod loops;
mod workloads;

use loops::{training_loop, Kind};
use workloads::{kv_cache, moe, training};

/// A synthetic workload (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Workload {
    /// Training with varying activations and long-lived blocks allocated
    /// mid-iteration that pin the top of the range.
    PinnedTop,
    /// Generation with KV caches that grow by reallocation.
    KvCache,
    /// Mixture of experts: per-expert buffers of widely varying sizes.
    Moe,
    /// `PinnedTop` with data-loader buffers allocated on stream 1 and
    /// freed on stream 0.
    TwoStreams,
    /// A training loop of one shape, repeated exactly.
    LoopFixed,
    /// A training loop whose shape changes halfway.
    LoopChange,
    /// A training loop with an evaluation pass after every second step.
    LoopTwo,
    /// A training loop with one of four sequence lengths per iteration.
    LoopLengths,
    /// A training loop that departs from its sequence now and then.
    LoopDepart,
}

impl Workload {
    /// Every workload, in report order.
    pub const ALL: [Workload; 9] = [
        Workload::PinnedTop,
        Workload::KvCache,
        Workload::Moe,
        Workload::TwoStreams,
        Workload::LoopFixed,
        Workload::LoopChange,
        Workload::LoopTwo,
        Workload::LoopLengths,
        Workload::LoopDepart,
    ];

    /// The name in `synth:NAME` and in trace names.
    pub fn name(self) -> &'static str {
        match self {
            Workload::PinnedTop => "pinned_top",
            Workload::KvCache => "kv_cache",
            Workload::Moe => "moe",
            Workload::TwoStreams => "two_streams",
            Workload::LoopFixed => "loop_fixed",
            Workload::LoopChange => "loop_change",
            Workload::LoopTwo => "loop_two",
            Workload::LoopLengths => "loop_lengths",
            Workload::LoopDepart => "loop_depart",
        }
    }
}

impl fmt::Display for Workload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Workload {
    type Err = Error;
    fn from_str(s: &str) -> Result<Workload> {
        Workload::ALL.into_iter().find(|w| w.name().eq_ignore_ascii_case(s)).ok_or_else(|| {
            let names: Vec<&str> = Workload::ALL.iter().map(|w| w.name()).collect();
            Error::Config(format!("unknown synthetic workload '{s}' (known: {})", names.join(", ")))
        })
    }
}

/// A synthetic trace named on the command line: `synth:NAME` or
/// `synth:NAME:SEED` (seed decimal, [`Spec::DEFAULT_SEED`] when left out).
///
/// # Examples
/// ```
/// use cumem_replay::synth::{Spec, Workload};
/// let spec: Spec = "synth:moe:3".parse()?;
/// assert_eq!((spec.workload, spec.seed), (Workload::Moe, 3));
/// assert_eq!(spec.name(), "synth_moe_s3");
/// assert!(Spec::from_arg("traces/bert_train.csv.gz").is_none());
/// # Ok::<(), cumem::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Spec {
    /// What to generate.
    pub workload: Workload,
    /// The seed.
    pub seed: u64,
}

impl Spec {
    /// The seed of `synth:NAME`.
    pub const DEFAULT_SEED: u64 = 1;
    /// What a trace argument starts with to name a synthetic trace.
    pub const PREFIX: &'static str = "synth:";

    /// `None` when `arg` does not start with [`Spec::PREFIX`] (a file
    /// path), else the parsed spec.
    ///
    /// # Errors
    /// [`Error::Config`] for an unknown workload or a seed that is not a
    /// decimal `u64`.
    pub fn from_arg(arg: &str) -> Option<Result<Spec>> {
        arg.starts_with(Spec::PREFIX).then(|| arg.parse())
    }

    /// `synth_NAME_sSEED`, the generated trace's name.
    pub fn name(self) -> String {
        format!("synth_{}_s{}", self.workload, self.seed)
    }

    /// Generates the trace ([`generate`]).
    pub fn trace(self) -> Trace {
        generate(self.workload, self.seed)
    }
}

impl FromStr for Spec {
    type Err = Error;
    fn from_str(s: &str) -> Result<Spec> {
        let rest = s.strip_prefix(Spec::PREFIX).unwrap_or(s);
        let (name, seed) = match rest.split_once(':') {
            Some((name, seed)) => {
                let seed = seed.parse().map_err(|_| {
                    Error::Config(format!("synthetic trace '{s}': seed '{seed}' is not a decimal number"))
                })?;
                (name, seed)
            }
            None => (rest, Spec::DEFAULT_SEED),
        };
        Ok(Spec { workload: name.parse()?, seed })
    }
}

impl fmt::Display for Spec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}:{}", Spec::PREFIX, self.workload, self.seed)
    }
}

/// Generates `workload` with `seed`: a trace named `synth_NAME_sSEED`,
/// resolved as [`Trace::parse`] would resolve its file.
pub fn generate(workload: Workload, seed: u64) -> Trace {
    let mut r = Recorder::new(seed ^ fnv1a(workload.name()));
    match workload {
        Workload::PinnedTop => training(&mut r, false),
        Workload::KvCache => kv_cache(&mut r),
        Workload::Moe => moe(&mut r),
        Workload::TwoStreams => training(&mut r, true),
        Workload::LoopFixed => training_loop(&mut r, Kind::Fixed),
        Workload::LoopChange => training_loop(&mut r, Kind::Change),
        Workload::LoopTwo => training_loop(&mut r, Kind::Two),
        Workload::LoopLengths => training_loop(&mut r, Kind::Lengths),
        Workload::LoopDepart => training_loop(&mut r, Kind::Depart),
    }
    Trace::from_records(&Spec { workload, seed }.name(), r.records)
}

/// SplitMix64 (Steele, Lea, Flood 2014): small, fast, and good enough for
/// shapes and sizes.
#[derive(Debug, Clone)]
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        let span = (hi - lo) as u128 + 1;
        lo + ((u128::from(self.next_u64()) * span) >> 64) as usize
    }

    /// Uniform in `[0, 1)`.
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }

    fn pick<T: Copy>(&mut self, from: &[T]) -> T {
        from[self.range(0, from.len() - 1)]
    }
}

/// FNV-1a, to mix a workload's name into its seed.
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// A live allocation of a synthetic trace; freeing consumes it.
#[derive(Debug)]
struct Block {
    pointer: u64,
    size: usize,
}

/// Where a record comes from: the compute (thread 0, stream 0) or the data
/// loader (thread 1, stream 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Issuer {
    Compute,
    Loader,
}

/// Writes a workload's records.
struct Recorder {
    rng: SplitMix64,
    records: Vec<Record>,
    next_pointer: u64,
    time: u64,
}

/// Sizes are rounded up to this, as PyTorch's and RMM's allocators do.
const SIZE_STEP: usize = 512;

impl Recorder {
    fn new(seed: u64) -> Recorder {
        Recorder {
            rng: SplitMix64(seed),
            records: Vec::new(),
            next_pointer: 0x7f00_0000_0000,
            time: 1_700_000_000_000_000,
        }
    }

    fn record(&mut self, issuer: Issuer, action: Action, pointer: u64, size: usize) {
        self.time += self.rng.range(1, 40) as u64;
        let id = match issuer {
            Issuer::Compute => 0,
            Issuer::Loader => 1,
        };
        self.records.push(Record { thread: id, time: self.time, action, pointer, size, stream: id });
    }

    /// Allocates at least `bytes` (rounded up to 512 B) on the compute
    /// stream.
    fn allocate(&mut self, bytes: usize) -> Block {
        self.allocate_by(Issuer::Compute, bytes)
    }

    fn allocate_by(&mut self, issuer: Issuer, bytes: usize) -> Block {
        let size = bytes.max(1).next_multiple_of(SIZE_STEP);
        let pointer = self.next_pointer;
        self.next_pointer += size as u64;
        self.record(issuer, Action::Allocate, pointer, size);
        Block { pointer, size }
    }

    /// Frees `block` on the compute stream.
    fn free(&mut self, block: Block) {
        self.record(Issuer::Compute, Action::Free, block.pointer, block.size);
    }

    fn free_all(&mut self, blocks: impl IntoIterator<Item = Block>) {
        for b in blocks {
            self.free(b);
        }
    }

    /// A short-lived temporary of `bytes`.
    fn temporary(&mut self, bytes: usize) {
        let b = self.allocate(bytes);
        self.free(b);
    }
}

#[cfg(test)]
mod tests {
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
            assert!(r.time > time, "{}: record {i}: time {} after {time}", t.name, r.time);
            time = r.time;
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
}
