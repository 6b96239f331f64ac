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

/// A simulated range with 8 granules of address space, the first three
/// mapped; and the chunk of granule `i`.
fn three_pieces_mapped() -> (AddressRange, impl Fn(usize) -> Chunk) {
    let r = AddressRange::new();
    let space = r.reserve_chunk(8 * GRANULARITY).unwrap();
    let piece = move |i: usize| Chunk { addr: space.addr + i * GRANULARITY, size: GRANULARITY };
    r.map_runs(&[piece(0), piece(1), piece(2)]).unwrap();
    (r, piece)
}

#[test]
fn lent_memory_keeps_its_old_mapping_until_the_mapper_or_a_map_needs_it() {
    let (r, piece) = three_pieces_mapped();
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

#[test]
fn released_lent_memory_loses_its_old_mapping_at_the_release() {
    let (r, piece) = three_pieces_mapped();
    r.lend_within(&[piece(0), piece(1)], 2 * GRANULARITY, Queued::Nothing).unwrap();
    // One lent piece is mapped elsewhere: its old mapping stays for the
    // mapper. The other is released: its old mapping goes with it.
    r.map_runs(&[piece(4)]).unwrap();
    let before = r.calls();
    r.trim_kept(0);
    let after = r.calls();
    assert_eq!((after.release - before.release, after.unmap - before.unmap), (1, 1));
    assert_eq!(lock(&r.vm).stale.len(), 1, "the old mapping of the piece in use stays");
    assert!(r.has_stale());
}

#[test]
fn new_pieces_shrink_as_the_simulated_device_fills() {
    let calls_for = |capacity: usize| {
        let r = AddressRange::with_capacity(capacity);
        let space = r.reserve_chunk(64 * GRANULARITY).unwrap();
        r.map_runs(&[Chunk { addr: space.addr, size: 32 * GRANULARITY }]).unwrap();
        r.calls().map
    };
    // 64 MiB mapped: 8 MiB pieces on a roomy device; with 1 GiB free
    // (a 512th is 2 MiB), one piece a granule.
    assert_eq!(calls_for(usize::MAX), 8);
    assert_eq!(calls_for(64 * GRANULARITY + (1 << 30)), 32);
}

#[test]
fn making_memory_past_the_capacity_fails_and_maps_nothing() {
    let r = AddressRange::with_capacity(4 * GRANULARITY);
    let space = r.reserve_chunk(8 * GRANULARITY).unwrap();
    let run = |i: usize, n: usize| Chunk { addr: space.addr + i * GRANULARITY, size: n * GRANULARITY };
    r.map_runs(&[run(0, 3)]).unwrap();
    let err = r.map_runs(&[run(3, 2)]).unwrap_err();
    assert!(matches!(err, cumem::Error::OutOfMemory { .. }), "{err}");
    assert_eq!(lock(&r.vm).held(), 3 * GRANULARITY, "the failed map left nothing mapped");
    r.map_runs(&[run(3, 1)]).unwrap();
    assert!(r.allocate_chunk(GRANULARITY).is_err(), "growth past the capacity fails too");
}

#[test]
fn what_fits_is_bound_by_live_bytes_not_by_the_pieces() {
    // A loop whose layout shifts: an unbounded pool holds 1.048 of its
    // peak of live bytes (pieces of up to 32 MiB, some partly in use);
    // on a device near that peak, pieces shrink and it fits within 1.02.
    let trace = crate::synth::Spec::from_arg("synth:loop_fixed:1").unwrap().unwrap().trace();
    let (fits, unbounded) = smallest_fit(&trace, &Config::new(), false).unwrap();
    let live = trace.peak_live as f64;
    assert!(unbounded as f64 > 1.04 * live, "unbounded {unbounded} B for {live} B live");
    assert!((fits as f64) < 1.02 * live, "fits in {fits} B for {live} B live");
}
