//! A randomized model check of page remapping (issue 14): a pool over a
//! model upstream that maps and unmaps pieces of pages and records which
//! streams' queued work may still use each page.
//!
//! Checked after every step (and by the upstream at every unmap):
//! - no live block ever sits on an unmapped page;
//! - no page is unmapped while queued work may use it (a block freed on a
//!   stream whose work has not completed), unless the pool asked the
//!   upstream to wait for that work first;
//! - the pool's count of mapped bytes is the upstream's;
//! - every map targets unmapped pages inside the pool's chunks.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};

use cumem::pool::{Pool, PoolConfig, StreamTag};
use cumem::upstream::{Chunk, Upstream};
use cumem::{PoolKind, Result};

const PAGE: usize = 64 << 10;
const BASE: usize = 1 << 36;

/// The model device: address space carved from `top`, mapped pieces, and
/// for each page the last queued work on it (stream, sequence number).
#[derive(Default)]
struct World {
    top: usize,
    pieces: BTreeMap<usize, usize>,
    spare: Vec<usize>,
    /// Pages with work that may still be queued: page → (stream, seq).
    queued: HashMap<usize, (u64, u64)>,
    /// Per stream, the sequence number up to which work is complete.
    complete: HashMap<u64, u64>,
    /// Blocks the test holds (a subset of the pool's live blocks).
    live: BTreeMap<usize, usize>,
    violations: Vec<String>,
    maps: u64,
    unmaps: u64,
    syncs: u64,
    /// The largest piece of new memory one map makes (0: a whole run), as
    /// the CUDA upstream caps pieces at `REMAP_PIECE`.
    piece_cap: usize,
}

impl World {
    fn mapped(&self, page: usize) -> bool {
        match self.pieces.range(..=page).next_back() {
            Some((&a, &s)) => page < a + s,
            None => false,
        }
    }

    fn mapped_bytes(&self) -> usize {
        self.pieces.values().sum()
    }

    /// Mapped and kept (unmapped, not released) memory.
    fn held_bytes(&self) -> usize {
        self.mapped_bytes() + self.spare.iter().sum::<usize>()
    }

    fn pages(addr: usize, size: usize) -> impl Iterator<Item = usize> {
        (addr / PAGE * PAGE..addr + size).step_by(PAGE)
    }

    /// Every queued work completes (a device synchronisation).
    fn sync(&mut self) {
        self.syncs += 1;
        self.queued.clear();
        for v in self.complete.values_mut() {
            *v = u64::MAX;
        }
    }

    fn unmap_piece(&mut self, addr: usize, size: usize, pending: bool) {
        for page in Self::pages(addr, size) {
            if let Some(&(s, seq)) = self.queued.get(&page) {
                let done = self.complete.get(&s).copied().unwrap_or(0) >= seq;
                if !done && !pending {
                    self.violations.push(format!("page {page:#x} unmapped while work {s}/{seq} may use it"));
                }
            }
            for (&a, &s) in self.live.range(..page + PAGE) {
                if a + s > page {
                    self.violations.push(format!("page {page:#x} of live block {a:#x}+{s} unmapped"));
                }
            }
        }
        self.pieces.remove(&addr);
        self.unmaps += 1;
    }
}

#[derive(Clone, Default)]
struct Model(Arc<Mutex<World>>);

impl Model {
    fn world(&self) -> std::sync::MutexGuard<'_, World> {
        self.0.lock().unwrap()
    }
}

