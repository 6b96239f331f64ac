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
//!
//! The model and its harness are here; the runs are in `runs.rs`, the
//! remap budget's checks in `budget.rs`, lending behind fences in
//! `fenced.rs`.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use cumem::pool::{Pool, PoolConfig, StreamTag};
use cumem::upstream::{Chunk, Queued, Upstream};
use cumem::{PoolKind, Result};

mod budget;
mod fenced;
mod runs;

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
    /// Whether moves lend memory (old mappings stay until `unmap_stale`
    /// or a map over them), as the CUDA upstream does: `fenced.rs`.
    lends: bool,
    /// Old mappings of lent memory: address → (size, the fence: work
    /// queued up to its point on each of its streams may still use it).
    stale: BTreeMap<usize, (usize, Option<Points>)>,
    /// The fence made last, and the stream ordered after it (the test
    /// clears it before each allocation).
    last_fence: Option<(Points, u64)>,
    /// The same of every fence made, by the fence's address.
    fences: HashMap<usize, (Points, u64)>,
    /// The stream an allocation is being made for (fences must be made
    /// on it).
    requesting: u64,
    /// Per stream, the last free's sequence number.
    freed: HashMap<u64, u64>,
    /// Pieces lent, of them behind a fence, and waits for fences.
    lent: u64,
    fenced: u64,
    fence_waits: u64,
}

/// A model fence: (stream, point) for each stream it covers.
type Points = Vec<(u64, u64)>;

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

    /// The mapped pieces lying wholly inside `span`, as (address, size).
    fn pieces_inside(&self, span: &Chunk) -> Vec<(usize, usize)> {
        self.pieces
            .range(span.addr..span.end())
            .filter(|&(&a, &s)| a + s <= span.end())
            .map(|(&a, &s)| (a, s))
            .collect()
    }

    /// Whether the work a fence covers is complete.
    fn passed(&self, fence: Option<&Points>) -> bool {
        fence.is_none_or(|f| f.iter().all(|&(s, point)| self.complete.get(&s).copied().unwrap_or(0) >= point))
    }

    /// Waits for a fence: the work of its streams up to their points
    /// completes.
    fn wait_fence(&mut self, fence: &Points) {
        self.fence_waits += 1;
        for &(s, point) in fence {
            let c = self.complete.entry(s).or_default();
            *c = (*c).max(point);
        }
    }

    /// Unmaps the old mapping at `addr` (waiting for its fence first with
    /// `wait`); `false` when its fence has not passed and `wait` is off.
    fn unmap_stale_at(&mut self, addr: usize, wait: bool) -> bool {
        let Some((size, fence)) = self.stale.get(&addr).cloned() else { return false };
        if !self.passed(fence.as_ref()) {
            match (wait, fence) {
                (true, Some(f)) => self.wait_fence(&f),
                _ => return false,
            }
        }
        for page in Self::pages(addr, size) {
            if let Some(&(s, seq)) = self.queued.get(&page) {
                if self.complete.get(&s).copied().unwrap_or(0) < seq {
                    self.violations
                        .push(format!("old mapping of page {page:#x} unmapped while work {s}/{seq} may use it"));
                }
            }
        }
        self.stale.remove(&addr);
        self.unmaps += 1;
        true
    }

    /// The old mappings overlapping `[addr, addr + size)`.
    fn stale_in(&self, addr: usize, size: usize) -> Vec<usize> {
        let first = self.stale.range(..=addr).next_back().map_or(addr, |(&a, _)| a);
        self.stale.range(first..addr + size).filter(|&(&a, &(s, _))| a + s > addr).map(|(&a, _)| a).collect()
    }
}

/// A fence of the model: the work of each of its streams up to its point.
struct ModelFence {
    world: Arc<Mutex<World>>,
    points: Points,
}

impl cumem::pool::Fence for ModelFence {
    fn passed(&self) -> bool {
        self.world.lock().unwrap().passed(Some(&self.points))
    }
    fn wait(&self) -> Result<()> {
        self.world.lock().unwrap().wait_fence(&self.points);
        Ok(())
    }
}

#[derive(Clone, Default)]
struct Model(Arc<Mutex<World>>);

