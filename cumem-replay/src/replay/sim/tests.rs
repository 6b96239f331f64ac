use super::*;

#[test]
fn the_top_chunk_grows_and_shrinks_in_place() {
    let r = AddressRange::new();
    let a = r.allocate_chunk(GRANULARITY).unwrap();
    assert!(r.try_extend(a, GRANULARITY).unwrap());
    let a = Chunk { addr: a.addr, size: 2 * GRANULARITY };
    let b = r.allocate_chunk(GRANULARITY).unwrap();
    assert!(b.addr > a.end(), "chunks never touch");
    assert!(!r.try_extend(a, GRANULARITY).unwrap(), "only the top chunk grows");
    assert!(r.try_shrink(b, GRANULARITY).unwrap());
    assert!(!r.try_shrink(a, GRANULARITY).unwrap());
}

#[test]
fn lent_memory_keeps_its_old_mapping_until_the_mapper_or_a_map_needs_it() {
    let r = AddressRange::new();
    let space = r.reserve_chunk(8 * GRANULARITY).unwrap();
    let piece = |i: usize| Chunk { addr: space.addr + i * GRANULARITY, size: GRANULARITY };
    r.map_runs(&[piece(0), piece(1), piece(2)]).unwrap();
    // Two pieces lent: their old places stay mapped, nothing unmapped yet.
    let lent = r.lend_within(&[piece(0), piece(1)], 2 * GRANULARITY, Queued::Nothing).unwrap();
    assert_eq!(lent.len(), 2);
    assert_eq!(r.calls().unmap, 0);
    // A map over one old place unmaps it first.
    let before = r.calls();
    r.map_runs(&[piece(0)]).unwrap();
    assert_eq!(r.calls().unmap - before.unmap, 1, "the map unmapped the old mapping in its way");
    // The other goes once the pool has made no move for the quiet spell.
    for _ in 0..settings().1.saturating_sub(1) {
        r.tick();
    }
    assert_eq!(r.calls().unmap - before.unmap, 1, "the mapper waited for the quiet spell");
    r.tick();
    r.tick();
    assert_eq!(r.calls().unmap - before.unmap, 2, "the mapper unmapped the last old mapping");
    assert!(!r.stale.load(std::sync::atomic::Ordering::Relaxed));
}