impl Upstream for Model {
    fn allocate_chunk(&self, _size: usize) -> Result<Chunk> {
        Err(cumem::Error::InvalidState("the model only remaps".into()))
    }
    fn deallocate_chunk(&self, chunk: Chunk) -> Result<()> {
        let mut w = self.world();
        let inside: Vec<(usize, usize)> = w.pieces.range(chunk.addr..chunk.end()).map(|(&a, &s)| (a, s)).collect();
        if !inside.is_empty() {
            w.sync();
        }
        for (a, s) in inside {
            w.unmap_piece(a, s, true);
        }
        if w.top == chunk.end() {
            w.top = chunk.addr;
        }
        Ok(())
    }
    fn can_extend(&self) -> bool {
        true
    }
    fn try_shrink(&self, chunk: Chunk, amount: usize) -> Result<bool> {
        self.deallocate_chunk(Chunk { addr: chunk.end() - amount, size: amount })?;
        Ok(true)
    }
    fn granularity(&self) -> usize {
        PAGE
    }
    fn name(&self) -> &'static str {
        "model"
    }
    fn host_accessible(&self) -> bool {
        false
    }
    fn can_remap(&self) -> bool {
        true
    }
    fn reserve_chunk(&self, size: usize) -> Result<Chunk> {
        let mut w = self.world();
        let addr = BASE.max(w.top);
        w.top = addr + size;
        Ok(Chunk { addr, size })
    }
    fn try_extend_reserved(&self, chunk: Chunk, extra: usize) -> Result<bool> {
        let mut w = self.world();
        if w.top != chunk.end() {
            return Ok(false);
        }
        w.top += extra;
        Ok(true)
    }
    fn map_runs(&self, runs: &[Chunk]) -> Result<u64> {
        let mut w = self.world();
        let mut calls = 0;
        for run in runs {
            assert!(run.addr % PAGE == 0 && run.size % PAGE == 0, "unaligned run {run:?}");
            let mut at = run.addr;
            while at < run.end() {
                if w.mapped(at) {
                    w.violations.push(format!("page {at:#x} mapped twice"));
                }
                if at >= w.top || at < BASE {
                    w.violations.push(format!("page {at:#x} mapped outside the chunks"));
                }
                let rem = run.end() - at;
                let pick = (0..w.spare.len()).filter(|&i| w.spare[i] <= rem).max_by_key(|&i| w.spare[i]);
                let new = if w.piece_cap == 0 { rem } else { rem.min(w.piece_cap) };
                let len = pick.map_or(new, |i| w.spare.swap_remove(i));
                w.pieces.insert(at, len);
                w.maps += 1;
                calls += 1;
                at += len;
            }
        }
        // Unused spares stay kept for the next map.
        Ok(calls)
    }
    fn unmap_within(&self, spans: &[Chunk], want: usize, pending: bool, keep: bool) -> Result<Vec<Chunk>> {
        let mut w = self.world();
        let mut out = Vec::new();
        let mut got = 0;
        let mut synced = false;
        for span in spans {
            let inside: Vec<(usize, usize)> = w
                .pieces
                .range(span.addr..span.end())
                .filter(|(&a, &s)| a + s <= span.end())
                .map(|(&a, &s)| (a, s))
                .collect();
            for (a, s) in inside {
                if got >= want {
                    break;
                }
                if pending && !synced {
                    w.sync();
                    synced = true;
                }
                w.unmap_piece(a, s, false);
                if keep {
                    w.spare.push(s);
                }
                got += s;
                out.push(Chunk { addr: a, size: s });
            }
        }
        Ok(out)
    }
    fn release_kept(&self) {
        self.world().spare.clear();
    }
    fn kept(&self) -> usize {
        self.world().spare.iter().sum()
    }
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn pool(model: &Model) -> Pool<Model> {
    pool_with_slack(model, cumem::pool::DEFAULT_REMAP_SLACK_PPM)
}

/// A pool whose background mapper's steps run only where the test calls
/// [`Pool::mapper_step`] (deterministic).
fn pool_with_slack(model: &Model, slack_ppm: u32) -> Pool<Model> {
    pool_with(model, slack_ppm, false)
}

fn pool_with(model: &Model, slack_ppm: u32, background: bool) -> Pool<Model> {
    let mut pc = PoolConfig::new(PoolKind::Standalone);
    pc.thread_cache = false;
    pc.min_chunk = PAGE;
    pc.remap_slack_ppm = slack_ppm;
    pc.background_mapper = background;
    Pool::new(model.clone(), pc)
}

