//! Per-thread arenas on the host fallback: threads land on arenas of their
//! own, frees from any thread reach the owning arena (device and pinned
//! pools), a size limit holds for all arenas together, and an arena out of
//! memory takes the free memory of the others before it fails. One thread
//! alone uses one arena.

use std::sync::Barrier;

use cumem::{BackendChoice, Config, Error, MemoryManager, Stream};

const MIB: usize = 1 << 20;

fn host(config: Config) -> MemoryManager {
    MemoryManager::new(config.backend(BackendChoice::Host)).unwrap()
}

#[test]
fn one_thread_uses_one_arena() {
    let mm = host(Config::new().arenas(8));
    let d = mm.default_device().unwrap();
    let ptrs: Vec<u64> = (1..50).map(|i| mm.allocate_device(i * 1000).unwrap()).collect();
    let pins: Vec<_> = (1..50).map(|i| mm.allocate_pinned(i * 1000).unwrap()).collect();
    assert_eq!((d.pool().made(), mm.pinned_pool().made()), (1, 1));
    for p in ptrs {
        mm.free_device(p).unwrap();
    }
    for p in pins {
        mm.free_pinned(p.as_ptr()).unwrap();
    }
    assert_eq!(d.pool().stats().in_use, 0);
}

/// Eight threads, each on a stream of its own, allocate device memory and
/// pass a third of their blocks to the next thread, which frees them on
/// the stream they were used on. Every free reaches its arena; double
/// frees are still caught; nothing is left live.
#[test]
fn cross_thread_device_frees_reach_the_owning_arena() {
    const THREADS: usize = 8;
    let mm = host(Config::new().arenas(THREADS));
    let (tx, rx): (Vec<_>, Vec<_>) = (0..THREADS).map(|_| crossbeam::channel::unbounded::<u64>()).unzip();
    let done = Barrier::new(THREADS);
    std::thread::scope(|s| {
        for (id, inbox) in rx.into_iter().enumerate() {
            let (mm, tx, done) = (&mm, &tx, &done);
            s.spawn(move || {
                // A thread that fails still reaches the barrier (the others
                // would wait there for ever), then fails the test.
                let work = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let stream = Stream::host();
                    let mut live = Vec::new();
                    for i in 0..2000usize {
                        live.push(mm.allocate_device_on(1 + (i * 7919 + id * 104_729) % (4 * MIB), &stream).unwrap());
                        if live.len() > 20 {
                            let p = live.swap_remove(i % live.len());
                            if i % 3 == 0 {
                                tx[(id + 1) % THREADS].send(p).unwrap();
                            } else {
                                mm.free_device_on(p, &stream).unwrap();
                            }
                        }
                        while let Ok(p) = inbox.try_recv() {
                            mm.free_device_on(p, &stream).unwrap();
                        }
                    }
                    for p in live {
                        mm.free_device(p).unwrap();
                    }
                }));
                done.wait();
                if let Err(panic) = work {
                    std::panic::resume_unwind(panic);
                }
                while let Ok(p) = inbox.try_recv() {
                    mm.free_device(p).unwrap();
                    // Freed already (it may have coalesced with a free
                    // neighbour since): refused, whichever thread asks.
                    let again = mm.free_device(p).unwrap_err();
                    assert!(matches!(again, Error::DoubleFree { .. } | Error::InteriorPointer { .. }), "{again}");
                }
            });
        }
    });
    let d = mm.default_device().unwrap();
    assert!(d.pool().made() > 1, "threads used arenas of their own");
    d.pool().check_invariants().unwrap();
    let s = d.pool().stats();
    assert_eq!((s.in_use, s.live_blocks), (0, 0), "{s:?}");
    assert_eq!(s.allocations, s.frees, "{s:?}");
    mm.release_cached().unwrap();
}