impl Model {
    fn world(&self) -> std::sync::MutexGuard<'_, World> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Upstream for Model {
    fn allocate_chunk(&self, _size: usize) -> Result<Chunk> {
        Err(cumem::Error::InvalidState("the model only remaps".into()))
    }
    fn deallocate_chunk(&self, chunk: Chunk) -> Result<()> {
        let mut w = self.world();
        let inside: Vec<(usize, usize)> = w.pieces.range(chunk.addr..chunk.end()).map(|(&a, &s)| (a, s)).collect();
        let stale = w.stale_in(chunk.addr, chunk.size);
        if !inside.is_empty() || !stale.is_empty() {
            w.sync();
        }
        for a in stale {
            w.unmap_stale_at(a, true);
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
            // Old mappings there go first, after their fences.
            for a in w.stale_in(run.addr, run.size) {
                w.unmap_stale_at(a, true);
            }
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
            for (a, s) in w.pieces_inside(span) {
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
    fn lend_within(&self, spans: &[Chunk], want: usize, queued: Queued) -> Result<Vec<Chunk>> {
        let mut w = self.world();
        if !w.lends {
            drop(w);
            return self.unmap_within(spans, want, queued.waits(), true);
        }
        let fence = match queued {
            Queued::Nothing => None,
            Queued::Any => {
                w.sync();
                None
            }
            Queued::Before(fence) => {
                // A move makes a fence per stream and may lend behind one
                // in more than one call.
                let f = w.fences.get(&(Arc::as_ptr(&fence) as *const () as usize)).cloned();
                let requesting = w.requesting;
                if f.as_ref().is_none_or(|(_, then)| *then != requesting) {
                    w.violations
                        .push(format!("a fence {f:?} that orders no work of the requesting stream {requesting}"));
                }
                f.map(|(points, _)| points)
            }
        };
        let mut out = Vec::new();
        let mut got = 0;
        for span in spans {
            for (a, s) in w.pieces_inside(span) {
                if got >= want {
                    break;
                }
                for page in World::pages(a, s) {
                    if let Some(&(st, seq)) = w.queued.get(&page) {
                        let done = w.complete.get(&st).copied().unwrap_or(0) >= seq;
                        let behind = fence.as_ref().is_some_and(|f| f.iter().any(|&(fs, p)| fs == st && seq <= p));
                        if !done && !behind {
                            w.violations.push(format!("page {page:#x} lent while work {st}/{seq} may use it"));
                        }
                    }
                    let hits: Vec<_> = w
                        .live
                        .range(..page + PAGE)
                        .filter(|&(&la, &ls)| la + ls > page)
                        .map(|(&la, &ls)| (la, ls))
                        .collect();
                    for (la, ls) in hits {
                        w.violations.push(format!("page {page:#x} of live block {la:#x}+{ls} lent"));
                    }
                }
                w.pieces.remove(&a);
                w.spare.push(s);
                w.stale.insert(a, (s, fence.clone()));
                w.lent += 1;
                w.fenced += u64::from(fence.is_some());
                got += s;
                out.push(Chunk { addr: a, size: s });
            }
        }
        Ok(out)
    }
    fn unmap_stale(&self, most: usize, wait: bool) -> usize {
        let mut w = self.world();
        let addrs: Vec<usize> = w.stale.keys().copied().collect();
        let mut n = 0;
        for a in addrs {
            if n >= most {
                break;
            }
            if w.unmap_stale_at(a, wait) {
                n += 1;
            }
        }
        n
    }
    fn has_stale(&self) -> bool {
        !self.world().stale.is_empty()
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

/// Sizes from 256 B to about 1 MiB, log-uniform, one in twenty large
/// (3 to 24 pages and a bit).
fn random_size(rng: &mut Rng) -> usize {
    if rng.below(20) == 0 {
        (1 + rng.below(8) as usize) * PAGE * 3 + 256
    } else {
        256usize << rng.below(12)
    }
}

fn pool(model: &Model) -> Pool<Model> {
    pool_with_slack(model, cumem::pool::DEFAULT_REMAP_SLACK_PPM)
}

fn pool_with_slack(model: &Model, slack_ppm: u32) -> Pool<Model> {
    let mut pc = PoolConfig::new(PoolKind::Standalone);
    pc.thread_cache = false;
    pc.min_chunk = PAGE;
    pc.remap_slack_ppm = slack_ppm;
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

/// The host takes block `a` into use: recorded live, and it waits for the
/// work of the tag the block carries (as the device allocator does), so
/// that work no longer counts as queued on the block's pages.
fn reuse(w: &mut World, a: &cumem::pool::Allocation) {
    w.live.insert(a.addr, a.size);
    if a.tag != StreamTag::NONE {
        for page in World::pages(a.addr, a.size) {
            if let Some(&(s, q)) = w.queued.get(&page) {
                if a.tag == StreamTag::MIXED || (a.tag.stream == s && a.tag.seq >= q) {
                    w.queued.remove(&page);
                }
            }
        }
    }
}
