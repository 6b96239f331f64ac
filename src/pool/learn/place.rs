//! The planner of a learned window: greedy by size over lifetimes, in the
//! pool's own address space, around what is fixed.
//!
//! Each block of the window, largest first (ties: the earlier start),
//! goes at the lowest address where it overlaps no block already placed
//! whose lifetime overlaps its own, and no range occupied for the whole
//! window (holes, live blocks the window does not know, gaps between
//! chunks). Blocks already at an address (pinned) are placed first as
//! they are. The same rule as the planning arena's (`arena/planner.rs`),
//! with the blocks that overlap in time found through time buckets, so
//! that a window of tens of thousands of blocks plans in milliseconds.

/// A block of the window: its size, lifetime `[t0, t1)` in the window's
/// clock, and where it must stay (`pinned`), if anywhere.
#[derive(Debug, Clone, Copy)]
pub(super) struct Item {
    pub(super) size: usize,
    pub(super) t0: u32,
    pub(super) t1: u32,
    pub(super) pinned: Option<usize>,
}

/// Something that occupies `[a0, a1)` during `[t0, t1)`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Occupied {
    pub(super) t0: u32,
    pub(super) t1: u32,
    pub(super) a0: usize,
    pub(super) a1: usize,
}

/// Buckets the window's time is cut into at most.
const BUCKETS: usize = 4096;

/// Buckets an occupant may span and still be filed in each.
const LONG: usize = 16;

/// Places `items` within `[space.0, space.1)` around `fixed` (occupied
/// for part of the window) and `always` (occupied for all of it);
/// returns each item's address (a pinned item's pin), or `None` for an
/// item that fits nowhere. `span` is the window's length in its clock.
pub(super) fn place(
    items: &[Item],
    fixed: &[Occupied],
    always: &mut [(usize, usize)],
    space: (usize, usize),
    span: u32,
) -> Vec<Option<usize>> {
    always.sort_unstable();
    let span = span.max(1) as usize;
    let width = span.div_ceil(BUCKETS).max(1);
    let mut buckets: Vec<Vec<u32>> = vec![Vec::new(); span.div_ceil(width)];
    let mut occ: Vec<Occupied> = Vec::with_capacity(items.len() + fixed.len());
    // Occupants longer than `LONG` buckets are kept apart and looked at
    // by every item (a block live through the window would otherwise sit
    // in every bucket, and every item would meet it in each).
    let mut long: Vec<u32> = Vec::new();
    let add = |occ: &mut Vec<Occupied>, buckets: &mut [Vec<u32>], long: &mut Vec<u32>, o: Occupied| {
        if o.t1 <= o.t0 || o.a1 <= o.a0 {
            return;
        }
        let id = occ.len() as u32;
        occ.push(o);
        let last = ((o.t1 as usize - 1) / width).min(buckets.len() - 1);
        let first = (o.t0 as usize / width).min(last);
        if last - first >= LONG {
            long.push(id);
            return;
        }
        for b in &mut buckets[first..=last] {
            b.push(id);
        }
    };
    let mut out: Vec<Option<usize>> = vec![None; items.len()];
    for o in fixed {
        add(&mut occ, &mut buckets, &mut long, *o);
    }
    for (i, it) in items.iter().enumerate() {
        if let Some(at) = it.pinned {
            add(&mut occ, &mut buckets, &mut long, Occupied { t0: it.t0, t1: it.t1, a0: at, a1: at + it.size });
            out[i] = Some(at);
        }
    }
    let mut order: Vec<usize> = (0..items.len()).filter(|&i| items[i].pinned.is_none()).collect();
    order.sort_unstable_by(|&a, &b| items[b].size.cmp(&items[a].size).then(items[a].t0.cmp(&items[b].t0)));
    // `seen[o]`: the last item whose conflicts took `o` (no duplicates).
    let mut seen: Vec<u32> = Vec::new();
    let mut conflicts: Vec<(usize, usize)> = Vec::new();
    for (n, &i) in order.iter().enumerate() {
        let it = items[i];
        if it.t1 <= it.t0 {
            continue;
        }
        let stamp = n as u32 + 1;
        seen.resize(occ.len(), 0);
        conflicts.clear();
        let last = ((it.t1 as usize - 1) / width).min(buckets.len() - 1);
        for b in &buckets[(it.t0 as usize / width).min(last)..=last] {
            for &o in b {
                let (s, p) = (&mut seen[o as usize], occ[o as usize]);
                if *s != stamp && p.t0 < it.t1 && it.t0 < p.t1 {
                    *s = stamp;
                    conflicts.push((p.a0, p.a1));
                }
            }
        }
        for &o in &long {
            let p = occ[o as usize];
            if p.t0 < it.t1 && it.t0 < p.t1 {
                conflicts.push((p.a0, p.a1));
            }
        }
        conflicts.sort_unstable();
        let at = lowest_gap(&conflicts, always, space.0, it.size);
        if at + it.size <= space.1 {
            out[i] = Some(at);
            add(&mut occ, &mut buckets, &mut long, Occupied { t0: it.t0, t1: it.t1, a0: at, a1: at + it.size });
        }
    }
    out
}

