//! A modelled device for remapping pools: address space handed out by a
//! bump pointer, pieces mapped and unmapped page by page, kept memory,
//! and the live blocks a model's threads hold, so a model can check that
//! no page under a live block is ever unmapped.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex as StdMutex;

use cumem::upstream::{Chunk, Queued, Upstream};

/// The modelled page.
pub const PAGE: usize = 4096;
/// Where the modelled address space starts.
const BASE: usize = 1 << 32;

/// Mapped pieces, kept memory and the live blocks the threads hold: plain
/// std state, not part of what is modelled (every access is one short
/// critical section that makes no loom call).
#[derive(Default)]
pub struct Device {
    pub top: usize,
    pub pieces: BTreeMap<usize, usize>,
    pub spare: Vec<usize>,
    pub live: BTreeSet<(usize, usize)>,
    pub violations: Vec<String>,
    /// Old mappings of lent memory (`lend_within`), address → size.
    pub stale: BTreeMap<usize, usize>,
    /// Old mappings being unmapped with the device's lock dropped.
    pub stale_busy: BTreeMap<usize, usize>,
}

impl Device {
    /// Whether `page` lies in a mapped piece.
    pub fn mapped(&self, page: usize) -> bool {
        self.pieces.range(..=page).next_back().is_some_and(|(&a, &s)| page < a + s)
    }

    /// Whether `[addr, addr + size)` overlaps an entry of `map`.
    fn overlaps(map: &BTreeMap<usize, usize>, addr: usize, size: usize) -> bool {
        map.range(..addr + size).next_back().is_some_and(|(&a, &s)| a + s > addr)
    }

    /// Unmaps an old mapping: it must hold no live block and no piece
    /// (a piece there would be memory mapped over it).
    fn unmap_old(&mut self, a: usize, s: usize) {
        let hits: Vec<_> = self.live.iter().filter(|&&(la, ls)| la < a + s && a < la + ls).copied().collect();
        for (la, ls) in hits {
            self.violations.push(format!("old mapping {a:#x}+{s} under live block {la:#x}+{ls} unmapped"));
        }
        if Self::overlaps(&self.pieces, a, s) {
            self.violations.push(format!("old mapping {a:#x}+{s} had memory mapped over it"));
        }
    }

    /// Panics unless every page of the block `[addr, addr + size)` is mapped.
    pub fn assert_mapped(&self, addr: usize, size: usize) {
        for page in (addr / PAGE * PAGE..addr + size).step_by(PAGE) {
            assert!(self.mapped(page), "block {addr:#x}+{size} on unmapped page {page:#x}");
        }
    }
}

/// An upstream over a modelled device's pages (clones share the device).
#[derive(Default, Clone)]
pub struct PageUpstream(std::sync::Arc<StdMutex<Device>>);

impl PageUpstream {
    /// The device's state.
    pub fn dev(&self) -> std::sync::MutexGuard<'_, Device> {
        self.0.lock().unwrap()
    }
}

