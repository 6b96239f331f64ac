//! One address space per device (`pool/handover.rs`): a shard whose
//! thread ended is idle; the first thread's shard needs memory and takes
//! the idle shard's mapped free range (its chunk is cut around the range,
//! the directory records the new owner, no page is mapped or unmapped),
//! while a new thread claims the idle shard, frees a block into it (a free
//! in flight) and allocates there. In every interleaving no page under a
//! live block is unmapped or mapped twice, every block handed out sits on
//! mapped pages, no two live blocks overlap, every free finds its block's
//! shard, and the pages the shards count as mapped are the device's. (It
//! fails when the directory does not record the taker as the range's
//! owner: the taker's block is then freed into the giver, which refuses.)
//!
//! Both shards' upstreams are one device model (one address space).

#![cfg(loom)]

use cumem::pool::{release_thread_shards, PoolConfig, Shards, StreamTag, UpstreamFactory};
use cumem::upstream::Upstream;
use cumem::PoolKind;
use cumem_loom_tests::pages::{PageUpstream, PAGE};
use loom::sync::Arc;
use loom::thread;

/// A hand-over looks at every shard under its lock: more steps than
/// loom's default bound on one execution's branches.
fn builder() -> loom::model::Builder {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(2);
    b.max_branches = 20_000;
    b
}

/// A set of two shards sharing one modelled device's address space, pages
/// mapped as blocks need them, no thread caches; with `fresh`, a shard
/// claimed by a new thread starts its remap budget afresh; with `trim`, a
/// thread's exit trims the set (`trim_idle_shards`).
fn two_shards(fresh: bool, trim: bool) -> (PageUpstream, Arc<Shards>) {
    let dev = PageUpstream::default();
    let mut c = PoolConfig::new(PoolKind::Standalone);
    c.thread_cache = false;
    c.min_chunk = PAGE;
    c.remap_slack_ppm = 0;
    c.fresh_thread_budget = fresh;
    c.trim_idle_shards = trim;
    let more = dev.clone();
    let make: UpstreamFactory = Box::new(move || Ok(Box::new(more.clone()) as Box<dyn Upstream>));
    let set = Arc::new(Shards::sharing_space(Box::new(dev.clone()), make, c, 2));
    (dev, set)
}

/// Model runs in which a range changed shard.
static HANDED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[test]
fn a_mapped_range_changes_shard_while_a_free_is_in_flight() {
    builder().check(|| {
        let (dev, set) = two_shards(false, false);
        // This thread takes shard 0.
        let first = set.allocate(256, 256).unwrap();
        dev.dev().live.insert((first.addr, first.size));
        // A thread grows shard 1, keeps two blocks and ends.
        let s = set.clone();
        let (b, c) = thread::spawn(move || {
            let a = s.allocate(3 * PAGE, 256).unwrap();
            let b = s.allocate(PAGE, 256).unwrap();
            let c = s.allocate(PAGE, 256).unwrap();
            s.deallocate(a.addr, StreamTag::NONE).unwrap();
            release_thread_shards();
            (b, c)
        })
        .join()
        .unwrap();
        assert_eq!(set.made(), 2);
        dev.dev().live.extend([(b.addr, b.size), (c.addr, c.size)]);
        // A new thread takes the idle shard: allocates there (where the
        // range may be leaving) and frees a block (in flight while the
        // range moves).
        let (s, d2) = (set.clone(), dev.clone());
        let user = thread::spawn(move || {
            // The free span is the best fit: this lands where the range
            // may be leaving.
            let d = s.allocate(PAGE, 256).unwrap();
            d2.dev().live.insert((d.addr, d.size));
            d2.dev().assert_mapped(d.addr, d.size);
            d2.dev().live.remove(&(c.addr, c.size));
            s.deallocate(c.addr, StreamTag::NONE).unwrap();
            release_thread_shards();
            d
        });
        // Shard 0 needs three pages: the idle shard's free range moves.
        let g = set.allocate(3 * PAGE, 256).unwrap();
        dev.dev().live.insert((g.addr, g.size));
        let d = user.join().unwrap();
        let dv = dev.dev();
        assert!(dv.violations.is_empty(), "{:?}", dv.violations);
        for (addr, size) in [(g.addr, g.size), (d.addr, d.size), (b.addr, b.size), (first.addr, first.size)] {
            dv.assert_mapped(addr, size);
        }
        // No two live blocks share a byte, whichever shard placed them.
        let mut live = [g, d, b, first].map(|x| (x.addr, x.size));
        live.sort_unstable();
        for w in live.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "live blocks overlap: {:?}", w);
        }
        let pieces: usize = dv.pieces.values().sum();
        drop(dv);
        let mapped: usize = set.pools().map(|(_, p)| p.stats().mapped - p.stats().kept).sum();
        assert_eq!(mapped, pieces, "the shards' mapped pages drifted from the device's");
        set.check_invariants().expect("best-fit invariants");
        if set.ranges_handed_over().0 > 0 {
            HANDED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        // Every block frees in its shard, whichever thread made it.
        for x in [g, d, b, first] {
            set.deallocate(x.addr, StreamTag::NONE).unwrap();
        }
        assert!(set.deallocate(g.addr, StreamTag::NONE).is_err(), "a second free is refused");
        set.check_invariants().expect("best-fit invariants");
        release_thread_shards();
    });
    assert!(HANDED.load(std::sync::atomic::Ordering::Relaxed) > 0, "no run handed a range over");
}

