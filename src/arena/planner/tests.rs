use super::*;

fn steps(a: usize, b: usize) -> Lifetime {
    Lifetime::new(a..=b).unwrap()
}

#[test]
fn whole_plan_requests_are_packed_in_size_order() {
    let mut p = Planner::new(4096, 4096);
    let a = p.request(Memory::Device, 100, Lifetime::WHOLE).unwrap();
    let b = p.request(Memory::Device, 300, Lifetime::WHOLE).unwrap();
    p.satisfy().unwrap();
    p.check_invariants();
    assert_eq!(p.offset(Memory::Device, b), Some(0));
    assert_eq!(p.offset(Memory::Device, a), Some(512));
    assert_eq!(p.report().device.planned_bytes, 612);
}

#[test]
fn disjoint_lifetimes_share_and_overlapping_ones_do_not() {
    let mut p = Planner::new(0, 1 << 20);
    let a = p.request(Memory::Device, 1000, steps(0, 1)).unwrap();
    let b = p.request(Memory::Device, 1000, steps(2, 3)).unwrap();
    let c = p.request(Memory::Device, 1000, steps(1, 2)).unwrap();
    p.satisfy().unwrap();
    p.check_invariants();
    assert_eq!(p.offset(Memory::Device, a), Some(0));
    assert_eq!(p.offset(Memory::Device, b), Some(0));
    assert_eq!(p.offset(Memory::Device, c), Some(1024));
}

#[test]
fn later_requests_fill_gaps_around_earlier_ones() {
    let mut p = Planner::new(0, 1 << 20);
    let a = p.request(Memory::Device, 256, steps(0, 0)).unwrap();
    let b = p.request(Memory::Device, 256, steps(0, 5)).unwrap();
    p.satisfy().unwrap();
    let c = p.request(Memory::Device, 200, steps(3, 4)).unwrap();
    p.satisfy().unwrap();
    p.check_invariants();
    assert_eq!((p.offset(Memory::Device, a), p.offset(Memory::Device, b)), (Some(0), Some(256)));
    assert_eq!(p.offset(Memory::Device, c), Some(0), "reuses a's bytes: a's lifetime ended");
}

#[test]
fn failure_changes_nothing() {
    let mut p = Planner::new(1024, 1024);
    p.request(Memory::Host, 512, Lifetime::WHOLE).unwrap();
    p.satisfy().unwrap();
    let before = p.report();
    p.request(Memory::Host, 512, Lifetime::WHOLE).unwrap();
    p.request(Memory::Host, 10, Lifetime::WHOLE).unwrap();
    p.request(Memory::Device, 10, Lifetime::WHOLE).unwrap();
    match p.satisfy() {
        Err(Error::ArenaTooSmall { memory: PoolKind::Pinned, desired: 1034, available: 1024 }) => {}
        other => panic!("{other:?}"),
    }
    p.check_invariants();
    assert_eq!(p.pending(), 3);
    assert_eq!(p.report().host.requests, before.host.requests);
    assert_eq!(p.report().device.requests, 0);
}

#[test]
fn bad_requests_are_refused() {
    let mut p = Planner::new(1024, 0);
    assert!(matches!(p.request(Memory::Host, 0, Lifetime::WHOLE), Err(Error::InvalidSize { .. })));
    assert!(matches!(p.request(Memory::Device, 1, Lifetime::WHOLE), Err(Error::ArenaTooSmall { .. })));
    #[allow(clippy::reversed_empty_ranges)]
    let empty = Lifetime::new(3..=2);
    assert!(matches!(empty, Err(Error::InvalidState(_))));
    assert_eq!(p.pending(), 0);
}