fn check(model: &Model, pool: &Pool<Model>, step: usize) {
    let w = model.world();
    assert!(w.violations.is_empty(), "step {step}: {:?}", w.violations);
    for (&a, &s) in &w.live {
        for page in World::pages(a, s) {
            assert!(w.mapped(page), "step {step}: live block {a:#x}+{s} on unmapped page {page:#x}");
        }
    }
    let stats = pool.stats();
    assert_eq!(stats.mapped, w.held_bytes(), "step {step}: the pool's held bytes drifted");
    assert_eq!(stats.kept, w.spare.iter().sum::<usize>(), "step {step}: the pool's kept bytes drifted");
    assert!(stats.peak_mapped >= stats.mapped);
    pool.with_fit(|f| f.check_invariants()).unwrap_or_else(|e| panic!("step {step}: {e}"));
}

/// With `oracle`, the pool knows which frees' work completed (as the
/// device allocator's stream registry tells it), so moving their pages
/// needs no wait; a wrong answer shows as a violation at the unmap.
fn run_seed(seed: u64, steps: usize, oracle: bool) {
    let model = Model::default();
    let pool = pool(&model);
    if oracle {
        let m = model.clone();
        pool.set_tag_oracle(Arc::new(move |t: StreamTag| {
            m.world().complete.get(&t.stream).is_some_and(|&c| c >= t.seq)
        }));
    }
    let mut rng = Rng(seed | 1);
    let mut seqs: HashMap<u64, u64> = HashMap::new();
    let mut held: Vec<(usize, usize)> = Vec::new();
    for step in 0..steps {
        let r = rng.below(100);
        if r < 50 || held.is_empty() {
            // Sizes from 256 B to about 1 MiB, log-uniform, some large.
            let size = if rng.below(20) == 0 {
                (1 + rng.below(8) as usize) * PAGE * 3 + 256
            } else {
                256usize << rng.below(12)
            };
            let a = pool.allocate(size, 256).expect("the model never runs out of memory");
            let mut w = model.world();
            w.live.insert(a.addr, a.size);
            // The host reuses the block: it waits for the work of the tag
            // the block carries (as the device allocator does), so that
            // work no longer counts as queued on the block's pages.
            if a.tag != StreamTag::NONE {
                for page in World::pages(a.addr, a.size) {
                    if let Some(&(s, q)) = w.queued.get(&page) {
                        if a.tag == StreamTag::MIXED || (a.tag.stream == s && a.tag.seq >= q) {
                            w.queued.remove(&page);
                        }
                    }
                }
            }
            drop(w);
            held.push((a.addr, a.size));
        } else if r < 95 {
            let i = rng.below(held.len() as u64) as usize;
            let (addr, size) = held.swap_remove(i);
            let stream = rng.below(4);
            let tag = if stream == 0 {
                StreamTag::NONE
            } else {
                let seq = seqs.entry(stream).or_default();
                *seq += 1;
                StreamTag { stream, seq: *seq }
            };
            {
                let mut w = model.world();
                w.live.remove(&addr);
                if tag != StreamTag::NONE {
                    // The block's last use is work queued on the stream.
                    for page in World::pages(addr, size) {
                        w.queued.insert(page, (tag.stream, tag.seq));
                    }
                }
            }
            pool.deallocate(addr, tag).unwrap();
        } else if r < 98 {
            // Some stream's work completes.
            let stream = 1 + rng.below(3);
            let upto = seqs.get(&stream).copied().unwrap_or(0);
            model.world().complete.insert(stream, upto);
        } else {
            // The release path (also the first step on out of memory).
            model.world().sync();
            pool.release_cached().unwrap();
        }
        if rng.below(3) == 0 {
            // The background mapper's work, between two operations.
            pool.mapper_step();
        }
        check(&model, &pool, step);
    }
    let w = model.world();
    assert!(w.maps > 0, "seed {seed}: nothing was ever mapped");
    assert!(w.unmaps > 0, "seed {seed}: no page ever moved, the check saw nothing");
}

#[test]
fn random_remaps_keep_live_blocks_mapped_and_stream_order() {
    for seed in [1u64, 2, 3, 5, 8, 13, 21, 34] {
        run_seed(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15), 4000, seed % 2 == 0);
    }
}

