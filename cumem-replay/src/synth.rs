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
    /// `PinnedTop` with loader buffers allocated on stream 1, freed on 0.
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
    /// [`Error::Config`] for an unknown workload or a seed not a decimal `u64`.
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

/// SplitMix64 (Steele, Lea, Flood 2014): small, fast, enough for sizes.
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

/// A record's source: compute (thread 0, stream 0) or loader (1, 1).
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
        self.records.push(Record { thread: id, time_us: self.time, action, pointer, size, stream: id });
    }

    /// Allocates `bytes` (rounded up to 512 B) on the compute stream.
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
mod tests;