/// The lowest address at or above `from` where `size` bytes overlap
/// nothing in `a` or `b` (both sorted by start).
fn lowest_gap(a: &[(usize, usize)], b: &[(usize, usize)], from: usize, size: usize) -> usize {
    let (mut i, mut j, mut at) = (0, 0, from);
    loop {
        let next = match (a.get(i), b.get(j)) {
            (Some(x), Some(y)) if x.0 <= y.0 => {
                i += 1;
                *x
            }
            (Some(x), None) => {
                i += 1;
                *x
            }
            (_, Some(y)) => {
                j += 1;
                *y
            }
            (None, None) => return at,
        };
        if at + size <= next.0 {
            return at;
        }
        at = at.max(next.1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(size: usize, t0: u32, t1: u32) -> Item {
        Item { size, t0, t1, pinned: None }
    }

    /// Blocks whose lifetimes overlap never share an address; blocks that
    /// live at different times do; pins, fixed and always-occupied
    /// ranges are kept clear; a block that fits nowhere stays unplaced.
    #[test]
    fn placement_respects_lifetimes_pins_and_occupied_ranges() {
        let items = [
            item(100, 0, 10),
            item(50, 0, 5),
            item(50, 5, 10),
            Item { size: 20, t0: 0, t1: 10, pinned: Some(1000) },
            item(2000, 0, 1),
        ];
        let fixed = [Occupied { t0: 0, t1: 3, a0: 1100, a1: 1200 }];
        let mut always = vec![(1200, 1300)];
        let out = place(&items, &fixed, &mut always, (1000, 1400), 10);
        assert_eq!(out[3], Some(1000), "a pin stays");
        assert_eq!(out[0], Some(1300), "the largest goes to the lowest gap that holds it all the time");
        assert_eq!(out[1], Some(1020));
        assert_eq!(out[2], Some(1020), "a block of a later lifetime reuses the address");
        assert_eq!(out[4], None, "fits nowhere");
        // Brute force: no two placed blocks that overlap in time overlap in space.
        for (i, a) in items.iter().enumerate() {
            for (j, b) in items.iter().enumerate().skip(i + 1) {
                if let (Some(x), Some(y)) = (out[i], out[j]) {
                    let time = a.t0 < b.t1 && b.t0 < a.t1;
                    assert!(!(time && x < y + b.size && y < x + a.size), "{i} and {j} collide");
                }
            }
        }
    }

    /// Random windows: the placement never puts two blocks that live at
    /// once on the same bytes, nor on an occupied range.
    #[test]
    fn random_windows_never_collide() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..50 {
            let n = 1 + (next() % 200) as usize;
            let span = 1 + (next() % 500) as u32;
            let items: Vec<Item> = (0..n)
                .map(|_| {
                    let t0 = (next() % u64::from(span)) as u32;
                    let t1 = t0 + 1 + (next() % u64::from(span - t0)) as u32;
                    item(256 * (1 + (next() % 64) as usize), t0, t1)
                })
                .collect();
            let mut always: Vec<(usize, usize)> =
                (0..5).map(|_| (next() % 40_000) as usize * 256).map(|a| (a, a + 4096)).collect();
            let occupied = always.clone();
            let out = place(&items, &[], &mut always, (0, 1 << 24), span);
            for (i, a) in items.iter().enumerate() {
                let x = out[i].expect("room enough for all");
                assert!(occupied.iter().all(|&(s, e)| x + a.size <= s || e <= x), "on an occupied range");
                for (j, b) in items.iter().enumerate().skip(i + 1) {
                    let y = out[j].unwrap();
                    let time = a.t0 < b.t1 && b.t0 < a.t1;
                    assert!(!(time && x < y + b.size && y < x + a.size), "{i} and {j} collide");
                }
            }
        }
    }
}