#[test]
fn free_pages_move_to_where_memory_is_needed() {
    // 32 blocks of 4 pages; every other one freed on a stream (its work
    // may still run), a small long-lived block in the first hole; then one
    // block of 60 pages, which fits in no hole: the range grows, but the
    // holes' memory moves there instead of new memory.
    let model = Model::default();
    let pool = pool(&model);
    let blocks: Vec<_> = (0..32).map(|_| pool.allocate(4 * PAGE, 256).unwrap()).collect();
    assert_eq!(pool.stats().mapped, 128 * PAGE);
    for (i, b) in blocks.iter().enumerate().filter(|(i, _)| i % 2 == 1) {
        pool.deallocate(b.addr, StreamTag { stream: 1, seq: i as u64 }).unwrap();
    }
    let pin = pool.allocate(PAGE / 4, 256).unwrap();
    let big = pool.allocate(60 * PAGE, 256).unwrap();
    let s = pool.stats();
    assert!(s.reserved >= 184 * PAGE, "the address space grew: {}", s.reserved / PAGE);
    assert!(s.peak_mapped <= 129 * PAGE, "physical peak {} pages, expected at most 129", s.peak_mapped / PAGE);
    assert!(s.unmap_calls >= 14, "{} unmap calls", s.unmap_calls);
    let w = model.world();
    assert!(w.syncs > 0, "pages freed on a stream moved without waiting for it");
    assert!(w.violations.is_empty(), "{:?}", w.violations);
    drop(w);
    check(&model, &pool, 0);
    // Steady state: the same requests again move nothing.
    pool.deallocate(big.addr, StreamTag::NONE).unwrap();
    let before = pool.stats();
    let again = pool.allocate(60 * PAGE, 256).unwrap();
    let after = pool.stats();
    assert_eq!(after.map_calls, before.map_calls, "a repeated request mapped memory");
    assert_eq!(after.unmap_calls, before.unmap_calls, "a repeated request unmapped memory");
    for a in [again.addr, pin.addr] {
        pool.deallocate(a, StreamTag::NONE).unwrap();
    }
}

#[test]
fn threads_never_see_an_unmapped_page() {
    // The background mapper runs on its own thread beside the four (the
    // oracle lets it move memory whose stream work completed).
    let model = Model::default();
    let pool = Arc::new(pool_with(&model, cumem::pool::DEFAULT_REMAP_SLACK_PPM, true));
    let m = model.clone();
    pool.set_tag_oracle(Arc::new(move |t: StreamTag| m.world().complete.get(&t.stream).is_some_and(|&c| c >= t.seq)));
    let handles: Vec<_> = (0..4u64)
        .map(|t| {
            let (pool, model) = (pool.clone(), model.clone());
            std::thread::spawn(move || {
                let mut rng = Rng((t + 1) * 0x2545_F491_4F6C_DD1D);
                let mut held: Vec<(usize, usize)> = Vec::new();
                let mut seq = 0;
                for _ in 0..3000 {
                    if rng.below(2) == 0 || held.is_empty() {
                        let size = 256usize << rng.below(13);
                        let a = pool.allocate(size, 256).unwrap();
                        let mut w = model.world();
                        for page in World::pages(a.addr, a.size) {
                            assert!(w.mapped(page), "thread {t}: fresh block on unmapped page {page:#x}");
                        }
                        w.live.insert(a.addr, a.size);
                        held.push((a.addr, a.size));
                    } else {
                        let i = rng.below(held.len() as u64) as usize;
                        let (addr, size) = held.swap_remove(i);
                        seq += 1;
                        let tag = StreamTag { stream: 10 + t, seq };
                        {
                            let mut w = model.world();
                            w.live.remove(&addr);
                            for page in World::pages(addr, size) {
                                w.queued.insert(page, (tag.stream, tag.seq));
                            }
                        }
                        pool.deallocate(addr, tag).unwrap();
                        if seq % 16 == 0 {
                            model.world().complete.insert(10 + t, seq);
                        }
                    }
                }
                held
            })
        })
        .collect();
    let mut seen = HashSet::new();
    for h in handles {
        for (addr, _) in h.join().unwrap() {
            assert!(seen.insert(addr), "two threads hold the block at {addr:#x}");
        }
    }
    // Shutdown stops the mapper's work before the figures are compared.
    pool.shutdown().unwrap();
    let w = model.world();
    assert!(w.violations.is_empty(), "{:?}", w.violations);
    assert_eq!(pool.stats().mapped, w.held_bytes());
}

