//! Loom model of a stream's sharded free counters
//! (`src/cuda/free_clock.rs`).

#![cfg(loom)]

use loom::sync::atomic::Ordering;
use loom::sync::Arc;
use loom::thread;

use cumem_loom_tests::model;

/// The sharded free counters of a stream: a
/// free on one thread (work queued, then its number counted) races a
/// synchronisation on another (read every count, wait, mark them
/// complete). Whenever the free later counts as complete, the
/// synchronisation must have seen the work queued before it; a free
/// counted after the read never counts as complete.
#[test]
fn a_free_is_complete_only_after_a_synchronisation_saw_it() {
    use cumem::cuda::FreeClock;
    use loom::sync::atomic::AtomicBool;
    model(|| {
        let clock = Arc::new(FreeClock::new());
        let queued = Arc::new(AtomicBool::new(false));
        let (c2, q2) = (clock.clone(), queued.clone());
        let freer = thread::spawn(move || {
            // The work the free follows (a kernel queued on the stream).
            q2.store(true, Ordering::Relaxed);
            c2.tick()
        });
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
