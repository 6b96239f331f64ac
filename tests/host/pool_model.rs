//! The randomized model check: `BestFit` against a deliberately simple
//! reference allocator (linear scans over a sorted block list), step by
//! step. After every operation the two must agree on the chosen block, the
//! live and free blocks, and the statistics, and `BestFit`'s own invariant
//! check must pass.

use cumem::pool::{BestFit, FreeError, StreamTag, BLOCK_ALIGN};
use cumem::upstream::Chunk;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

#[derive(Debug, Clone, PartialEq)]
struct RefBlock {
    addr: usize,
    size: usize,
    free: bool,
    chunk: usize,
}

/// The reference: every block in address order, found by linear scans.
#[derive(Default)]
struct Reference {
    blocks: Vec<RefBlock>,
    chunks: Vec<Chunk>,
}

impl Reference {
    fn add_chunk(&mut self, c: Chunk) {
        self.chunks.push(c);
        let id = self.chunks.len() - 1;
        self.blocks.push(RefBlock { addr: c.addr, size: c.size, free: true, chunk: id });
        self.blocks.sort_by_key(|b| b.addr);
    }

    fn allocate(&mut self, size: usize, align: usize) -> Option<usize> {
        let align = align.max(BLOCK_ALIGN);
        let best = self
            .blocks
            .iter()
            .enumerate()
            .filter(|(_, b)| b.free && b.addr.next_multiple_of(align) - b.addr + size <= b.size)
            .min_by_key(|(_, b)| (b.size, b.addr))
            .map(|(i, _)| i)?;
        let b = self.blocks[best].clone();
        let start = b.addr.next_multiple_of(align);
        let mut pieces = Vec::new();
        if start > b.addr {
            pieces.push(RefBlock { addr: b.addr, size: start - b.addr, free: true, chunk: b.chunk });
        }
        pieces.push(RefBlock { addr: start, size, free: false, chunk: b.chunk });
        if start + size < b.addr + b.size {
            pieces.push(RefBlock {
                addr: start + size,
                size: b.addr + b.size - start - size,
                free: true,
                chunk: b.chunk,
            });
        }
        self.blocks.splice(best..=best, pieces);
        Some(start)
    }

    fn free(&mut self, addr: usize) -> Result<usize, FreeError> {
        let Some(i) = self.blocks.iter().position(|b| b.addr == addr && !b.free) else {
            if self.blocks.iter().any(|b| b.addr == addr && b.free) {
                return Err(FreeError::DoubleFree);
            }
            if let Some(b) = self.blocks.iter().find(|b| addr > b.addr && addr < b.addr + b.size) {
                return Err(FreeError::Interior { block: b.addr, size: b.size });
            }
            return Err(FreeError::Unknown);
        };
        let size = self.blocks[i].size;
        self.blocks[i].free = true;
        self.coalesce();
        Ok(size)
    }

    fn coalesce(&mut self) {
        let mut i = 0;
        while i + 1 < self.blocks.len() {
            let (a, b) = (&self.blocks[i], &self.blocks[i + 1]);
            if a.free && b.free && a.chunk == b.chunk && a.addr + a.size == b.addr {
                self.blocks[i].size += self.blocks[i + 1].size;
                self.blocks.remove(i + 1);
            } else {
                i += 1;
            }
        }
    }

    fn grow(&mut self, addr: usize, new_size: usize) -> bool {
        let i = self.blocks.iter().position(|b| b.addr == addr && !b.free).unwrap();
        let size = self.blocks[i].size;
        if new_size <= size {
            return true;
        }
        let need = new_size - size;
        match self.blocks.get(i + 1).cloned() {
            Some(n) if n.free && n.chunk == self.blocks[i].chunk && n.size >= need => {
                self.blocks[i].size = new_size;
                if n.size == need {
                    self.blocks.remove(i + 1);
                } else {
                    self.blocks[i + 1].addr += need;
                    self.blocks[i + 1].size -= need;
                }
                true
            }
            _ => false,
        }
    }

    fn shrink(&mut self, addr: usize, new_size: usize) {
        let i = self.blocks.iter().position(|b| b.addr == addr && !b.free).unwrap();
        let b = self.blocks[i].clone();
        if new_size < b.size {
            self.blocks[i].size = new_size;
            self.blocks
                .insert(i + 1, RefBlock { addr: addr + new_size, size: b.size - new_size, free: true, chunk: b.chunk });
            self.coalesce();
        }
    }

    fn take_free_chunks(&mut self) -> Vec<Chunk> {
        let mut out = Vec::new();
        for (id, c) in self.chunks.iter().enumerate() {
            if c.size == 0 {
                continue;
            }
            if self.blocks.iter().any(|b| b.chunk == id && b.free && b.size == c.size) {
                out.push(*c);
            }
        }
        for c in &out {
            self.blocks.retain(|b| b.addr != c.addr);
            let id = self.chunks.iter().position(|x| x == c).unwrap();
            self.chunks[id].size = 0;
        }
        out.sort_by_key(|c| c.addr);
        out
    }