/// The pinned pool's limit holds for all arenas together, and an arena that
/// can't grow takes the other arenas' free memory first.
#[test]
fn an_arena_out_of_memory_takes_the_others_free_memory() {
    let mm = host(Config::new().arenas(4).max_pinned_pool_size(8 * MIB).pinned_thread_cache(false));
    // This thread uses the pool first (arena 0) and leaves 6 MiB free in it.
    let p = mm.allocate_pinned(6 * MIB).unwrap();
    mm.free_pinned(p.as_ptr()).unwrap();
    assert_eq!(mm.pinned_stats().reserved, 6 * MIB);
    std::thread::scope(|s| {
        s.spawn(|| {
            // Another arena (this thread still holds arena 0, so the new
            // thread claims a new one, whatever the timing): its 6 MiB
            // would take the total past 8 MiB, so it takes arena 0's free
            // chunk instead of asking the upstream.
            let q = mm.allocate_pinned(6 * MIB).unwrap();
            assert_eq!(mm.pinned_pool().made(), 2);
            assert_eq!(mm.pinned_pool().chunks_moved(), 1);
            let s = mm.pinned_stats();
            assert!(s.reserved <= 8 * MIB, "{s:?}");
            // Both arenas together may not pass the limit.
            let e = mm.allocate_pinned(4 * MIB).unwrap_err();
            assert!(matches!(e, Error::OutOfMemory { .. }), "{e}");
            mm.free_pinned(q.as_ptr()).unwrap();
        });
    });
    mm.pinned_pool().check_invariants().unwrap();
}

/// An arena with no free memory borrows a block from another arena's free
/// memory when no arena has a wholly free chunk to give: no upstream call.
/// The block stays the lender's: its free goes back there.
#[test]
fn an_arena_borrows_a_busy_arenas_free_memory_instead_of_growing() {
    let mm = host(Config::new().arenas(4).pinned_thread_cache(false));
    // Arena 0 (this thread): one chunk with a live block and free room.
    let room = mm.allocate_pinned(16 * MIB).unwrap();
    mm.free_pinned(room.as_ptr()).unwrap();
    let keep = mm.allocate_pinned(MIB).unwrap();
    assert_eq!(mm.pinned_pool().primary().stats().chunks, 1);
    let calls = mm.pinned_pool().upstream_calls();
    std::thread::scope(|s| {
        s.spawn(|| {
            // A new arena (this thread still holds arena 0): empty, and no
            // arena has a wholly free chunk.
            let b = mm.allocate_pinned(4 * MIB).unwrap();
            assert_eq!(mm.pinned_pool().made(), 2);
            assert_eq!(mm.pinned_pool().chunks_moved(), 0);
            assert_eq!(mm.pinned_pool().blocks_lent(), 1);
            assert_eq!(mm.pinned_pool().upstream_calls(), calls, "no upstream call");
            mm.free_pinned(b.as_ptr()).unwrap();
        });
    });
    let s = mm.pinned_pool().primary().stats();
    assert_eq!((s.in_use, s.live_blocks), (MIB, 1), "the borrowed block went back to arena 0");
    mm.free_pinned(keep.as_ptr()).unwrap();
    mm.pinned_pool().check_invariants().unwrap();
}

/// Pinned growth is geometric: 1 GiB in the peers' sizes (uniform up to
/// 4 MiB) takes few upstream calls, where 2-4 MiB chunks took hundreds.
#[test]
fn pinned_growth_takes_few_upstream_calls() {
    let mm = host(Config::new().pinned_thread_cache(false));
    let mut live = Vec::new();
    let mut x: usize = 12345;
    while mm.pinned_stats().reserved < 1 << 30 {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        live.push(mm.allocate_pinned(1 + (x >> 16) % (4 * MIB)).unwrap());
    }
    let s = mm.pinned_stats();
    // From 4 MiB to 1 GiB at a quarter per step: about 25 calls.
    assert!(s.upstream_allocs <= 32, "{} upstream calls to reach {} MiB", s.upstream_allocs, s.reserved / MIB);
    // The memory held beyond what is live stays within a quarter (plus
    // the last request).
    assert!(s.reserved <= s.in_use + s.in_use / 4 + 8 * MIB, "{s:?}");
    for p in live {
        mm.free_pinned(p.as_ptr()).unwrap();
    }
}

/// The arenas' upstream passes page remapping through (pool/pages.rs): an
/// arena of the device pool moves a wholly free block's memory to where a
/// larger allocation lands instead of growing physical memory.
#[test]
fn device_arenas_remap_pages() {
    let mm = host(Config::new());
    let d = mm.device(0).unwrap();
    let x = mm.allocate_device(8 * MIB).unwrap();
    let y = mm.allocate_device(2 * MIB).unwrap();
    assert!(d.pool().primary().remaps(), "the arena's pool remaps pages");
    mm.free_device(x).unwrap();
    // 10 MiB does not fit the 8 MiB hole: new address space, but the
    // hole's memory moves there rather than physical memory growing.
    let z = mm.allocate_device(10 * MIB).unwrap();
    let s = d.stats().pool;
    assert!(s.unmap_calls > 0, "free pages were unmapped: {s:?}");
    assert!(s.peak_mapped <= 12 * MIB, "physical peak {} MiB, live 12 MiB", s.peak_mapped / MIB);
    mm.free_device(y).unwrap();
    mm.free_device(z).unwrap();
}

