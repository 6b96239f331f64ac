use super::*;

#[test]
fn frees_complete_once_a_synchronisation_saw_them() {
    let c = std::sync::Arc::new(FreeClock::new());
    assert!(c.all_complete());
    let a = c.tick();
    // Another thread counts on a shard of its own.
    let c2 = c.clone();
    let b = std::thread::spawn(move || c2.tick()).join().unwrap();
    assert_ne!(a >> COUNT_BITS, b >> COUNT_BITS, "two live threads, two shards");
    let seen = c.seen();
    let later = c.tick();
    assert!(!c.completed(a) && !c.completed(b) && !c.all_complete());
    c.mark_complete(&seen);
    assert!(c.completed(a) && c.completed(b));
    assert!(!c.completed(later) && !c.all_complete(), "counted after the synchronisation read");
    assert!(!c.completed(PENDING));
}
