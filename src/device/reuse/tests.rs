use super::{Known, PRUNE_FIRST, RETIRED_KEPT};
use crate::cuda::Stream;

#[test]
fn streams_that_come_and_go_leave_bounded_tables() {
    let mut known = Known::default();
    let mut newest = 0;
    for _ in 0..20_000 {
        // A thread's stream: registered, then dropped by its thread.
        let s = Stream::host();
        newest = s.id();
        known.live.insert(s.id(), s);
        if known.live.len() >= known.prune_at.max(PRUNE_FIRST) {
            drop(known.prune());
        }
    }
    assert!(known.live.len() <= 2 * PRUNE_FIRST, "{} streams held", known.live.len());
    assert!(known.retired.len() <= RETIRED_KEPT, "{} retired ids kept", known.retired.len());
    // The newest are the ones remembered.
    assert!(known.retired.iter().all(|&id| id + 2 * RETIRED_KEPT as u64 > newest));
}
