use super::copy_to_ring;

#[test]
fn every_alignment_and_length_copies_exactly() {
    let src: Vec<u8> = (0..4096u32).map(|i| (i * 31 + i / 7) as u8).collect();
    for s_off in [0usize, 1, 7, 16, 33] {
        for d_off in [0usize, 1, 8, 15, 16, 63] {
            for len in [0usize, 1, 15, 16, 63, 64, 65, 127, 1000, 3000] {
                let mut dst = vec![0xAAu8; 4096 + 128];
                // SAFETY: both ranges lie inside their vectors, which
                // are distinct.
                unsafe { copy_to_ring(src[s_off..].as_ptr(), dst[d_off..].as_mut_ptr(), len) };
                assert_eq!(&dst[d_off..d_off + len], &src[s_off..s_off + len], "{s_off} {d_off} {len}");
                assert!(dst[..d_off].iter().all(|b| *b == 0xAA), "before the range");
                assert!(dst[d_off + len..].iter().all(|b| *b == 0xAA), "after the range");
            }
        }
    }
}