/// Model runs in which a range left a shard in use.
static FROM_BUSY: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// A shard in use gives what it holds above its budget (a new thread's
/// shard starts its budget afresh) while its own thread grows that same
/// chunk in place: a range taken from the chunk's top meanwhile must not
/// leave the thread extending a chunk its pool no longer holds (the
/// extension would be recorded over the range's new owner, whose frees
/// would then go to the wrong shard). In every interleaving both blocks
/// sit on mapped pages, don't overlap, and free in their shards.
#[test]
fn a_shard_gives_from_the_top_of_a_chunk_its_thread_extends() {
    builder().check(|| {
        let (dev, set) = two_shards(true, false);
        let first = set.allocate(256, 256).unwrap();
        // A thread grows shard 1 to three mapped pages, frees them and ends.
        let s = set.clone();
        thread::spawn(move || {
            let a = s.allocate(3 * PAGE, 256).unwrap();
            s.deallocate(a.addr, StreamTag::NONE).unwrap();
            release_thread_shards();
        })
        .join()
        .unwrap();
        // A new thread claims shard 1 and needs four pages: its chunk of
        // three grows in place.
        let (s, d2) = (set.clone(), dev.clone());
        let user = thread::spawn(move || {
            let u = s.allocate(4 * PAGE, 256).unwrap();
            d2.dev().assert_mapped(u.addr, u.size);
            release_thread_shards();
            u
        });
        // Shard 0 needs two pages: shard 1 holds three above its fresh
        // budget, and may give the top two.
        let g = set.allocate(2 * PAGE, 256).unwrap();
        dev.dev().assert_mapped(g.addr, g.size);
        let u = user.join().unwrap();
        let (lo, hi) = if g.addr < u.addr { (g, u) } else { (u, g) };
        assert!(lo.addr + lo.size <= hi.addr, "live blocks overlap: {lo:?} {hi:?}");
        if set.ranges_handed_over().0 > 0 {
            FROM_BUSY.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        for x in [g, u, first] {
            set.deallocate(x.addr, StreamTag::NONE).unwrap();
        }
        set.check_invariants().expect("best-fit invariants");
        let dv = dev.dev();
        assert!(dv.violations.is_empty(), "{:?}", dv.violations);
        drop(dv);
        release_thread_shards();
    });
    assert!(FROM_BUSY.load(std::sync::atomic::Ordering::Relaxed) > 0, "no run handed a range over");
}

/// Model runs in which the exit's trim unmapped pages.
static TRIMMED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// A thread's exit trims the set (`pool/reclaim.rs`, `trim_idle`, with
/// `trim_idle_shards`): this thread's shard holds a free page and a live
/// block, another thread's shard mapped memory of its own beside it, so
/// the set holds more than its peak's pages; this thread hands its shard
/// back (the trim unmaps free pages of the now idle shard) while a third
/// thread frees the live block there (a free in flight). In every
/// interleaving no page under a live block is unmapped, the blocks left
/// sit on mapped pages, and the shards' count of mapped pages is the
/// device's.
#[test]
fn an_exits_trim_runs_while_a_free_is_in_flight() {
    builder().check(|| {
        let (dev, set) = two_shards(false, true);
        // This thread takes shard 0: two pages, one freed.
        let f1 = set.allocate(PAGE, 256).unwrap();
        let f2 = set.allocate(PAGE, 256).unwrap();
        set.deallocate(f1.addr, StreamTag::NONE).unwrap();
        dev.dev().live.insert((f2.addr, f2.size));
        // Another thread's shard needs two pages, which shard 0's one free
        // page can't give: it maps its own.
        let s = set.clone();
        let u = thread::spawn(move || {
            let u = s.allocate(2 * PAGE, 256).unwrap();
            // Its shard goes idle too (its block stays live there): the
            // trim then has nothing free to give.
            release_thread_shards();
            u
        })
        .join()
        .unwrap();
        dev.dev().live.insert((u.addr, u.size));
        // A free of f2 from another thread, in flight while this thread's
        // hand-back trims shard 0.
        let (s, d2) = (set.clone(), dev.clone());
        let freer = thread::spawn(move || {
            d2.dev().live.remove(&(f2.addr, f2.size));
            s.deallocate(f2.addr, StreamTag::NONE).unwrap();
        });
        release_thread_shards();
        freer.join().unwrap();
        let dv = dev.dev();
        assert!(dv.violations.is_empty(), "{:?}", dv.violations);
        dv.assert_mapped(u.addr, u.size);
        let held: usize = dv.pieces.values().sum::<usize>() + dv.spare.iter().sum::<usize>();
        drop(dv);
        assert_eq!(set.stats().mapped, held, "the shards' held memory drifted from the device's");
        set.check_invariants().expect("best-fit invariants");
        if set.bytes_reclaimed() > 0 {
            TRIMMED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        set.deallocate(u.addr, StreamTag::NONE).unwrap();
        assert!(set.deallocate(f2.addr, StreamTag::NONE).is_err(), "a second free is refused");
        set.check_invariants().expect("best-fit invariants");
    });
    assert!(TRIMMED.load(std::sync::atomic::Ordering::Relaxed) > 0, "no run's exit trimmed the set");
}