/// With `shared_device_arenas`, arena 0 of a device pool (it remaps
/// pages) is kept for the set's first thread: a later thread, arriving
/// when the first has gone, takes a worker arena (a new layout in arena 0
/// would move pages through the driver). The pinned pool (no remapping)
/// hands arena 0 on, as does a device pool without the option.
#[test]
fn later_threads_take_worker_arenas_not_the_first_threads() {
    let plain = host(Config::new().arenas(4));
    std::thread::scope(|s| {
        for _ in 0..3 {
            s.spawn(|| plain.free_device(plain.allocate_device(MIB).unwrap()).unwrap()).join().unwrap();
        }
    });
    assert_eq!(plain.device(0).unwrap().pool().made(), 1, "without the option arena 0 is handed on");
    let mm = host(Config::new().arenas(4).pinned_thread_cache(false).shared_device_arenas(true));
    let d = mm.device(0).unwrap();
    let run = || {
        std::thread::scope(|s| {
            s.spawn(|| {
                let p = mm.allocate_device(3 * MIB).unwrap();
                mm.free_device(p).unwrap();
                let q = mm.allocate_pinned(MIB).unwrap();
                mm.free_pinned(q.as_ptr()).unwrap();
                cumem::pool::release_thread_arenas();
            });
        });
    };
    run();
    assert!(d.pool().primary().remaps());
    assert_eq!((d.pool().made(), d.pool().primary().stats().upstream_allocs > 0), (1, true));
    for _ in 0..5 {
        run();
    }
    assert_eq!(d.pool().made(), 2, "one worker arena for every later thread");
    assert_eq!(d.pool().count(), 5, "four worker arenas beside arena 0");
    assert_eq!(mm.pinned_pool().made(), 1, "the pinned pool's arena 0 goes to the next thread");
}

/// Device worker arenas take whole chunks of one address space: a chunk
/// one worker grew and freed moves to another worker that needs memory,
/// with no upstream call, while both threads are alive; frees from either
/// thread reach the arena that now owns the chunk.
#[test]
fn device_worker_arenas_trade_free_chunks_without_the_upstream() {
    let mm = host(Config::new().arenas(4).device_thread_cache(false).shared_device_arenas(true));
    let d = mm.device(0).unwrap();
    // This thread takes arena 0 and keeps it.
    let first = mm.allocate_device(MIB).unwrap();
    let (grown, taken) = (Barrier::new(2), Barrier::new(2));
    let (tx, rx) = crossbeam::channel::bounded::<u64>(1);
    std::thread::scope(|s| {
        s.spawn(|| {
            let p = mm.allocate_device(24 * MIB).unwrap();
            mm.free_device(p).unwrap();
            grown.wait();
            // The other worker took this arena's free chunk: free its
            // block from here.
            taken.wait();
            mm.free_device(rx.recv().unwrap()).unwrap();
        });
        // What the taker saw, checked after the barriers (a failed check
        // inside would leave the other thread waiting).
        let taker = s.spawn(|| {
            grown.wait();
            let calls = d.pool().upstream_calls();
            let q = mm.allocate_device(16 * MIB).unwrap();
            let seen = (d.pool().chunks_moved(), d.pool().upstream_calls() - calls);
            tx.send(q).unwrap();
            taken.wait();
            seen
        });
        assert_eq!(taker.join().unwrap(), (1, 0), "a worker's free chunk moved, no upstream call");
    });
    assert_eq!(d.pool().made(), 3);
    assert_eq!(d.stats().pool.in_use, MIB);
    mm.free_device(first).unwrap();
    d.pool().check_invariants().unwrap();
    mm.release_cached().unwrap();
    assert_eq!(d.stats().pool.reserved, 0, "every chunk went back, whichever arena held it");
}

