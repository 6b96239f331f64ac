use crate::upstream::region::{Region, VmBackend};
use crate::upstream::tight_piece;

const MIB: usize = 1 << 20;

fn piece_sizes(region: &Region) -> Vec<usize> {
    region.piece_bounds().map(|(_, size)| size / MIB).collect()
}

#[test]
fn tight_pieces_are_a_sixteenth_of_the_free_memory_never_under_two_mib() {
    assert_eq!(tight_piece(8 << 30), 512 * MIB);
    assert_eq!(tight_piece(256 * MIB), 16 * MIB);
    assert_eq!(tight_piece(100 * MIB), 4 * MIB, "a power of two below a 16th");
    assert_eq!(tight_piece(10 * MIB), 2 * MIB);
    assert_eq!(tight_piece(0), 2 * MIB);
}

#[test]
fn pieces_shrink_as_the_device_fills_and_grow_back_with_room() {
    let mut region = Region::reserve(&VmBackend::Host, 256 * MIB, false).unwrap();
    region.note_device_free(64 * MIB);
    region.map_run(0, 16 * MIB).unwrap();
    assert_eq!(piece_sizes(&region), [4; 4], "a 16th of 64 MiB free");
    region.note_device_free(usize::MAX);
    region.map_run(16 * MIB, 16 * MIB).unwrap();
    assert_eq!(piece_sizes(&region), [4, 4, 4, 4, 8, 8], "the pool's own size sets them with room");
    region.note_device_free(8 << 30);
    region.map_run(32 * MIB, 8 * MIB).unwrap();
    assert_eq!(piece_sizes(&region)[6..], [8], "room never makes pieces larger than the pool's size allows");
}
