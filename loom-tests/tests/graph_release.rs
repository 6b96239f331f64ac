//! The hand-off from a CUDA user object's destructor to cumem: the driver
//! runs the destructor on a thread of its own, at any time, and it may only
//! post the graph's pool for cumem's next call (device/graph_object.rs).
//! These models run the real destructor and queue on foreign threads
//! against cumem's calls taking what was posted.

#![cfg(loom)]

use cumem::cuda::{release_payload, run_release, ReleaseQueue};
use cumem_loom_tests::model;
use loom::sync::Arc;
use loom::thread;

/// Runs the destructor for `payload` (an address: raw pointers are not
/// `Send`).
fn destroy(payload: usize) {
    // SAFETY: `payload` came from `release_payload` and is run once.
    unsafe { run_release(payload as *mut std::ffi::c_void) };
}

/// One destructor on a driver thread races two cumem calls: its pool is
/// taken exactly once, and at the latest by the first call after it ran.
#[test]
fn a_destructor_on_a_foreign_thread_hands_its_pool_over_exactly_once() {
    model(|| {
        let queue = Arc::new(ReleaseQueue::new());
        let payload = release_payload(queue.clone(), 7) as usize;
        let driver = thread::spawn(move || destroy(payload));
        let mut taken = queue.take();
        taken.extend(queue.take());
        driver.join().unwrap();
        // The destructor has run: the next call must see its pool.
        taken.extend(queue.take());
        assert_eq!(taken, vec![7]);
        assert!(!queue.is_pending() || queue.take().is_empty());
    });
}

/// Two graphs destroyed at once on two driver threads while a cumem call
/// takes: both pools are handed over, each once.
#[test]
fn two_destructors_at_once_lose_nothing_and_duplicate_nothing() {
    model(|| {
        let queue = Arc::new(ReleaseQueue::new());
        let (a, b) = (release_payload(queue.clone(), 1) as usize, release_payload(queue.clone(), 2) as usize);
        let first = thread::spawn(move || destroy(a));
        let second = thread::spawn(move || destroy(b));
        let mut taken = queue.take();
        first.join().unwrap();
        second.join().unwrap();
        taken.extend(queue.take());
        taken.sort_unstable();
        assert_eq!(taken, vec![1, 2]);
    });
}

/// A cumem call that sees nothing pending costs one load and takes
/// nothing; a payload never run posts nothing (the queue lives on in the
/// payload after cumem's own handle is gone).
#[test]
fn the_queue_outlives_cumem_while_a_graph_holds_its_payload() {
    model(|| {
        let queue = Arc::new(ReleaseQueue::new());
        assert!(!queue.is_pending());
        let payload = release_payload(queue.clone(), 3) as usize;
        let weak_check = queue.clone();
        drop(queue);
        let driver = thread::spawn(move || destroy(payload));
        driver.join().unwrap();
        assert_eq!(weak_check.take(), vec![3]);
    });
}
