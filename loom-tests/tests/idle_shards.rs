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

use cumem::pool::{release_thread_shards, PoolConfig, Shards, StreamTag, UpstreamFactory};
use cumem::upstream::Upstream;
use cumem::PoolKind;
use cumem_loom_tests::model;
use cumem_loom_tests::pages::{PageUpstream, PAGE};
use loom::sync::Arc;
use loom::thread;

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
            d2.dev().assert_mapped(d.addr, d.size);
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
            dv.assert_mapped(addr, size);
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