impl Upstream for PageUpstream {
    fn allocate_chunk(&self, _: usize) -> cumem::Result<Chunk> {
        Err(cumem::Error::InvalidState("the model only remaps".into()))
    }
    fn deallocate_chunk(&self, chunk: Chunk) -> cumem::Result<()> {
        let mut d = self.dev();
        let inside: Vec<usize> = d.pieces.range(chunk.addr..chunk.end()).map(|(&a, _)| a).collect();
        for a in inside {
            d.pieces.remove(&a);
        }
        Ok(())
    }
    fn granularity(&self) -> usize {
        PAGE
    }
    fn name(&self) -> &'static str {
        "pages"
    }
    fn host_accessible(&self) -> bool {
        false
    }
    fn can_extend(&self) -> bool {
        true
    }
    fn can_remap(&self) -> bool {
        true
    }
    fn reserve_chunk(&self, size: usize) -> cumem::Result<Chunk> {
        let mut d = self.dev();
        let addr = BASE.max(d.top);
        d.top = addr + size;
        Ok(Chunk { addr, size })
    }
    fn try_extend_reserved(&self, chunk: Chunk, extra: usize) -> cumem::Result<bool> {
        let mut d = self.dev();
        if d.top != chunk.end() {
            return Ok(false);
        }
        d.top += extra;
        Ok(true)
    }
    fn map_runs(&self, runs: &[Chunk]) -> cumem::Result<u64> {
        // Old mappings there that the mapper is unmapping: wait for them.
        while runs.iter().any(|r| Device::overlaps(&self.dev().stale_busy, r.addr, r.size)) {
            loom::thread::yield_now();
        }
        let mut d = self.dev();
        let mut calls = 0;
        for run in runs {
            // Old mappings there go first.
            let old: Vec<(usize, usize)> =
                d.stale.range(..run.end()).filter(|(&a, &s)| a + s > run.addr).map(|(&a, &s)| (a, s)).collect();
            for (a, s) in old {
                d.stale.remove(&a);
                d.unmap_old(a, s);
            }
            let mut at = run.addr;
            while at < run.end() {
                if d.mapped(at) {
                    d.violations.push(format!("page {at:#x} mapped twice"));
                }
                if Device::overlaps(&d.stale, at, PAGE) || Device::overlaps(&d.stale_busy, at, PAGE) {
                    d.violations.push(format!("page {at:#x} mapped over an old mapping"));
                }
                let len = match d.spare.pop() {
                    Some(s) if s <= run.end() - at => s,
                    Some(s) => {
                        d.spare.push(s);
                        PAGE
                    }
                    None => PAGE,
                };
                d.pieces.insert(at, len);
                at += len;
                calls += 1;
            }
        }
        Ok(calls)
    }
    fn unmap_within(&self, spans: &[Chunk], want: usize, _pending: bool, keep: bool) -> cumem::Result<Vec<Chunk>> {
        let mut d = self.dev();
        let mut out = Vec::new();
        let mut got = 0;
        for span in spans {
            let inside: Vec<(usize, usize)> = d
                .pieces
                .range(span.addr..span.end())
                .filter(|(&a, &s)| a + s <= span.end())
                .map(|(&a, &s)| (a, s))
                .collect();
            for (a, s) in inside {
                if got >= want {
                    break;
                }
                let hits: Vec<_> = d.live.iter().filter(|&&(la, ls)| la < a + s && a < la + ls).copied().collect();
                for (la, ls) in hits {
                    d.violations.push(format!("piece {a:#x}+{s} of live block {la:#x}+{ls} unmapped"));
                }
                d.pieces.remove(&a);
                if keep {
                    d.spare.push(s);
                }
                got += s;
                out.push(Chunk { addr: a, size: s });
            }
        }
        Ok(out)
    }
    fn lend_within(&self, spans: &[Chunk], want: usize, queued: Queued) -> cumem::Result<Vec<Chunk>> {
        // As `unmap_within` keeping the memory, with the old mappings left.
        let out = self.unmap_within(spans, want, queued.waits(), true)?;
        let mut d = self.dev();
        for c in &out {
            d.stale.insert(c.addr, c.size);
        }
        Ok(out)
    }
    fn unmap_stale(&self, most: usize, _wait: bool) -> usize {
        // Taken under the lock, unmapped with it dropped (a map may come
        // in between), then gone.
        let taken: BTreeMap<usize, usize> = {
            let mut d = self.dev();
            let keys: Vec<usize> = d.stale.keys().take(most).copied().collect();
            keys.into_iter().filter_map(|k| d.stale.remove(&k).map(|s| (k, s))).collect()
        };
        self.dev().stale_busy.extend(taken.iter().map(|(&a, &s)| (a, s)));
        loom::thread::yield_now();
        let mut d = self.dev();
        for (&a, &s) in &taken {
            d.unmap_old(a, s);
            d.stale_busy.remove(&a);
        }
        taken.len()
    }
    fn has_stale(&self) -> bool {
        !self.dev().stale.is_empty()
    }
    fn mapped_pieces(&self, addr: usize, size: usize) -> Option<Vec<Chunk>> {
        let d = self.dev();
        let end = addr + size;
        let mut pieces = Vec::new();
        let mut covered = addr;
        let first = d.pieces.range(..=addr).next_back().map_or(addr, |(&a, _)| a);
        for (&a, &s) in d.pieces.range(first..end) {
            if a + s <= addr {
                continue;
            }
            if a > covered {
                return None;
            }
            pieces.push(Chunk { addr: a, size: s });
            covered = a + s;
        }
        (size > 0 && covered >= end).then_some(pieces)
    }
    fn release_kept(&self) {
        self.dev().spare.clear();
    }
    fn kept(&self) -> usize {
        self.dev().spare.iter().sum()
    }
}
