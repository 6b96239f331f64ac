use super::StreamTag;

#[test]
fn tags_merge_to_the_latest_free_or_mixed() {
    let a1 = StreamTag { stream: 1, seq: 1 };
    let a5 = StreamTag { stream: 1, seq: 5 };
    let b2 = StreamTag { stream: 2, seq: 2 };
    assert_eq!(a1.merge(StreamTag::NONE), a1);
    assert_eq!(StreamTag::NONE.merge(a1), a1);
    assert_eq!(a1.merge(a5), a5);
    assert_eq!(a5.merge(a1), a5);
    assert_eq!(a1.merge(b2), StreamTag::MIXED);
    assert_eq!(StreamTag::MIXED.merge(a1), StreamTag::MIXED);
    assert_eq!(a1.merge(StreamTag::MIXED), StreamTag::MIXED);
    assert_eq!(StreamTag::MIXED.merge(StreamTag::MIXED), StreamTag::MIXED);
    // Numbers counted by different shards don't compare.
    let other_shard = StreamTag { stream: 1, seq: 1 << 48 | 2 };
    assert_eq!(a5.merge(other_shard), StreamTag { stream: 1, seq: u64::MAX });
}

#[test]
fn a_finished_streams_tag_leaves_the_merge() {
    use super::{merge_asking, StreamTag, TagOracle};
    let merge_settled =
        |a: StreamTag, b: StreamTag, done: Option<&TagOracle>| merge_asking(a, b, done.map(|d| move |t| d(t)));
    let a1 = StreamTag { stream: 1, seq: 1 };
    let b2 = StreamTag { stream: 2, seq: 2 };
    let b_done: TagOracle = std::sync::Arc::new(|t: StreamTag| t.stream == 2);
    let none_done: TagOracle = std::sync::Arc::new(|_| false);
    assert_eq!(merge_settled(a1, b2, Some(&b_done)), a1);
    assert_eq!(merge_settled(b2, a1, Some(&b_done)), a1);
    assert_eq!(merge_settled(a1, b2, Some(&none_done)), StreamTag::MIXED);
    assert_eq!(merge_settled(a1, b2, None), StreamTag::MIXED);
    // Same stream, different threads' numbers: the finished one leaves.
    let other_shard = StreamTag { stream: 1, seq: 1 << 48 | 2 };
    let low_done: TagOracle = std::sync::Arc::new(|t: StreamTag| t.seq == 1);
    assert_eq!(merge_settled(a1, other_shard, Some(&low_done)), other_shard);
    // A merge that keeps order never asks.
    let panics: TagOracle = std::sync::Arc::new(|_| panic!("asked"));
    assert_eq!(merge_settled(a1, StreamTag { stream: 1, seq: 5 }, Some(&panics)).seq, 5);
    assert_eq!(merge_settled(a1, StreamTag::NONE, Some(&panics)), a1);
}
