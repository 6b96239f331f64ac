//! Loom models of cumem's concurrent protocols (see the crate docs for how
//! to run them). Each model builds its objects inside the closure: loom
//! objects can't live in statics.

#![cfg(loom)]

use std::sync::Mutex as StdMutex;

use cumem::manager::InitCell;
use cumem::pool::{release_thread_caches, StreamTag};
use cumem::Error;
use cumem_loom_tests::{assert_balanced, fake_pool, model, BASE, CHUNK_STRIDE};
use loom::cell::UnsafeCell;
use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use loom::sync::Arc;
use loom::thread;

/// Two threads race to initialise the manager's cell: one constructor
/// runs, both see the same value.
#[test]
fn first_initialisation_is_raced_by_two_threads() {
    model(|| {
        let cell = Arc::new(InitCell::<usize>::new());
        let made = Arc::new(AtomicUsize::new(0));
        let init = |cell: &InitCell<usize>, made: &AtomicUsize| {
            let v = cell
                .get_or_init(|| {
                    made.fetch_add(1, Ordering::Relaxed);
                    Ok::<_, ()>(42)
                })
                .unwrap();
            assert_eq!(*v, 42);
            v as *const usize as usize
        };
        let (c2, m2) = (cell.clone(), made.clone());
        let other = thread::spawn(move || init(&c2, &m2));
        let here = init(&cell, &made);
        assert_eq!(here, other.join().unwrap());
        assert_eq!(made.load(Ordering::Relaxed), 1);
    });
}

/// Live ranges recorded by the model's threads; any two must be disjoint.
/// A std mutex: its critical sections contain no loom operation, so it
/// never blocks a loom thread.
struct Live(StdMutex<Vec<(usize, usize)>>);

impl Live {
    fn add(&self, addr: usize, size: usize) {
        let mut v = self.0.lock().unwrap();
        for &(a, s) in v.iter() {
            assert!(addr + size <= a || a + s <= addr, "{addr:#x}+{size} overlaps {a:#x}+{s}");
        }
        v.push((addr, size));
    }
    fn remove(&self, addr: usize) {
        self.0.lock().unwrap().retain(|&(a, _)| a != addr);
    }
}

fn concurrent_allocate_free(cache: bool) {
    model(move || {
        let pool = Arc::new(fake_pool(cache, None));
        let live = Arc::new(Live(StdMutex::new(Vec::new())));
        let work = |pool: &cumem::pool::Pool<_>, live: &Live, size: usize| {
            for _ in 0..2 {
                let a = pool.allocate(size, 256).unwrap();
                live.add(a.addr, a.size);
                live.remove(a.addr);
                pool.deallocate(a.addr, StreamTag::NONE).unwrap();
            }
        };
        let (p2, l2) = (pool.clone(), live.clone());
        let t = thread::spawn(move || {
            work(&p2, &l2, 256);
            release_thread_caches();
        });
        work(&pool, &live, 256);
        t.join().unwrap();
        assert_balanced(&pool);
    });
}

/// Two threads allocate and free on one pool without thread caches.
#[test]
fn concurrent_allocate_free_shared_pool() {
    concurrent_allocate_free(false);
}

/// The same with thread caches: hits, misses and lends interleave.
#[test]
fn concurrent_allocate_free_thread_caches() {
    concurrent_allocate_free(true);
}

/// A block allocated on one thread is freed on another while the first
/// keeps allocating; a second free of it is a double free.
#[test]
fn free_on_another_thread() {
    model(|| {
        let pool = Arc::new(fake_pool(true, None));
        let a = pool.allocate(256, 256).unwrap();
        let p2 = pool.clone();
        let t = thread::spawn(move || {
            p2.deallocate(a.addr, StreamTag::NONE).unwrap();
            release_thread_caches();
        });
        let b = pool.allocate(256, 256).unwrap();
        pool.deallocate(b.addr, StreamTag::NONE).unwrap();
        t.join().unwrap();
        assert!(matches!(pool.deallocate(a.addr, StreamTag::NONE), Err(Error::DoubleFree { .. })));
        assert_balanced(&pool);
    });
}

/// Two threads free the same block at once: exactly one succeeds, and the
/// block is cached at most once.
#[test]
fn racing_double_free_is_caught() {
    model(|| {
        let pool = Arc::new(fake_pool(true, None));
        let a = pool.allocate(256, 256).unwrap();
        let p2 = pool.clone();
        let t = thread::spawn(move || {
            let ok = p2.deallocate(a.addr, StreamTag::NONE).is_ok();
            release_thread_caches();
            ok
        });
        let here = pool.deallocate(a.addr, StreamTag::NONE).is_ok();
        let there = t.join().unwrap();
        assert!(here ^ there, "exactly one free succeeds");
        // Cached once: two allocations get two different blocks.
        let x = pool.allocate(256, 256).unwrap();
        let y = pool.allocate(256, 256).unwrap();
        assert_ne!(x.addr, y.addr);
        pool.deallocate(x.addr, StreamTag::NONE).unwrap();
        pool.deallocate(y.addr, StreamTag::NONE).unwrap();
        assert_balanced(&pool);
    });
}

