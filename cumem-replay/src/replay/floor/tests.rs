use super::*;
use crate::trace::parse_str;

const MIB: usize = 1 << 20;

#[test]
fn a_long_lived_block_above_a_hole_pins_the_top_but_not_the_floor() {
    // A (6 MiB) at 0, B (2 MiB) above it; A goes; D (8 MiB) does not fit
    // the 6 MiB hole and lands above B. Never unmapping keeps 16 MiB;
    // the pages live blocks touch peak at B's one and D's four: 10 MiB.
    let csv = format!(
        "Thread,Time,Action,Pointer,Size,Stream\n\
         0,1,allocate,0x1000,{},0\n0,2,allocate,0x2000,{},0\n0,3,free,0x1000,{},0\n0,4,allocate,0x3000,{},0\n",
        6 * MIB,
        2 * MIB,
        6 * MIB,
        8 * MIB
    );
    let t = parse_str(&csv).unwrap();
    assert_eq!(t.peak_live, 10 * MIB);
    let f = page_floor(&t, 2 * MIB).unwrap();
    assert_eq!((f.top, f.touched), (16 * MIB, 10 * MIB));
}

#[test]
fn blocks_sharing_a_page_count_it_once() {
    let csv = "Thread,Time,Action,Pointer,Size,Stream\n\
               0,1,allocate,0x1000,1024,0\n0,2,allocate,0x2000,1024,0\n0,3,free,0x1000,1024,0\n";
    let t = parse_str(csv).unwrap();
    let f = page_floor(&t, 2 * MIB).unwrap();
    assert_eq!((f.top, f.touched), (2 * MIB, 2 * MIB));
}
