use super::CumemPoolStats;
use cumem::pool::PoolStats;

#[test]
fn reserved_is_physical_memory_where_a_pool_remaps_pages() {
    let s = PoolStats {
        reserved: 8 << 30,
        peak_reserved: 9 << 30,
        mapped: 5 << 30,
        peak_mapped: 6 << 30,
        ..Default::default()
    };
    let c = CumemPoolStats::from(s);
    assert_eq!((c.reserved, c.peak_reserved), (5 << 30, 6 << 30));
}
