use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::PENDING;
use crate::pool::BestFit;
use crate::tag::StreamTag;

/// The oracle's memo answers for earlier frees of a shard it was told
/// complete, and for every free of a stream whose pending tag was
/// complete (a retired stream); anything else is asked.
#[test]
fn the_oracle_is_asked_once_per_completed_shard_point() {
    let asked = Arc::new(AtomicUsize::new(0));
    let a = asked.clone();
    let mut fit = BestFit::new();
    // Stream 7: shard 1 complete up to 5; stream 9 retired.
    fit.set_tag_oracle(Arc::new(move |t: StreamTag| {
        a.fetch_add(1, Ordering::SeqCst);
        (t.stream == 7 && t.seq >> 48 == 1 && t.seq & 0xffff_ffff_ffff <= 5) || t.stream == 9
    }));
    let tag = |stream, shard: u64, n: u64| StreamTag { stream, seq: shard << 48 | n };
    let calls = || asked.load(Ordering::SeqCst);
    assert!(fit.tag_settled(tag(7, 1, 5)));
    assert_eq!(calls(), 1);
    assert!(fit.tag_settled(tag(7, 1, 3)) && fit.tag_settled(tag(7, 1, 5)));
    assert_eq!(calls(), 1, "earlier frees of the shard: no question");
    assert!(!fit.tag_settled(tag(7, 1, 6)) && !fit.tag_settled(tag(7, 2, 1)));
    assert!(!fit.tag_settled(StreamTag { stream: 7, seq: PENDING }));
    assert_eq!(calls(), 4, "a later free, another shard, a merged tag: asked");
    assert!(!fit.tag_settled(tag(8, 1, 1)));
    assert!(fit.tag_settled(StreamTag { stream: 9, seq: PENDING }));
    let before = calls();
    assert!(fit.tag_settled(tag(9, 3, 100)) && fit.tag_settled(StreamTag { stream: 9, seq: PENDING }));
    assert_eq!(calls(), before, "a stream whose every free is complete");
    assert!(!fit.tag_settled(StreamTag::MIXED) && fit.tag_settled(StreamTag::NONE));
}
