use super::*;

#[test]
fn page_runs_match_a_page_by_page_walk() {
    let page = 4096;
    let mut p = Pages::new(page);
    let base = 1 << 30;
    p.add_unmapped(base, 300 * page);
    // Map a pattern that crosses word edges.
    let mut mapped = vec![false; 300];
    let mut x = 12345u64;
    for _ in 0..60 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let start = (x % 290) as usize;
        let len = 1 + (x >> 20) as usize % 9;
        p.mark(Chunk { addr: base + start * page, size: len * page }, false);
        mapped[start..start + len].iter_mut().for_each(|m| *m = true);
    }
    for (start, len) in [(0, 300), (63, 2), (1, 64), (100, 130), (299, 1)] {
        let addr = base + start * page + 256;
        let size = len * page - 512;
        let want_holes: usize = (start..start + len).filter(|&i| !mapped[i]).count();
        let got: usize = p.holes_in(addr, size).iter().map(|c| c.size / page).sum();
        assert_eq!(got, want_holes, "holes in {start}+{len}");
        assert_eq!(p.clear(addr, size), want_holes == 0, "clear {start}+{len}");
        assert_eq!(p.hole_count(addr, size), want_holes, "hole count {start}+{len}");
        // Whole pages inside: the first and last are cut by the 256 B.
        let inner = (start + 1..start + len - 1).filter(|&i| mapped[i]).count();
        let got: usize = p.mapped_inside(addr, size).iter().map(|c| c.size / page).sum();
        assert_eq!(got, inner, "mapped inside {start}+{len}");
    }
    // A mapped run across two word edges, then every range near it:
    // clear ones that span words, and ones a hole ends or starts.
    p.mark(Chunk { addr: base + 120 * page, size: 130 * page }, false);
    mapped[120..250].iter_mut().for_each(|m| *m = true);
    let mut spanning = 0;
    for start in (100..260).step_by(3) {
        for len in [1, 2, 7, 63, 64, 65, 100, 129] {
            if start + len > 300 {
                continue;
            }
            let holes = (start..start + len).filter(|&i| !mapped[i]).count();
            let (addr, size) = (base + start * page, len * page);
            assert_eq!(p.clear(addr, size), holes == 0, "clear {start}+{len}");
            spanning += usize::from(holes == 0 && start / 64 != (start + len - 1) / 64);
        }
    }
    assert!(spanning > 10, "clear ranges across word edges: {spanning}");
}
