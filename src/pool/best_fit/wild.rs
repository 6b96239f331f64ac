//! The free tail of the highest chunk is placed into last.
//!
//! # Implementation details
//!
//! A pool whose highest chunk grows in place (page remapping over one
//! address space per device) has, above its blocks, free space that
//! ends only where the address space does: the chunk's free tail is the
//! edge of that space, however small it looks. Best fit by size would
//! place a request into the tail whenever the tail is the smallest block
//! that holds it, and so raise the top of the pool while holes below it
//! that also hold the request stay empty: the pages touched over a loop
//! grow past what the same loop touches when the tail counts as the
//! largest block of all. With the rule on, a request of at least a given
//! size (a remapping pool: one page) goes into the tail only when no
//! other free block holds it.
//!
//! Smaller requests are placed by size as before. A block smaller than a
//! page raises the top by at most a page, and packed into the tail it
//! shares the tail's last page; sent to a hole below instead, it splits a
//! hole that a later request of a page or more would have used (on the
//! real training traces the rule for every size held 0.4–0.9 % more
//! memory: `docs/results.md`, "The free tail last").

use super::{BestFit, NIL};
use crate::pool::free_index::Key;

impl BestFit {
    /// Places requests of at least `min` bytes into the highest chunk's
    /// free tail last (`Some(min)`), or treats the tail as any block
    /// (`None`, the default).
    pub fn set_wilderness(&mut self, min: Option<usize>) {
        self.wild = min;
    }

    /// Whether the rule applies to a request of `size` bytes.
    #[inline]
    pub(super) fn tail_last_for(&self, size: usize) -> bool {
        self.wild.is_some_and(|min| size >= min)
    }

    /// The slot of the last block of the highest chunk.
    fn highest_last(&self) -> Option<u32> {
        let (_, &id) = self.chunks_by_addr.iter().next_back()?;
        Some(self.chunk_info(id).last)
    }

    /// The slot of the highest chunk's free tail when it is indexed (the
    /// hot block is not).
    fn wild_slot(&self) -> Option<u32> {
        let last = self.highest_last()?;
        (self.blocks[last as usize].free && self.hot.0 != last).then_some(last)
    }

    /// Whether block `slot`, coalesced with its free successor, would be
    /// the highest chunk's free tail.
    pub(super) fn joins_wild(&self, slot: u32) -> bool {
        let b = &self.blocks[slot as usize];
        let tail = if b.next == NIL {
            slot
        } else {
            let n = &self.blocks[b.next as usize];
            if !n.free || n.next != NIL {
                return false;
            }
            b.next
        };
        self.highest_last() == Some(tail)
    }

    /// The smallest free block of at least `size` bytes, ties to the
    /// lowest address; with the rule on for `size`, the highest chunk's
    /// free tail only when no other block is.
    pub(super) fn best_fit_key(&self, size: usize) -> Option<Key> {
        let k = self.free_index.best_fit(size)?;
        // Cheap first: the rule, and a block that ends its chunk.
        if self.tail_last_for(size) && self.blocks[k.2 as usize].next == NIL && self.wild_slot() == Some(k.2) {
            return Some(self.free_index.best_fit_except(size, Some(k)).unwrap_or(k));
        }
        Some(k)
    }
}

#[cfg(test)]
mod tests {
    use super::super::BestFit;
    use crate::tag::StreamTag;
    use crate::upstream::Chunk;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    const BASE: usize = 1 << 30;

    /// Places `size` as a remapping pool's first look does when every
    /// placement is acceptable (the exact best fit, the rule applied).
    fn place(f: &mut BestFit, size: usize) -> Option<usize> {
        f.allocate_preferring(size, 256, size, 16, |_, _| true).map(|(a, _)| a.addr)
    }

