//! The range hand-over between shards (`pool/reclaim.rs`,
//! `pool/shard_upstream.rs`): a shard whose thread ended is idle; the
//! first thread's shard grows and takes the idle shard's free pages
//! (unmapped and given back before new memory is mapped), while a new
//! thread claims the idle shard, frees a block into it (a free in flight)
//! and allocates there. In every interleaving no page under a live block
//! is unmapped, every block handed out sits on mapped pages, and the
//! shards' count of held memory is the device's.
//!
//! Both shards' upstreams share one device model (one address space).

#![cfg(loom)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex as StdMutex;

use cumem::pool::{release_thread_shards, PoolConfig, Shards, StreamTag, UpstreamFactory};
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

#[derive(Default, Clone)]
struct PageUpstream(std::sync::Arc<StdMutex<Device>>);

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

fn assert_mapped(d: &Device, addr: usize, size: usize) {
    for page in (addr / PAGE * PAGE..addr + size).step_by(PAGE) {
        assert!(d.mapped(page), "block {addr:#x}+{size} on unmapped page {page:#x}");
    }
}

/// Model runs in which the idle shard gave pages (the others had the new
/// thread claim it first).
static GAVE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[test]
fn idle_shard_gives_pages_while_a_free_is_in_flight() {
    model(|| {
        let dev = PageUpstream::default();
        let mut c = PoolConfig::new(PoolKind::Standalone);
        c.thread_cache = false;
        c.min_chunk = PAGE;
        c.remap_slack_ppm = 0;
        c.idle_shards_give = true;
        let more = dev.clone();
        let make: UpstreamFactory = Box::new(move || Ok(Box::new(more.clone()) as Box<dyn Upstream>));
        let set = Arc::new(Shards::new(Box::new(dev.clone()), Some(make), c, 2));
        // This thread takes shard 0.
        let first = set.allocate(256, 256).unwrap();
        dev.dev().live.insert((first.addr, first.size));
        // A thread grows shard 1, keeps two blocks and ends.
        let s = set.clone();
        let (b, c) = thread::spawn(move || {
            let a = s.allocate(2 * PAGE, 256).unwrap();
            let b = s.allocate(PAGE, 256).unwrap();
            let c = s.allocate(2 * PAGE, 256).unwrap();
            s.deallocate(a.addr, StreamTag::NONE).unwrap();
            release_thread_shards();
            (b, c)
        })
        .join()
        .unwrap();
        assert_eq!(set.made(), 2);
        dev.dev().live.extend([(b.addr, b.size), (c.addr, c.size)]);
        // A new thread takes the idle shard: frees a block there (in
        // flight while the grower reclaims) and allocates.
        let (s, d2) = (set.clone(), dev.clone());
        let user = thread::spawn(move || {
            d2.dev().live.remove(&(c.addr, c.size));
            s.deallocate(c.addr, StreamTag::NONE).unwrap();
            let d = s.allocate(2 * PAGE, 256).unwrap();
            d2.dev().live.insert((d.addr, d.size));
            assert_mapped(&d2.dev(), d.addr, d.size);
            release_thread_shards();
            d
        });
        // Shard 0 grows: the idle shard's free pages go first.
        let g = set.allocate(4 * PAGE, 256).unwrap();
        dev.dev().live.insert((g.addr, g.size));
        let d = user.join().unwrap();
        let dv = dev.dev();
        assert!(dv.violations.is_empty(), "{:?}", dv.violations);
        for (addr, size) in [(g.addr, g.size), (d.addr, d.size), (b.addr, b.size), (first.addr, first.size)] {
            assert_mapped(&dv, addr, size);
        }
        let held: usize = dv.pieces.values().sum::<usize>() + dv.spare.iter().sum::<usize>();
        drop(dv);
        assert_eq!(set.stats().mapped, held, "the shards' held memory drifted from the device's");
        set.check_invariants().expect("best-fit invariants");
        if set.bytes_reclaimed() > 0 {
            GAVE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        for x in [g, d, b, first] {
            set.deallocate(x.addr, StreamTag::NONE).unwrap();
        }
        release_thread_shards();
    });
    assert!(GAVE.load(std::sync::atomic::Ordering::Relaxed) > 0, "no run handed pages over");
}