/// A thread fills its cache while another drains all caches
/// (`release_cached`, which steals from other threads' caches); when the
/// thread exits, its thread-local destructor flushes what it still caches.
#[test]
fn cache_fill_flush_and_steal() {
    model(|| {
        let pool = Arc::new(fake_pool(true, None));
        let p2 = pool.clone();
        let t = thread::spawn(move || {
            let a = p2.allocate(512, 256).unwrap();
            p2.deallocate(a.addr, StreamTag::NONE).unwrap();
            let b = p2.allocate(512, 256).unwrap();
            p2.deallocate(b.addr, StreamTag::NONE).unwrap();
            // What the thread's exit does (a thread-local destructor).
            release_thread_caches();
        });
        pool.release_cached().unwrap();
        t.join().unwrap();
        // The exited thread's cache was flushed.
        let s = pool.stats();
        assert_eq!(s.cached, 0, "{s:?}");
        assert_balanced(&pool);
    });
}

/// A cache over its budget flushes to the pool while another thread frees
/// into it from outside and a third drains every cache.
#[test]
fn budget_flush_races_remote_free_and_drain() {
    model(|| {
        // Two 256 B blocks fit; the third free flushes.
        let pool = Arc::new(fake_pool(true, Some(512)));
        let p2 = pool.clone();
        let t = thread::spawn(move || {
            let blocks: Vec<_> = (0..3).map(|_| p2.allocate(256, 256).unwrap()).collect();
            for b in &blocks {
                p2.deallocate(b.addr, StreamTag::NONE).unwrap();
            }
            release_thread_caches();
            blocks[0].addr
        });
        let m = pool.allocate(256, 256).unwrap();
        pool.release_cached().unwrap();
        pool.deallocate(m.addr, StreamTag::NONE).unwrap();
        let first = t.join().unwrap();
        // Freed already: a double free, or unknown once its chunk went back.
        let r = pool.deallocate(first, StreamTag::NONE);
        assert!(matches!(r, Err(Error::DoubleFree { .. } | Error::UnknownPointer { .. })), "{r:?}");
        assert_balanced(&pool);
    });
}

/// Event-gated reuse, as the device allocator does it with the pool's
/// stream tags: a block freed on stream S while S's work still uses it is
/// taken for stream T; T must see S's event (an atomic flag) before using
/// it. The block's memory is a loom cell, so a use without the wait is a
/// data race loom reports.
fn event_gated_reuse(cache: bool) {
    model(move || {
        const S: StreamTag = StreamTag { stream: 1, seq: 1 };
        const T: StreamTag = StreamTag { stream: 2, seq: 1 };
        let pool = Arc::new(fake_pool(cache, None));
        let memory = Arc::new([0; 4].map(UnsafeCell::new));
        let event = Arc::new(AtomicBool::new(false));
        // The first two blocks of each of the (at most two) chunks.
        let cell = |addr: usize| {
            let (chunk, offset) = ((addr - BASE) / CHUNK_STRIDE, (addr - BASE) % CHUNK_STRIDE);
            assert!(chunk < 2 && offset < 512, "unexpected block {addr:#x}");
            chunk * 2 + offset / 256
        };

        let (p2, m2, e2) = (pool.clone(), memory.clone(), event.clone());
        let s = thread::spawn(move || {
            let a = p2.allocate(256, 256).unwrap();
            let i = cell(a.addr);
            // S's kernel runs on the device after the host frees the block
            // in stream order.
            let (m3, e3) = (m2.clone(), e2.clone());
            let kernel = thread::spawn(move || {
                // SAFETY: loom checks this access: it races with nothing
                // only if the protocol holds.
                m3[i].with_mut(|v| unsafe { *v = 1 });
                e3.store(true, Ordering::Release);
            });
            p2.deallocate(a.addr, S).unwrap();
            // The host thread ends (flushing its caches) while the kernel
            // may still run.
            release_thread_caches();
            kernel
        });

        let b = pool.allocate(256, 256).unwrap();
        if b.tag != StreamTag::NONE && b.tag != T {
            // Another stream's work may still use it: wait for its event.
            while !event.load(Ordering::Acquire) {
                thread::yield_now();
            }
        }
        // SAFETY: as above; a missing wait is a race loom reports.
        memory[cell(b.addr)].with_mut(|v| unsafe { *v = 2 });
        pool.deallocate(b.addr, T).unwrap();
        s.join().unwrap().join().unwrap();
        assert_balanced(&pool);
    });
}

/// Event-gated reuse through the shared pool.
#[test]
fn event_gated_reuse_shared_pool() {
    event_gated_reuse(false);
}

/// Event-gated reuse with thread caches on: a tagged free must not reach a
/// cache, whose hits carry no tag.
#[test]
fn event_gated_reuse_thread_caches() {
    event_gated_reuse(true);
}
