//! Loom models of the per-thread arenas (`src/pool/arenas.rs`): lazy
//! arena creation raced by two threads, and frees routed to the owning
//! arena from another thread while both allocate.

#![cfg(loom)]

use std::sync::atomic::Ordering;

use cumem::pool::{set_thread_slot, StreamTag};
use cumem::Error;
use cumem_loom_tests::{assert_arenas_balanced, fake_arenas, model, CHUNK};
use loom::sync::Arc;
use loom::thread;

/// Two threads whose slots map to the same, not yet made, arena allocate
/// at once: the arena is made once, both get disjoint blocks from it.
#[test]
fn arena_creation_is_raced_by_two_threads() {
    model(|| {
        let (arenas, made) = fake_arenas(4, false);
        let arenas = Arc::new(arenas);
        // This thread uses the set first: arena 0.
        set_thread_slot(0);
        let first = arenas.allocate(256, 256).unwrap();
        assert_eq!(arenas.home(), 0);
        let a2 = arenas.clone();
        let t = thread::spawn(move || {
            set_thread_slot(5);
            let b = a2.allocate(256, 256).unwrap();
            (a2.home(), b.addr)
        });
        set_thread_slot(1);
        let mine = arenas.allocate(256, 256).unwrap();
        let (home, theirs) = t.join().unwrap();
        assert_eq!((home, arenas.home()), (1, 1), "slots 1 and 5 of 4 arenas share arena 1");
        assert_ne!(mine.addr, theirs);
        assert_eq!(made.load(Ordering::Relaxed), 1, "arena 1 was made once");
        assert_eq!(arenas.made(), 2);
        for addr in [first.addr, mine.addr, theirs] {
            arenas.deallocate(addr, StreamTag::NONE).unwrap();
        }
        assert_arenas_balanced(&arenas);
    });
}

/// Each thread allocates from its own arena (or borrows from the other's
/// free memory) and frees the other's block while allocating again: every
/// free reaches the owner, a second free of a block is a double free, and
/// nothing is lost.
fn cross_thread_frees(cache: bool) {
    model(move || {
        let (arenas, _) = fake_arenas(2, cache);
        let arenas = Arc::new(arenas);
        set_thread_slot(0);
        let mine = arenas.allocate(256, 256).unwrap();
        let a2 = arenas.clone();
        let t = thread::spawn(move || {
            set_thread_slot(1);
            let theirs = a2.allocate(512, 256).unwrap();
            a2.deallocate(mine.addr, StreamTag::NONE).unwrap();
            let again = a2.allocate(256, 256).unwrap();
            a2.deallocate(again.addr, StreamTag::NONE).unwrap();
            cumem::pool::release_thread_caches();
            theirs
        });
        let next = arenas.allocate(256, 256).unwrap();
        let theirs = t.join().unwrap();
        // Different arenas, unless arena 1 (empty) borrowed its first
        // block from arena 0's free memory.
        assert!(
            theirs.addr >> 32 != next.addr >> 32 || arenas.blocks_lent() > 0,
            "the two threads used different arenas"
        );
        arenas.deallocate(theirs.addr, StreamTag::NONE).unwrap();
        arenas.deallocate(next.addr, StreamTag::NONE).unwrap();
        // `next` may have reused `mine`'s block: either way it is free now.
        let again = arenas.deallocate(mine.addr, StreamTag::NONE);
        assert!(matches!(again, Err(Error::DoubleFree { .. })), "{again:?}");
        assert_arenas_balanced(&arenas);
    });
}

/// Cross-thread frees between arenas without thread caches.
#[test]
fn cross_thread_frees_reach_the_owning_arena() {
    cross_thread_frees(false);
}

/// The same with thread caches in front of each arena.
#[test]
fn cross_thread_frees_reach_the_owning_arena_through_caches() {
    cross_thread_frees(true);
}

/// The sharded free counters of a stream (`src/device/free_clock.rs`): a
/// free on one thread (work queued, then its number counted) races a
/// synchronisation on another (read every count, wait, mark them
/// complete). Whenever the free later counts as complete, the
/// synchronisation must have seen the work queued before it; a free on a
/// third shard counted after the read never counts as complete.
#[test]
fn a_free_is_complete_only_after_a_synchronisation_saw_it() {
    use cumem::cuda::FreeClock;
    use loom::sync::atomic::AtomicBool;
    model(|| {
        let clock = Arc::new(FreeClock::new());
        let queued = Arc::new(AtomicBool::new(false));
        let (c2, q2) = (clock.clone(), queued.clone());
        let freer = thread::spawn(move || {
            set_thread_slot(1);
            // The work the free follows (a kernel queued on the stream).
            q2.store(true, Ordering::Relaxed);
            c2.tick()
        });
        set_thread_slot(2);
        let seen = clock.seen();
        // What a stream synchronisation covers: the work queued so far.
        let covered = queued.load(Ordering::Relaxed);
        clock.mark_complete(&seen);
        let tag = freer.join().unwrap();
        if clock.completed(tag) {
            assert!(covered, "a free counted complete though its work was not covered");
        }
        let later = clock.tick();
        assert!(!clock.completed(later));
    });
}

