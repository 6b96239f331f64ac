use super::{batches, Saved, BATCH};

#[test]
fn batches_cover_every_block_once_in_order() {
    let saved: Vec<Saved> = (0..10).map(|i| Saved { addr: i * BATCH, len: BATCH / 3 + i, offset: i * BATCH }).collect();
    let b = batches(&saved);
    assert_eq!(b.iter().map(|b| b.len()).sum::<usize>(), 10);
    assert!(b.iter().flat_map(|b| b.iter()).map(|s| s.addr).eq(saved.iter().map(|s| s.addr)));
    assert_eq!(b[0].len(), 3, "a batch closes once it holds BATCH bytes");
    assert!(batches(&[]).is_empty());
}