    fn live(&self) -> Vec<(usize, usize)> {
        self.blocks.iter().filter(|b| !b.free).map(|b| (b.addr, b.size)).collect()
    }

    fn free_list(&self) -> Vec<(usize, usize)> {
        self.blocks.iter().filter(|b| b.free).map(|b| (b.addr, b.size)).collect()
    }

    fn reserved(&self) -> usize {
        self.chunks.iter().map(|c| c.size).sum()
    }
}

/// The 4 KiB pages that blocks sorted by address touch, each page counted
/// once though two blocks share it.
fn touched_pages(live: &[(usize, usize)]) -> usize {
    let mut count = 0;
    let mut next = 0; // the first page not counted yet
    for &(addr, size) in live {
        let (first, end) = ((addr / 4096).max(next), (addr + size).div_ceil(4096));
        count += end.saturating_sub(first);
        next = next.max(end);
    }
    count
}

fn run(seed: u64, ops: usize) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut fit = BestFit::new();
    // Chunks are whole 4 KiB pages: count the pages live blocks touch.
    fit.count_pages(4096);
    let mut peak_touched = 0;
    let mut reference = Reference::default();
    let mut live: Vec<usize> = Vec::new();
    // Chunks are placed at increasing addresses with gaps, so that a chunk
    // boundary never looks like a neighbour in address space by accident
    // (and sometimes exactly adjacent, to prove coalescing stops there).
    let mut next_chunk: usize = 1 << 32;
    let aligns = [1usize, 64, 256, 512, 4096, 65536];
    for step in 0..ops {
        let ctx = || format!("seed {seed}, step {step}");
        match rng.gen_range(0..100) {
            0..=54 => {
                let size: usize = match rng.gen_range(0..10) {
                    0..=5 => rng.gen_range(1..=4096),
                    6..=8 => rng.gen_range(1..=1 << 20),
                    _ => rng.gen_range(1..=8 << 20),
                };
                let rounded = size.next_multiple_of(BLOCK_ALIGN);
                let align = aligns[rng.gen_range(0..aligns.len())];
                let got = fit.allocate(rounded, align, size).map(|a| a.addr);
                let want = reference.allocate(rounded, align);
                assert_eq!(got, want, "best-fit choice differs ({})", ctx());
                match got {
                    Some(addr) => {
                        assert_eq!(addr % align.max(BLOCK_ALIGN), 0, "misaligned ({})", ctx());
                        live.push(addr);
                    }
                    None => {
                        // Grow: a chunk big enough for the request.
                        let csize = (rounded + align).max(rng.gen_range(1..=16usize) << 20usize).next_multiple_of(4096);
                        if rng.gen_bool(0.3) {
                            // exactly adjacent to the previous chunk
                        } else {
                            next_chunk += 1 << 20;
                        }
                        let c = Chunk { addr: next_chunk, size: csize };
                        next_chunk += csize;
                        assert!(fit.add_chunk(c));
                        reference.add_chunk(c);
                        let got = fit.allocate(rounded, align, size).map(|a| a.addr);
                        let want = reference.allocate(rounded, align);
                        assert_eq!(got, want, "after growth ({})", ctx());
                        live.push(got.expect("a fresh chunk fits"));
                    }
                }
            }
            55..=89 if !live.is_empty() => {
                let i = rng.gen_range(0..live.len());
                let addr = live.swap_remove(i);
                let got = fit.free(addr, StreamTag::NONE).map(|f| f.size);
                let want = reference.free(addr);
                assert_eq!(got, want, "free differs ({})", ctx());
                assert!(got.is_ok());
            }
            90..=93 => {
                // Bad frees: a random address, an interior pointer, a double free.
                let addr = match (rng.gen_range(0..3), live.is_empty()) {
                    (0, false) => live[rng.gen_range(0..live.len())] + 256 * rng.gen_range(1..4),
                    (1, _) => {
                        let fl = reference.free_list();
                        if fl.is_empty() {
                            12345
                        } else {
                            fl[rng.gen_range(0..fl.len())].0
                        }
                    }
                    _ => rng.gen_range(0..next_chunk + (1 << 30)),
                };
                let got = fit.free(addr, StreamTag::NONE).map(|f| f.size);
                let want = reference.free(addr);
                assert_eq!(got, want, "bad free of {addr:#x} ({})", ctx());
                if got.is_ok() {
                    live.retain(|&a| a != addr);
                }
            }
            94..=96 if !live.is_empty() => {
                let addr = live[rng.gen_range(0..live.len())];
                let size = fit.block_size(addr).unwrap();
                if rng.gen_bool(0.5) {
                    let new = (size + rng.gen_range(1..=1 << 16)).next_multiple_of(BLOCK_ALIGN);
                    assert_eq!(fit.grow_in_place(addr, new), reference.grow(addr, new), "grow ({})", ctx());
                } else if size > BLOCK_ALIGN {
                    let new = rng.gen_range(1..size).next_multiple_of(BLOCK_ALIGN);
                    assert!(fit.shrink_in_place(addr, new));
                    reference.shrink(addr, new);
                }
            }
            _ => {
                let mut got: Vec<Chunk> = fit.take_free_chunks().into_iter().map(|(c, _)| c).collect();
                got.sort_by_key(|c| c.addr);
                assert_eq!(got, reference.take_free_chunks(), "trim ({})", ctx());
            }
        }
        fit.check_invariants().unwrap_or_else(|e| panic!("invariant broken ({}): {e}", ctx()));
        let (ref_live, ref_free) = (reference.live(), reference.free_list());
        let live_got: Vec<(usize, usize)> = fit.live_blocks().into_iter().map(|(a, s, _)| (a, s)).collect();
        assert_eq!(live_got, ref_live, "live blocks differ ({})", ctx());
        assert_eq!(fit.free_list(), ref_free, "free blocks differ ({})", ctx());
        let s = fit.stats();
        assert_eq!(s.in_use, ref_live.iter().map(|l| l.1).sum::<usize>(), "in_use ({})", ctx());
        assert_eq!(s.reserved, reference.reserved(), "reserved ({})", ctx());
        assert_eq!(s.largest_free, ref_free.iter().map(|f| f.1).max().unwrap_or(0));
        let touched = touched_pages(&ref_live);
        peak_touched = peak_touched.max(touched);
        assert_eq!(fit.touched_pages(), (touched, peak_touched), "touched pages ({})", ctx());
        assert_eq!((s.touched, s.peak_touched), (touched * 4096, peak_touched * 4096), "stats ({})", ctx());
    }
}