/// A thread hands its arena back at its end while another thread frees a
/// block of that arena: the free reaches the arena, and the next thread
/// claims the handed-back arena (with its memory) rather than a new one.
#[test]
fn arena_handed_back_while_another_thread_frees_into_it() {
    model(|| {
        let (arenas, made) = fake_arenas(4, false);
        let arenas = Arc::new(arenas);
        // This thread claims arena 0 and keeps it.
        let first = arenas.allocate(256, 256).unwrap();
        let sent = Arc::new(loom::sync::atomic::AtomicUsize::new(0));
        let (a2, s2) = (arenas.clone(), sent.clone());
        let t = thread::spawn(move || {
            let b = a2.allocate(256, 256).unwrap();
            let home = a2.home();
            s2.store(b.addr, Ordering::Release);
            // The thread's end: its arena goes back while the block is
            // freed elsewhere.
            cumem::pool::release_thread_arenas();
            cumem::pool::release_thread_caches();
            home
        });
        let addr = loop {
            match sent.load(Ordering::Acquire) {
                0 => thread::yield_now(),
                a => break a,
            }
        };
        arenas.deallocate(addr, StreamTag::NONE).unwrap();
        let home = t.join().unwrap();
        assert_eq!(home, 1, "the new thread claimed an arena of its own");
        assert_eq!(arenas.threads_on(1), 0, "handed back");
        let a3 = arenas.clone();
        let again = thread::spawn(move || {
            let c = a3.allocate(256, 256).unwrap();
            let home = a3.home();
            a3.deallocate(c.addr, StreamTag::NONE).unwrap();
            cumem::pool::release_thread_arenas();
            cumem::pool::release_thread_caches();
            home
        })
        .join()
        .unwrap();
        assert_eq!(again, 1, "the handed-back arena is reused");
        assert_eq!(made.load(Ordering::Relaxed), 1, "no further arena was made");
        arenas.deallocate(first.addr, StreamTag::NONE).unwrap();
        assert_arenas_balanced(&arenas);
        cumem::pool::release_thread_arenas();
    });
}

/// Arena 0's only block is freed while another arena grows: the grower
/// takes arena 0's chunk only once the free has made it wholly free, or
/// borrows a block of arena 0's free memory while the chunk still holds
/// the live block (or asks its upstream); a block of the taken chunk freed
/// from the first thread reaches the taker, a borrowed block goes back to
/// arena 0, and nothing is lost.
#[test]
fn chunk_taken_by_another_arena_while_a_free_for_it_is_in_flight() {
    model(|| {
        let (arenas, _) = fake_arenas(2, false);
        let arenas = Arc::new(arenas);
        let mine = arenas.allocate(256, 256).unwrap();
        let a2 = arenas.clone();
        let t = thread::spawn(move || {
            let b = a2.allocate(256, 256).unwrap();
            let home = a2.home();
            cumem::pool::release_thread_arenas();
            cumem::pool::release_thread_caches();
            (home, b.addr)
        });
        arenas.deallocate(mine.addr, StreamTag::NONE).unwrap();
        let (home, theirs) = t.join().unwrap();
        assert_eq!(home, 1);
        if arenas.chunks_moved() == 1 {
            assert_eq!(theirs, mine.addr, "the taken chunk's first block");
        }
        let lent = arenas.blocks_lent() == 1;
        if lent {
            // Borrowed from arena 0's chunk (beside the live block, or where
            // it was once its free landed first): the chunk did not move.
            assert_eq!(arenas.chunks_moved(), 0);
        }
        // The free of the taker's block, from this thread, reaches the arena
        // that owns it (arena 1, or arena 0 for a borrowed block).
        arenas.deallocate(theirs, StreamTag::NONE).unwrap();
        let again = arenas.deallocate(theirs, StreamTag::NONE).unwrap_err();
        // A borrowed block coalesced with arena 0's free memory: the second
        // free points inside that block.
        assert!(
            matches!(again, Error::DoubleFree { .. } | Error::UnknownPointer { .. })
                || (lent && matches!(again, Error::InteriorPointer { .. })),
            "{again}"
        );
        assert_arenas_balanced(&arenas);
        cumem::pool::release_thread_arenas();
    });
}

/// A free looks its block's arena up in the chunk directory while another
/// thread rewrites the directory: a chunk below the freed block's chunk
/// moves to another arena, then goes back upstream, so its entry leaves
/// and the freed block's entry moves down. The free always finds the
/// owner (the sequence lock never lets a half-written table answer), and
/// nothing is lost.
#[test]
fn a_free_finds_its_arena_while_the_directory_is_rewritten() {
    model(|| {
        let (arenas, _) = fake_arenas(2, false);
        let arenas = Arc::new(arenas);
        set_thread_slot(0);
        let x = arenas.allocate(256, 256).unwrap();
        // A whole chunk: a second one of arena 0, above the first.
        let y = arenas.allocate(CHUNK, 256).unwrap();
        assert!(y.addr > x.addr);
        // The first chunk is wholly free now.
        arenas.deallocate(x.addr, StreamTag::NONE).unwrap();
        let a2 = arenas.clone();
        let t = thread::spawn(move || {
            set_thread_slot(1);
            // Takes the free chunk (its entry's owner is rewritten) or
            // grows; then gives it back upstream (its entry leaves).
            let b = a2.allocate(CHUNK, 256).unwrap();
            a2.deallocate(b.addr, StreamTag::NONE).unwrap();
            a2.release_cached().unwrap();
            cumem::pool::release_thread_arenas();
        });
        // The lookup of the second chunk's block races with the rewrites.
        arenas.deallocate(y.addr, StreamTag::NONE).unwrap();
        t.join().unwrap();
        assert_arenas_balanced(&arenas);
        cumem::pool::release_thread_arenas();
    });
}