/// The mapper unmaps free memory ahead (keeping it), so an allocation that
/// needs memory where none is mapped maps the kept memory and unmaps
/// nothing itself; what the pool holds never rises above its budget.
#[test]
fn the_mapper_unmaps_ahead_so_an_allocation_only_maps() {
    let model = Model::default();
    let pool = pool_with_slack(&model, 0);
    let m = model.clone();
    pool.set_tag_oracle(Arc::new(move |t: StreamTag| m.world().complete.get(&t.stream).is_some_and(|&c| c >= t.seq)));
    let blocks: Vec<_> = (0..32).map(|_| pool.allocate(4 * PAGE, 256).unwrap()).collect();
    for (i, b) in blocks.iter().enumerate().filter(|(i, _)| i % 2 == 1) {
        model.world().live.remove(&b.addr);
        pool.deallocate(b.addr, StreamTag { stream: 1, seq: i as u64 }).unwrap();
    }
    for b in blocks.iter().step_by(2) {
        model.world().live.insert(b.addr, b.size);
    }
    // Nothing settled yet: the mapper may move nothing (it never waits).
    assert!(!pool.mapper_step(), "the mapper moved memory whose stream work may run");
    assert_eq!(model.world().unmaps, 0);
    model.world().complete.insert(1, u64::MAX);
    while pool.mapper_step() {}
    let s = pool.stats();
    assert_eq!(s.kept, 64 * PAGE, "the mapper kept {} pages", s.kept / PAGE);
    assert_eq!(s.mapped, 128 * PAGE, "the mapper changed what the pool holds");
    check(&model, &pool, 0);
    let unmaps = model.world().unmaps;
    let big = pool.allocate(60 * PAGE, 256).unwrap();
    model.world().live.insert(big.addr, big.size);
    let s = pool.stats();
    assert_eq!(model.world().unmaps, unmaps, "the allocation unmapped memory itself");
    assert_eq!(s.kept, 4 * PAGE);
    assert!(s.peak_mapped <= 128 * PAGE, "physical peak {} pages", s.peak_mapped / PAGE);
    check(&model, &pool, 1);
    // Shutdown releases the kept memory.
    pool.shutdown().unwrap();
    assert_eq!(pool.stats().kept, 0);
    assert!(model.world().spare.is_empty());
}

/// Iterations of a training-like loop whose layout shifts: activations of
/// varying size, small blocks that outlive their iteration (they pin pages
/// in the middle of the range), everything freed on a stream. Returns the
/// pool's stats and the model's map and unmap counts of the last half.
fn shifting_layout(slack_ppm: u32, piece_pages: usize, seed: u64) -> (cumem::pool::PoolStats, u64, u64) {
    let model = Model::default();
    model.world().piece_cap = piece_pages * PAGE;
    let pool = pool_with_slack(&model, slack_ppm);
    let mut rng = Rng(seed | 1);
    let mut pins: std::collections::VecDeque<usize> = Default::default();
    let mut seq = 0;
    let (mut maps_half, mut unmaps_half) = (0, 0);
    let iterations = 400;
    for it in 0..iterations {
        if it == iterations / 2 {
            let w = model.world();
            (maps_half, unmaps_half) = (w.maps, w.unmaps);
        }
        let mut acts = Vec::new();
        for _ in 0..4 {
            let pages = 4 + rng.below(40) as usize;
            let a = pool.allocate(pages * PAGE - 512, 256).unwrap();
            model.world().live.insert(a.addr, a.size);
            acts.push(a);
            let p = pool.allocate(PAGE / 8, 256).unwrap();
            model.world().live.insert(p.addr, p.size);
            pins.push_back(p.addr);
        }
        while pins.len() > 8 {
            let p = pins.pop_front().unwrap();
            model.world().live.remove(&p);
            pool.deallocate(p, StreamTag::NONE).unwrap();
        }
        while !acts.is_empty() {
            let a = acts.swap_remove(rng.below(acts.len() as u64) as usize);
            seq += 1;
            {
                let mut w = model.world();
                w.live.remove(&a.addr);
                for page in World::pages(a.addr, a.size) {
                    w.queued.insert(page, (1, seq));
                }
            }
            pool.deallocate(a.addr, StreamTag { stream: 1, seq }).unwrap();
        }
        if it % 7 == 0 {
            model.world().complete.insert(1, seq);
        }
        pool.mapper_step();
        check(&model, &pool, it);
    }
    let w = model.world();
    (pool.stats(), w.maps - maps_half, w.unmaps - unmaps_half)
}

