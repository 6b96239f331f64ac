//! The index of free blocks: exact best fit in a few small ordered sets.
//!
//! # Implementation details
//!
//! Free blocks are binned by size class and, within a bin, kept ordered by
//! `(size, addr)`. Classes are exact for blocks under 32 KiB (one class per
//! 256-byte step) and above that split each doubling into 32 classes. A
//! bitmap marks the non-empty bins. Classes are ordered like sizes: every
//! block in a higher class is larger than every block in a lower one. So the
//! best fit for `size` is the first block at or after `(size, 0)` in the
//! bin of `size`'s class, or else the first block of the next non-empty bin
//! (found with the bitmap): the smallest block that fits, ties to the lowest
//! address, as with one ordered set over all free blocks, but each search
//! and update touches only one small set.

use std::collections::BTreeSet;

/// Blocks under this many 256-byte units get a class each.
const EXACT_UNITS: usize = 128;
/// Classes per doubling above that.
const SUB_BITS: u32 = 5;
/// Enough classes for blocks up to 2^64 bytes.
const CLASSES: usize = EXACT_UNITS + (64 - 8 - 7) * (1 << SUB_BITS);
const WORDS: usize = CLASSES.div_ceil(64);

/// A free block's key: size, address, slab slot.
pub(super) type Key = (usize, usize, u32);

/// Free blocks by size class (see the module docs).
#[derive(Debug)]
pub(super) struct FreeIndex {
    bins: Vec<BTreeSet<Key>>,
    nonempty: [u64; WORDS],
    len: usize,
}

impl Default for FreeIndex {
    fn default() -> Self {
        FreeIndex { bins: (0..CLASSES).map(|_| BTreeSet::new()).collect(), nonempty: [0; WORDS], len: 0 }
    }
}

/// The class of a block of `size` bytes (a non-zero multiple of 256).
fn class_of(size: usize) -> usize {
    let units = size >> 8;
    if units < EXACT_UNITS {
        return units;
    }
    let e = usize::BITS - 1 - units.leading_zeros(); // ≥ 7
    let sub = (units >> (e - SUB_BITS)) & ((1 << SUB_BITS) - 1);
    EXACT_UNITS + (e as usize - 7) * (1 << SUB_BITS) + sub
}

impl FreeIndex {
    /// Adds a free block; `false` if it was there already.
    pub(super) fn insert(&mut self, key: Key) -> bool {
        let c = class_of(key.0);
        let added = self.bins[c].insert(key);
        if added {
            self.nonempty[c / 64] |= 1 << (c % 64);
            self.len += 1;
        }
        added
    }

    /// Removes a free block; `false` if it was not there.
    pub(super) fn remove(&mut self, key: &Key) -> bool {
        let c = class_of(key.0);
        let removed = self.bins[c].remove(key);
        if removed {
            self.len -= 1;
            if self.bins[c].is_empty() {
                self.nonempty[c / 64] &= !(1 << (c % 64));
            }
        }
        removed
    }

    /// Whether the block is indexed.
    pub(super) fn contains(&self, key: &Key) -> bool {
        self.bins[class_of(key.0)].contains(key)
    }

    /// The number of free blocks.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// The first non-empty class after `c`.
    fn next_nonempty(&self, c: usize) -> Option<usize> {
        let start = c + 1;
        let mut w = start / 64;
        if w >= WORDS {
            return None;
        }
        let mut bits = self.nonempty[w] & (!0u64 << (start % 64));
        loop {
            if bits != 0 {
                return Some(w * 64 + bits.trailing_zeros() as usize);
            }
            w += 1;
            if w >= WORDS {
                return None;
            }
            bits = self.nonempty[w];
        }
    }

    /// The smallest block of at least `size` bytes, ties to the lowest
    /// address.
    pub(super) fn best_fit(&self, size: usize) -> Option<Key> {
        let c = class_of(size);
        if let Some(&k) = self.bins[c].range((size, 0, 0)..).next() {
            return Some(k);
        }
        let next = self.next_nonempty(c)?;
        self.bins[next].first().copied()
    }

    /// Every block of at least `size` bytes, in `(size, addr)` order.
    pub(super) fn at_least(&self, size: usize) -> impl Iterator<Item = &Key> + '_ {
        let c = class_of(size);
        let first = self.bins[c].range((size, 0, 0)..);
        let rest = std::iter::successors(self.next_nonempty(c), move |&b| self.next_nonempty(b))
            .flat_map(move |b| self.bins[b].iter());
        first.chain(rest)
    }

    /// The largest free block.
    pub(super) fn last(&self) -> Option<&Key> {
        let w = self.nonempty.iter().rposition(|&bits| bits != 0)?;
        let c = w * 64 + 63 - self.nonempty[w].leading_zeros() as usize;
        self.bins[c].last()
    }

    /// Every free block, in `(size, addr)` order.
    pub(super) fn iter(&self) -> impl Iterator<Item = &Key> + '_ {
        self.at_least(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_are_ordered_like_sizes() {
        let mut prev = 0;
        let mut size = 256usize;
        while size < 1 << 50 {
            let c = class_of(size);
            assert!(c >= prev && c < CLASSES, "size {size}: class {c} after {prev}");
            prev = c;
            size += (size / 97).next_multiple_of(256).max(256);
        }
        assert!(class_of(usize::MAX & !255) < CLASSES);
    }

    #[test]
    fn best_fit_crosses_bins() {
        let mut ix = FreeIndex::default();
        for (i, size) in [1 << 20, 256, 3 << 20, 4096, 1 << 20].into_iter().enumerate() {
            assert!(ix.insert((size, 1000 * i + 4096, i as u32)));
        }
        assert_eq!(ix.best_fit(512).map(|k| k.0), Some(4096));
        assert_eq!(ix.best_fit(1 << 20), Some((1 << 20, 4096, 0)), "ties go to the lowest address");
        assert_eq!(ix.best_fit((1 << 20) + 256).map(|k| k.0), Some(3 << 20));
        assert_eq!(ix.best_fit(4 << 20), None);
        assert_eq!(ix.last().map(|k| k.0), Some(3 << 20));
        let sizes: Vec<usize> = ix.iter().map(|k| k.0).collect();
        assert_eq!(sizes, [256, 4096, 1 << 20, 1 << 20, 3 << 20]);
        assert!(ix.remove(&(3 << 20, 6096, 2)));
        assert_eq!(ix.last().map(|k| k.0), Some(1 << 20));
        assert_eq!(ix.len(), 4);
    }
}