    /// A hole below and the tail both hold the request, the tail being
    /// the smaller: the rule takes the hole, plain best fit the tail. A
    /// request that only the tail holds still goes there.
    #[test]
    fn the_tail_is_taken_only_when_no_other_block_holds_the_request() {
        for rule in [true, false] {
            let mut f = BestFit::new();
            f.set_hot_block(true);
            f.set_wilderness(rule.then_some(256));
            assert!(f.add_chunk(Chunk { addr: BASE, size: 10 << 20 }));
            let hole = place(&mut f, 4 << 20).unwrap();
            let _wall = place(&mut f, 4 << 20).unwrap();
            // The tail is the chunk's last 2 MiB; the hole 4 MiB below.
            f.free(hole, StreamTag::NONE).unwrap();
            let tail = BASE + (8 << 20);
            let got = [1 << 20, 3 << 20, 1 << 20].map(|size| place(&mut f, size).unwrap());
            let want = if rule {
                // The hole, then what is left of it, then the tail, which
                // alone still holds the request.
                [hole, hole + (1 << 20), tail]
            } else {
                // The tail (the smaller), the hole, then the lower of the
                // two 1 MiB blocks left.
                [tail, hole, hole + (3 << 20)]
            };
            assert_eq!(got, want, "rule {rule}");
            f.check_invariants().unwrap();
        }
    }

    /// The rule covers requests of at least its size: a smaller one takes
    /// the smaller tail as plain best fit does, a larger one the hole.
    #[test]
    fn requests_below_the_rule_size_are_placed_by_size() {
        let mut f = BestFit::new();
        f.set_hot_block(true);
        f.set_wilderness(Some(1 << 20));
        assert!(f.add_chunk(Chunk { addr: BASE, size: 10 << 20 }));
        let hole = place(&mut f, 4 << 20).unwrap();
        let _wall = place(&mut f, 4 << 20).unwrap();
        f.free(hole, StreamTag::NONE).unwrap();
        let tail = BASE + (8 << 20);
        assert_eq!(place(&mut f, 512 << 10), Some(tail), "below the rule size: best fit by size");
        assert_eq!(place(&mut f, 1 << 20), Some(hole), "at the rule size: the hole before the tail");
        f.check_invariants().unwrap();
    }

    /// With the rule, a chunk that grows in place by what a request lacks
    /// places every request where best fit over one range that never ends
    /// does: randomized sizes and frees against a twin over one huge
    /// chunk (fails with the rule off).
    #[test]
    fn a_growing_chunk_places_as_one_endless_range() {
        for seed in 0..24 {
            let mut rng = SmallRng::seed_from_u64(seed);
            let mut grown = BestFit::new();
            grown.set_hot_block(seed % 2 == 0);
            grown.set_wilderness(Some(256));
            assert!(grown.add_chunk(Chunk { addr: BASE, size: 1 << 20 }));
            let mut endless = BestFit::new();
            assert!(endless.add_chunk(Chunk { addr: BASE, size: 1 << 40 }));
            let mut live: Vec<usize> = Vec::new();
            for step in 0..4000 {
                if live.is_empty() || rng.gen_bool(0.52) {
                    let size = if rng.gen_bool(0.2) {
                        rng.gen_range(1..=64usize) << 16
                    } else {
                        rng.gen_range(1..=512usize) << 8
                    };
                    let got = match place(&mut grown, size) {
                        Some(addr) => addr,
                        None => {
                            let (chunk, tail) = grown.last_chunk().unwrap();
                            assert!(grown.extend_chunk(chunk, size - tail));
                            place(&mut grown, size).expect("fits after growth")
                        }
                    };
                    let want = endless.allocate(size, 256, size).unwrap().addr;
                    assert_eq!(got, want, "seed {seed} step {step}: size {size}");
                    live.push(got);
                } else {
                    let addr = live.swap_remove(rng.gen_range(0..live.len()));
                    grown.free(addr, StreamTag::NONE).unwrap();
                    endless.free(addr, StreamTag::NONE).unwrap();
                }
            }
            grown.check_invariants().unwrap();
        }
    }
}