#[test]
fn physical_memory_stays_within_the_budget_when_the_layout_shifts() {
    for seed in [3u64, 17, 51] {
        let seed = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        // Memory in pieces of one page: every free page can move, so the
        // budget holds exactly.
        let mut peaks = Vec::new();
        for slack in [0, cumem::pool::DEFAULT_REMAP_SLACK_PPM, 1_000_000] {
            let (s, maps, unmaps) = shifting_layout(slack, 1, seed);
            let (peak, floor) = (s.peak_mapped / PAGE, s.peak_touched / PAGE);
            let budget = floor + (floor * slack as usize).div_ceil(1_000_000);
            eprintln!("seed {seed:#x} slack {slack} ppm: peak mapped {peak} pages, floor {floor}, maps/unmaps in the last half {maps}/{unmaps}");
            assert!(peak <= budget, "seed {seed:#x} slack {slack} ppm: {peak} pages mapped, budget {budget}");
            if slack == 1_000_000 {
                // The control: a budget this loose is never reached, and
                // nothing moves once the range has grown.
                assert_eq!((maps, unmaps), (0, 0), "seed {seed:#x}: memory moved under a loose budget");
            }
            peaks.push(peak);
        }
        assert!(
            peaks[0] * 5 < peaks[2] * 4,
            "seed {seed:#x}: the budget saved little ({peaks:?}); the test shows nothing"
        );
        // Pieces of four pages: a piece that straddles a live block cannot
        // move, so the budget is a target; the excess stays small.
        let (s, _, _) = shifting_layout(cumem::pool::DEFAULT_REMAP_SLACK_PPM, 4, seed);
        let (peak, floor) = (s.peak_mapped / PAGE, s.peak_touched / PAGE);
        assert!(peak * 100 <= floor * 108, "seed {seed:#x}, 4-page pieces: {peak} pages mapped for a floor of {floor}");
    }
}

/// Memory whose stream work is known complete moves without waiting for
/// the device: the same layout as `free_pages_move_to_where_memory_is_needed`
/// (which waits: its pool knows nothing of completion), with an oracle
/// that says the stream's work is done.
#[test]
fn settled_free_pages_move_without_a_wait() {
    let model = Model::default();
    let pool = pool(&model);
    let m = model.clone();
    pool.set_tag_oracle(Arc::new(move |t: StreamTag| m.world().complete.get(&t.stream).is_some_and(|&c| c >= t.seq)));
    let blocks: Vec<_> = (0..32).map(|_| pool.allocate(4 * PAGE, 256).unwrap()).collect();
    for (i, b) in blocks.iter().enumerate().filter(|(i, _)| i % 2 == 1) {
        let tag = StreamTag { stream: 1, seq: i as u64 };
        {
            let mut w = model.world();
            for page in World::pages(b.addr, b.size) {
                w.queued.insert(page, (tag.stream, tag.seq));
            }
        }
        pool.deallocate(b.addr, tag).unwrap();
    }
    // The stream's work completes (the host saw it).
    model.world().complete.insert(1, u64::MAX);
    let big = pool.allocate(60 * PAGE, 256).unwrap();
    let s = pool.stats();
    assert!(s.unmap_calls >= 14, "{} unmap calls: nothing moved, the test shows nothing", s.unmap_calls);
    assert!(s.peak_mapped <= 130 * PAGE, "physical peak {} pages", s.peak_mapped / PAGE);
    let w = model.world();
    assert_eq!(w.syncs, 0, "settled memory moved only after a wait for the device");
    assert!(w.violations.is_empty(), "{:?}", w.violations);
    drop(w);
    pool.deallocate(big.addr, StreamTag::NONE).unwrap();
}

