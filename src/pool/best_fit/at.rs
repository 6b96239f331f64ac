//! Placement at a given address (a learned plan, `pool/learn.rs`): an
//! index of the free blocks by address, kept only while a plan may be
//! followed, and the allocation of a given range out of the free block
//! that holds it.

use std::collections::BTreeMap;

use super::{Allocation, BestFit};
use crate::upstream::BLOCK_ALIGN;

impl BestFit {
    /// Keeps an index of the free blocks by address (on), or drops it
    /// (off), for [`allocate_at`](Self::allocate_at). Off by default: it
    /// costs an ordered-map update per index change.
    pub fn index_addresses(&mut self, on: bool) {
        self.flush_hot();
        self.by_addr =
            on.then(|| self.free_index.iter().map(|&(_, addr, slot)| (addr, slot)).collect::<BTreeMap<_, _>>());
    }

    /// Allocates exactly `[addr, addr + size)` (`size` rounded to 256 B,
    /// `addr` a multiple of 256) when one free block holds all of it;
    /// `None` otherwise, or when the address index is off. The returned
    /// tag is the free block's, as for any placement.
    pub fn allocate_at(&mut self, addr: usize, size: usize, requested: usize) -> Option<Allocation> {
        debug_assert!(size % BLOCK_ALIGN == 0 && size > 0);
        if addr % BLOCK_ALIGN != 0 {
            return None;
        }
        self.flush_hot();
        let (&start, &slot) = self.by_addr.as_ref()?.range(..=addr).next_back()?;
        let b = &self.blocks[slot as usize];
        debug_assert!(b.free && b.addr == start);
        if start + b.size < addr.checked_add(size)? {
            return None;
        }
        Some(self.allocate_slot_at(slot, addr, size, requested))
    }
}

#[cfg(test)]
mod tests {
    use super::super::BestFit;
    use crate::tag::StreamTag;
    use crate::upstream::Chunk;

    /// Placement at an address carves the range out of the free block
    /// that holds it, refuses ranges that are not wholly free, and keeps
    /// the invariants (the index by address included).
    #[test]
    fn allocation_at_an_address_takes_only_wholly_free_ranges() {
        let mut f = BestFit::new();
        f.set_hot_block(true);
        f.index_addresses(true);
        let base = 1 << 30;
        assert!(f.add_chunk(Chunk { addr: base, size: 1 << 20 }));
        let a = f.allocate_at(base + 4096, 1024, 1000).unwrap();
        assert_eq!((a.addr, a.size), (base + 4096, 1024));
        assert!(f.allocate_at(base + 4096 + 512, 1024, 1024).is_none(), "overlaps a live block");
        assert!(f.allocate_at(base + (1 << 20) - 512, 1024, 1024).is_none(), "runs past the chunk");
        assert!(f.allocate_at(base + 100, 256, 256).is_none(), "misaligned");
        let b = f.allocate_at(base, 4096, 4096).unwrap();
        assert_eq!(b.addr, base);
        f.check_invariants().unwrap();
        f.free(a.addr, StreamTag::NONE).unwrap();
        f.free(b.addr, StreamTag::NONE).unwrap();
        assert!(f.allocate_at(base + 2048, 4096, 4096).is_some(), "the hot block is coalesced first");
        f.check_invariants().unwrap();
        f.index_addresses(false);
        assert!(f.allocate_at(base + 65536, 256, 256).is_none(), "the index is off");
    }
}