/// Threads that come and go reuse the arenas of exited threads with the
/// memory they cache: 40 threads one after another (the first thread
/// holding arena 0 all along) make one more arena, and after the first
/// no thread calls the upstream.
#[test]
fn arenas_outlive_their_threads() {
    let mm = host(Config::new().arenas(8).pinned_thread_cache(false));
    let p = mm.allocate_pinned(MIB).unwrap();
    let calls_after_first = std::sync::OnceLock::new();
    for t in 0..40usize {
        std::thread::scope(|s| {
            s.spawn(|| {
                let live: Vec<_> =
                    (0..20).map(|i| mm.allocate_pinned(1 + (i * 7919 + t) % (2 * MIB)).unwrap()).collect();
                for q in live {
                    mm.free_pinned(q.as_ptr()).unwrap();
                }
                cumem::pool::release_thread_arenas();
            });
        });
        calls_after_first.get_or_init(|| mm.pinned_pool().upstream_calls());
    }
    let set = mm.pinned_pool();
    assert_eq!(set.made(), 2, "one arena for the thread that held one, one for all the others");
    assert_eq!(set.upstream_calls(), *calls_after_first.get().unwrap(), "later threads grew nothing");
    mm.free_pinned(p.as_ptr()).unwrap();
}

/// Waves of short-lived threads: the number of arenas stays within the
/// set's count, and once the first wave has grown the pools, later waves
/// find the memory they need in the arenas the earlier ones handed back
/// (pinned: with whole chunks moving between arenas), with no upstream
/// call. Device frees cross threads through a channel.
#[test]
fn thread_churn_reuses_arenas_and_their_memory() {
    const WAVE: usize = 4;
    let mm = host(Config::new().arenas(WAVE).pinned_thread_cache(false));
    let d = mm.default_device().unwrap();
    let wave = |seed: usize| {
        std::thread::scope(|s| {
            let (tx, rx) = crossbeam::channel::unbounded::<u64>();
            for id in 0..WAVE {
                let (mm, tx, rx) = (&mm, tx.clone(), rx.clone());
                s.spawn(move || {
                    let stream = Stream::host();
                    let mut x = (seed * 31 + id) as u64 | 1;
                    let mut pins = Vec::new();
                    for i in 0..200 {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let size = 1 + (x as usize >> 8) % MIB;
                        pins.push(mm.allocate_pinned(size).unwrap());
                        let p = mm.allocate_device_on(size, &stream).unwrap();
                        if i % 2 == 0 {
                            tx.send(p).unwrap();
                        } else {
                            mm.free_device_on(p, &stream).unwrap();
                        }
                        if pins.len() > 30 {
                            let q = pins.swap_remove((x as usize) % pins.len());
                            mm.free_pinned(q.as_ptr()).unwrap();
                        }
                        while let Ok(p) = rx.try_recv() {
                            mm.free_device_on(p, &stream).unwrap();
                        }
                    }
                    for q in pins {
                        mm.free_pinned(q.as_ptr()).unwrap();
                    }
                    cumem::pool::release_thread_arenas();
                    cumem::pool::release_thread_caches();
                });
            }
            drop(tx);
            while let Ok(p) = rx.recv() {
                mm.free_device(p).unwrap();
            }
        });
    };
    // Grow the pools to what the waves need.
    for seed in 0..6 {
        wave(seed);
    }
    let (pinned0, device0) = (mm.pinned_pool().upstream_calls(), d.pool().upstream_calls());
    for seed in 100..110 {
        wave(seed);
    }
    assert!(mm.pinned_pool().made() <= WAVE && d.pool().made() <= WAVE);
    let (pinned, device) = (mm.pinned_pool().upstream_calls() - pinned0, d.pool().upstream_calls() - device0);
    // A wave's threads run at once: an arena may need a chunk while every
    // other arena's chunks still hold live blocks, so the pinned pool may
    // still grow now and then (a few times in ten waves under load), but
    // not every wave.
    let moved = mm.pinned_pool().chunks_moved();
    assert!(pinned <= 8, "pinned upstream calls after warm-up: {pinned} ({moved} chunks moved)");
    assert!(device <= 16, "device upstream calls after warm-up: {device}");
    d.pool().check_invariants().unwrap();
    mm.pinned_pool().check_invariants().unwrap();
    assert_eq!(d.pool().stats().in_use, 0);
    mm.release_cached().unwrap();
}

