//! The background mapper (`pool/mapper.rs`) against a free and an
//! allocation in flight: the mapper's step picks free pieces under the
//! pool lock, unmaps them outside it and records the result, while another
//! thread frees a block and allocates again. In every interleaving no page
//! under a live block is unmapped, every block handed out sits on mapped
//! pages, and the pool's count of held memory is the upstream's.

#![cfg(loom)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex as StdMutex;

use cumem::pool::{Pool, PoolConfig, StreamTag};
use cumem::upstream::{Chunk, Upstream};
use cumem::PoolKind;
use cumem_loom_tests::model;
use loom::sync::Arc;
use loom::thread;

const PAGE: usize = 4096;
const BASE: usize = 1 << 32;

/// Mapped pieces, kept memory and the live blocks the threads hold: plain
/// std state, not part of what is modelled (every access is one short
/// critical section that makes no loom call).
#[derive(Default)]
struct Device {
    top: usize,
    pieces: BTreeMap<usize, usize>,
    spare: Vec<usize>,
    live: BTreeSet<(usize, usize)>,
    violations: Vec<String>,
}

impl Device {
    fn mapped(&self, page: usize) -> bool {
        self.pieces.range(..=page).next_back().is_some_and(|(&a, &s)| page < a + s)
    }
}

#[derive(Default)]
struct PageUpstream(StdMutex<Device>);

impl PageUpstream {
    fn dev(&self) -> std::sync::MutexGuard<'_, Device> {
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
        let mut d = self.dev();
        let mut calls = 0;
        for run in runs {
            let mut at = run.addr;
            while at < run.end() {
                if d.mapped(at) {
                    d.violations.push(format!("page {at:#x} mapped twice"));
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
    fn release_kept(&self) {
        self.dev().spare.clear();
    }
    fn kept(&self) -> usize {
        self.dev().spare.iter().sum()
    }
}

/// A remapping pool with no slack, no thread cache and no mapper thread
/// (the model runs the mapper's step on a thread of its own).
fn pool() -> Pool<PageUpstream> {
    let mut c = PoolConfig::new(PoolKind::Standalone);
    c.thread_cache = false;
    c.min_chunk = PAGE;
    c.remap_slack_ppm = 0;
    c.background_mapper = false;
    Pool::new(PageUpstream::default(), c)
}

/// Checks that `addr+size`'s pages are all mapped.
fn assert_mapped(pool: &Pool<PageUpstream>, addr: usize, size: usize) {
    let d = pool.upstream().dev();
    for page in (addr / PAGE * PAGE..addr + size).step_by(PAGE) {
        assert!(d.mapped(page), "block {addr:#x}+{size} handed out on unmapped page {page:#x}");
    }
}

/// One block freed earlier gives the mapper memory to take; while the
/// mapper steps, another thread frees the second block and allocates a
/// block as large as both (which touches the pages the mapper may be
/// moving).
#[test]
fn the_mapper_and_a_free_in_flight_never_unmap_live_memory() {
    model(|| {
        let pool = Arc::new(pool());
        let a = pool.allocate(2 * PAGE, 256).unwrap();
        let b = pool.allocate(2 * PAGE, 256).unwrap();
        pool.upstream().dev().live.insert((b.addr, b.size));
        pool.deallocate(a.addr, StreamTag::NONE).unwrap();
        let p = pool.clone();
        let user = thread::spawn(move || {
            p.upstream().dev().live.remove(&(b.addr, b.size));
            p.deallocate(b.addr, StreamTag::NONE).unwrap();
            let c = p.allocate(4 * PAGE, 256).unwrap();
            p.upstream().dev().live.insert((c.addr, c.size));
            assert_mapped(&p, c.addr, c.size);
            c
        });
        let p = pool.clone();
        let mapper = thread::spawn(move || {
            p.mapper_step();
        });
        mapper.join().unwrap();
        let c = user.join().unwrap();
        assert_mapped(&pool, c.addr, c.size);
        let d = pool.upstream().dev();
        assert!(d.violations.is_empty(), "{:?}", d.violations);
        let held: usize = d.pieces.values().sum::<usize>() + d.spare.iter().sum::<usize>();
        drop(d);
        let s = pool.stats();
        assert_eq!(s.mapped, held, "the pool's held memory drifted from the upstream's");
        assert!(s.peak_mapped <= 4 * PAGE, "physical peak {} pages", s.peak_mapped / PAGE);
        pool.with_fit(|f| f.check_invariants()).expect("best-fit invariants");
        pool.deallocate(c.addr, StreamTag::NONE).unwrap();
    });
}

/// The mapper steps while the pool shuts down: once shutdown returns the
/// mapper changes nothing, and the pool holds nothing but what the upstream
/// has mapped.
#[test]
fn a_shutdown_during_a_step_leaves_nothing_kept_or_moving() {
    model(|| {
        let pool = Arc::new(pool());
        let a = pool.allocate(2 * PAGE, 256).unwrap();
        let b = pool.allocate(2 * PAGE, 256).unwrap();
        pool.upstream().dev().live.insert((b.addr, b.size));
        pool.deallocate(a.addr, StreamTag::NONE).unwrap();
        let p = pool.clone();
        let mapper = thread::spawn(move || {
            p.mapper_step();
        });
        pool.shutdown().unwrap();
        let after = pool.upstream().dev().pieces.clone();
        mapper.join().unwrap();
        let d = pool.upstream().dev();
        assert_eq!(d.pieces, after, "the mapper moved memory after shutdown returned");
        assert!(d.spare.is_empty(), "memory kept after shutdown");
        assert!(d.violations.is_empty(), "{:?}", d.violations);
        assert_mapped_locked(&d, b.addr, b.size);
        drop(d);
        assert_eq!(pool.stats().kept, 0);
    });
}

fn assert_mapped_locked(d: &Device, addr: usize, size: usize) {
    for page in (addr / PAGE * PAGE..addr + size).step_by(PAGE) {
        assert!(d.mapped(page), "live block {addr:#x}+{size} on unmapped page {page:#x}");
    }
}