/// The real mapper thread over host memory: waves whose large blocks grow
/// leave the pool above its budget (no slack) with free memory whose
/// stream work completes a little later; without any further allocation
/// the mapper brings what the pool holds back to its budget.
#[test]
fn the_mapper_thread_brings_the_pool_back_to_its_budget() {
    let host = cumem::upstream::HostExpandable::new(16 << 30).unwrap();
    let page = 2 << 20;
    let mut pc = PoolConfig::new(PoolKind::Device);
    pc.thread_cache = false;
    pc.background_mapper = true;
    pc.remap_slack_ppm = 0;
    let pool = Pool::new(host, pc);
    assert!(pool.remaps());
    let done = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let d = done.clone();
    pool.set_tag_oracle(Arc::new(move |t: StreamTag| t.seq <= d.load(std::sync::atomic::Ordering::Acquire)));
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let (mut seq, mut live) = (0u64, Vec::new());
    for wave in 0..24usize {
        let big = pool.allocate((wave + 1) * 3 * page + 4096, 256).unwrap();
        live.push((big.addr, big.size));
        for _ in 0..8 {
            let a = pool.allocate(256usize << rng.below(14), 256).unwrap();
            live.push((a.addr, a.size));
        }
        let mut keep = Vec::new();
        for (i, b) in live.drain(..).enumerate() {
            if b.0 == big.addr || (i % 3 == 0 && b.1 < page) {
                seq += 1;
                pool.deallocate(b.0, StreamTag { stream: 7, seq }).unwrap();
            } else {
                keep.push(b);
            }
        }
        live = keep;
        // The stream's work completes.
        done.store(seq, std::sync::atomic::Ordering::Release);
    }
    let over = |s: &cumem::pool::PoolStats| s.mapped > s.peak_touched;
    let start = std::time::Instant::now();
    while over(&pool.stats()) && start.elapsed() < std::time::Duration::from_secs(10) {
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    let s = pool.stats();
    assert!(!over(&s), "the pool holds {} pages for a budget of {}", s.mapped / page, s.peak_touched / page);
    pool.with_fit(|f| f.check_invariants()).unwrap();
    for (addr, _) in live {
        pool.deallocate(addr, StreamTag::NONE).unwrap();
    }
}

/// Resetting peak statistics (PyTorch programs do it every epoch) resets
/// the reported touched-page peak only: the remap budget rests on the
/// largest touched count ever, so the pool keeps the memory it may hold
/// and a later return to the old peak costs no new memory. Control: before
/// the fix the reset lowered the budget to the pages touched at the reset
/// and the mapper then gave back everything above it (this test failed
/// with 64 physical pages falling to 8).
#[test]
fn a_peak_reset_changes_the_reported_peak_not_the_remap_budget() {
    let model = Model::default();
    let pool = pool_with_slack(&model, 0);
    let blocks: Vec<_> = (0..64).map(|_| pool.allocate(PAGE, 256).unwrap()).collect();
    // One page in eight stays live.
    for b in blocks.iter().enumerate().filter(|(i, _)| i % 8 != 0).map(|(_, b)| b) {
        pool.deallocate(b.addr, StreamTag::NONE).unwrap();
    }
    let settle = |pool: &Pool<Model>| {
        for _ in 0..64 {
            pool.mapper_step();
        }
    };
    settle(&pool);
    let before = pool.stats();
    assert_eq!(before.peak_touched, 64 * PAGE, "the test needs a peak of 64 touched pages");
    assert_eq!(before.touched, 8 * PAGE, "one page in eight stays touched");
    assert_eq!(before.mapped, 64 * PAGE, "the budget of 64 pages keeps all of them");
    pool.reset_peaks();
    let reset = pool.stats();
    assert_eq!(reset.peak_touched, reset.touched, "the reported peak is reset");
    settle(&pool);
    let after = pool.stats();
    assert_eq!(
        after.mapped / PAGE,
        before.mapped / PAGE,
        "physical pages after a peak reset (the remap budget must not change)"
    );
    let w = model.world();
    assert!(w.violations.is_empty(), "{:?}", w.violations);
    drop(w);
    pool.with_fit(|f| f.check_invariants()).unwrap();
    for b in blocks.iter().step_by(8) {
        pool.deallocate(b.addr, StreamTag::NONE).unwrap();
    }
}