/// An upstream whose chunks take a while (as pinning does: about a third
/// of a second per GiB) and that counts them.
struct Slow {
    inner: cumem::upstream::Host,
    chunks: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl cumem::upstream::Upstream for Slow {
    fn allocate_chunk(&self, size: usize) -> cumem::Result<cumem::upstream::Chunk> {
        self.chunks.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        std::thread::sleep(std::time::Duration::from_millis(100));
        self.inner.allocate_chunk(size)
    }
    fn deallocate_chunk(&self, chunk: cumem::upstream::Chunk) -> cumem::Result<()> {
        self.inner.deallocate_chunk(chunk)
    }
    fn inner(&self) -> Option<&dyn cumem::upstream::Upstream> {
        Some(&self.inner)
    }
}

/// Threads on arenas of their own that all need memory at once make one
/// upstream call, not one each: one arena grows while the others wait,
/// then they borrow from its new chunk.
#[test]
fn arenas_that_need_memory_together_grow_once() {
    use cumem::pool::{Arenas, PoolConfig};
    use cumem::upstream::Upstream;
    use cumem::PoolKind;
    const THREADS: usize = 8;
    let chunks = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let slow = {
        let chunks = chunks.clone();
        move || Slow { inner: cumem::upstream::Host::new(), chunks: chunks.clone() }
    };
    let mut config = PoolConfig::new(PoolKind::Pinned);
    config.thread_cache = false;
    config.min_chunk = 64 * MIB;
    let first = slow();
    let make = move || -> cumem::Result<Box<dyn Upstream>> { Ok(Box::new(slow())) };
    let arenas = Arenas::new(Box::new(first), Some(Box::new(make)), config, THREADS);
    let (start, done) = (Barrier::new(THREADS), Barrier::new(THREADS));
    std::thread::scope(|s| {
        for _ in 0..THREADS {
            s.spawn(|| {
                start.wait();
                let a = arenas.allocate(MIB, 256).unwrap();
                // Every thread holds its block until all have one.
                done.wait();
                arenas.deallocate(a.addr, cumem::pool::StreamTag::NONE).unwrap();
            });
        }
    });
    assert!(arenas.made() >= THREADS / 2, "only {} arenas were made; the test shows nothing", arenas.made());
    assert_eq!(chunks.load(std::sync::atomic::Ordering::SeqCst), 1, "arenas grew one by one instead of borrowing");
    arenas.check_invariants().unwrap();
}

/// A wholly free chunk moves to another arena only where the request's
/// stream can use it with no wait: freed on that same stream (it comes
/// with its tag, which orders the reuse) or idle. A request on another
/// stream leaves it and grows instead.
#[test]
fn a_chunk_moves_with_its_tag_to_a_request_on_the_same_stream_only() {
    use cumem::pool::{Arenas, PoolConfig, StreamTag};
    use cumem::upstream::{Host, Upstream};
    use cumem::PoolKind;

    let make = || Ok(Box::new(Host::new()) as Box<dyn Upstream>);
    let mut config = PoolConfig::new(PoolKind::Standalone);
    config.thread_cache = false;
    let arenas = Arenas::new(make().unwrap(), Some(Box::new(make)), config, 4);
    let tag = StreamTag { stream: 7, seq: 1 };
    let (freed, done) = (Barrier::new(3), Barrier::new(3));
    std::thread::scope(|s| {
        // Arena 0: an 8 MiB chunk, freed on stream 7, work maybe pending.
        s.spawn(|| {
            let a = arenas.allocate_for(8 * MIB, 256, 7).unwrap();
            arenas.deallocate(a.addr, tag).unwrap();
            freed.wait();
            done.wait();
        });
        // Each asker returns what it saw; the checks run after the
        // barriers (a failed check inside would leave the others waiting).
        let other_stream = s.spawn(|| {
            freed.wait();
            // Another stream: the chunk stays where it is.
            let calls = arenas.upstream_calls();
            let other = arenas.allocate_for(4 * MIB, 256, 9);
            let seen = (arenas.chunks_moved(), arenas.blocks_lent(), arenas.upstream_calls() - calls);
            done.wait();
            let other = other.unwrap();
            arenas.deallocate(other.addr, StreamTag::NONE).unwrap();
            (seen, other.tag)
        });
        let same_stream = s.spawn(|| {
            freed.wait();
            // Wait for the other request to have grown, then ask on
            // stream 7: the chunk moves, tag and all.
            let start = std::time::Instant::now();
            while arenas.upstream_calls() < 2 && start.elapsed().as_secs() < 10 {
                std::thread::yield_now();
            }
            let calls = arenas.upstream_calls();
            let same = arenas.allocate_for(4 * MIB, 256, 7);
            let seen = (arenas.chunks_moved(), arenas.upstream_calls() - calls);
            done.wait();
            let same = same.unwrap();
            arenas.deallocate(same.addr, StreamTag::NONE).unwrap();
            (seen, same.tag)
        });
        let (seen, other_tag) = other_stream.join().unwrap();
        assert_eq!((seen, other_tag), ((0, 0, 1), StreamTag::NONE), "another stream: nothing moved, grew instead");
        let (seen, same_tag) = same_stream.join().unwrap();
        assert_eq!(seen, (1, 0), "the chunk moved, no upstream call");
        assert_eq!(same_tag, tag, "the reuse is ordered after stream 7's work");
    });
    arenas.check_invariants().unwrap();
    assert_eq!(arenas.stats().in_use, 0);
}

/// Idle memory of another arena (its stream's work known complete) is
/// lent to a request on no stream, never to one on another stream: the
/// block would come back tagged with that stream and merge with the
/// lender's pending free space into blocks whose reuse waits for every
/// stream.
#[test]
fn idle_memory_is_lent_to_hostside_requests_but_not_across_streams() {
    use std::sync::Arc;

    use cumem::pool::{Arenas, PoolConfig, StreamTag};
    use cumem::upstream::{Host, Upstream};
    use cumem::PoolKind;

    for stream in [9, 0] {
        let make = || Ok(Box::new(Host::new()) as Box<dyn Upstream>);
        let mut config = PoolConfig::new(PoolKind::Standalone);
        config.thread_cache = false;
        let arenas = Arenas::new(make().unwrap(), Some(Box::new(make)), config, 4);
        // Stream 7's work is known complete.
        arenas.set_tag_oracle(Arc::new(|t: StreamTag| t.stream == 7));
        let (freed, finish) = (Barrier::new(2), Barrier::new(2));
        std::thread::scope(|s| {
            s.spawn(|| {
                // Arena 0: one chunk, freed on stream 7, then a live block
                // in it keeps it from moving whole.
                let a = arenas.allocate_for(16 * MIB, 256, 7).unwrap();
                arenas.deallocate(a.addr, StreamTag { stream: 7, seq: 1 }).unwrap();
                let keep = arenas.allocate_for(MIB, 256, 7).unwrap();
                assert_eq!(arenas.stats().chunks, 1);
                freed.wait();
                finish.wait();
                arenas.deallocate(keep.addr, StreamTag::NONE).unwrap();
            });
            let asker = s.spawn(|| {
                freed.wait();
                let calls = arenas.upstream_calls();
                let b = arenas.allocate_for(4 * MIB, 256, stream);
                let seen = (arenas.blocks_lent(), arenas.upstream_calls() - calls);
                finish.wait();
                let b = b.unwrap();
                arenas.deallocate(b.addr, StreamTag::NONE).unwrap();
                (b.tag, seen)
            });
            let (tag, seen) = asker.join().unwrap();
            if stream == 0 {
                assert_eq!((tag, seen), (StreamTag::NONE, (1, 0)), "lent, no upstream call");
            } else {
                assert_eq!(seen, (0, 1), "not lent across streams: grew instead");
            }
        });
        arenas.check_invariants().unwrap();
    }
}

/// Chunks given back leave the chunk directory and its tables stay few: a
/// program that grows and gives back memory forever keeps them flat.
#[test]
fn the_chunk_directory_stays_flat_while_chunks_come_and_go() {
    let mm = host(Config::new().arenas(4));
    let mut most = (0, 0);
    for round in 0..300usize {
        let ptrs: Vec<_> = (0..4).map(|i| mm.allocate_pinned((1 + (round * 7 + i) % 13) * MIB).unwrap()).collect();
        for p in ptrs {
            mm.free_pinned(p.as_ptr()).unwrap();
        }
        mm.release_cached().unwrap();
        let t = mm.table_sizes();
        most = (most.0.max(t.directory_entries), most.1.max(t.directory_arrays));
    }
    assert!(most.0 <= 8 && most.1 <= 2, "directory entries, tables at most: {most:?}");
    assert_eq!(mm.table_sizes().directory_entries, 0, "every chunk went back");
}