#[test]
fn best_fit_matches_the_reference_on_fixed_seeds() {
    for seed in [1, 2, 3, 7] {
        run(seed, 15_000);
    }
}

// The fixed seeds in two tests, so that the test harness's threads share
// them.
#[test]
fn best_fit_matches_the_reference_on_more_fixed_seeds() {
    for seed in [0xdead_beef, 42, 99, 2024] {
        run(seed, 15_000);
    }
}

#[test]
fn best_fit_matches_the_reference_on_a_random_seed() {
    let seed: u64 = std::env::var("CUMEM_MODEL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| SmallRng::from_entropy().r#gen());
    println!("model check seed: {seed} (rerun with CUMEM_MODEL_SEED={seed})");
    let result = std::panic::catch_unwind(|| run(seed, 20_000));
    if let Err(e) = result {
        eprintln!("model check failed with seed {seed}; rerun with CUMEM_MODEL_SEED={seed}");
        std::panic::resume_unwind(e);
    }
}

#[path = "../support/faults.rs"]
mod faults;

/// Device memory of the host fallback is host memory.
struct HostBytes;

impl faults::DeviceBytes for HostBytes {
    fn fill(&self, addr: u64, len: usize, value: u8, _: &cumem::Stream) {
        // SAFETY: the workload passes bytes of a live block it owns.
        unsafe { std::ptr::write_bytes(addr as *mut u8, value, len) };
    }
    fn read(&self, addr: u64, len: usize, _: &cumem::Stream) -> Vec<u8> {
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.to_vec()
    }
}

/// The host model of the driver (page commits for cuMemCreate, cuMemMap
/// and cuMemSetAccess, address reservations, host allocations) fails at
/// random, 10,000 times over fixed seeds: every failure is a typed error,
/// the pools' invariants hold after each step, no live block is handed
/// out twice or loses its contents, and reserved memory returns to its
/// start once everything is freed and released.
#[test]
fn ten_thousand_injected_driver_failures_break_nothing() {
    use cumem::{BackendChoice, Config, MemoryManager, Stream};
    let mut total = faults::Outcome::default();
    for seed in 0..100 {
        let mm = MemoryManager::new(Config::new().backend(BackendChoice::Host)).unwrap();
        let streams = [Stream::host(), Stream::host(), Stream::host()];
        let o = faults::run(&mm, 0, &streams, &HostBytes, seed, 3_000, 0.35);
        total.ops += o.ops;
        total.injected += o.injected;
        total.errors += o.errors;
        if total.injected >= 10_000 {
            break;
        }
    }
    println!("{total:?}");
    assert!(total.injected >= 10_000, "only {} failures injected", total.injected);
    assert!(total.errors > 0, "no failure reached the caller");
}
