use super::*;

#[test]
fn every_cached_size_has_a_tight_class() {
    let mut last = (0, 0);
    for rounded in (BLOCK_ALIGN..=MAX_CACHED_BLOCK).step_by(BLOCK_ALIGN) {
        let (index, size) = class_of(rounded).unwrap();
        assert!(index < CLASSES, "{rounded}");
        assert!(size >= rounded && size - rounded <= rounded / 16, "{rounded} -> {size}");
        assert_eq!(class_of(size), Some((index, size)), "a class size is its own class");
        assert!((index, size) >= last, "classes grow with the size");
        assert!(index == last.0 || (index == last.0 + 1 && size > last.1), "{rounded}");
        last = (index, size);
    }
    assert_eq!(last.0, CLASSES - 1);
    assert_eq!(class_of(MAX_CACHED_BLOCK + BLOCK_ALIGN), None);
}
