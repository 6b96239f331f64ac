//! The index of free blocks: exact best fit in a few small ordered sets.
//!
//! # Implementation details
//!
//! Free blocks are binned by size class and, within a bin, kept ordered by
//! `(size, addr)`. Classes are exact for blocks under 32 KiB (one class per
//! 256-byte step) and above that split each doubling into 32 classes. A
//! bitmap marks the non-empty bins, and a summary word the bitmap's
//! non-empty words, so the next non-empty bin is two reads away. Classes
//! are ordered like sizes: every block in a higher class is larger than
//! every block in a lower one. So the best fit for `size` is the first
//! block at or after `(size, 0)` in the bin of `size`'s class, or else the
//! first block of the next non-empty bin (found with the bitmap): the
//! smallest block that fits, ties to the lowest address, as with one
//! ordered set over all free blocks, but each search and update touches
//! only one small set.
//!
//! A bin is a sorted vector while it holds at most [`SMALL_BIN`] blocks
//! (binary search, a short move on insert and remove, and no allocation
//! once its capacity is there: most bins empty and refill all the time),
//! and an ordered set beyond that, so every operation stays O(log n).

use std::collections::BTreeSet;

/// Blocks a bin keeps in a sorted vector before it becomes an ordered set.
const SMALL_BIN: usize = 32;

/// Blocks under this many 256-byte units get a class each.
const EXACT_UNITS: usize = 128;
/// Classes per doubling above that.
const SUB_BITS: u32 = 5;
/// Enough classes for blocks up to 2^64 bytes.
const CLASSES: usize = EXACT_UNITS + (64 - 8 - 7) * (1 << SUB_BITS);
const WORDS: usize = CLASSES.div_ceil(64);
// One bit of `FreeIndex::words` per word of classes (and `w + 1` shifts
// below 64).
const _: () = assert!(WORDS < 64);

/// A free block's key: size, address, slab slot.
pub(super) type Key = (usize, usize, u32);

/// One size class's free blocks, ordered by key.
#[derive(Debug)]
enum Bin {
    Small(Vec<Key>),
    Large(BTreeSet<Key>),
}

impl Default for Bin {
    fn default() -> Self {
        Bin::Small(Vec::new())
    }
}

impl Bin {
    fn insert(&mut self, key: Key) -> bool {
        match self {
            Bin::Small(v) => match v.binary_search(&key) {
                Ok(_) => false,
                Err(at) => {
                    if v.len() == SMALL_BIN {
                        let mut set: BTreeSet<Key> = v.drain(..).collect();
                        set.insert(key);
                        *self = Bin::Large(set);
                    } else {
                        v.insert(at, key);
                    }
                    true
                }
            },
            Bin::Large(set) => set.insert(key),
        }
    }

    fn remove(&mut self, key: &Key) -> bool {
        match self {
            Bin::Small(v) => match v.binary_search(key) {
                Ok(at) => {
                    v.remove(at);
                    true
                }
                Err(_) => false,
            },
            Bin::Large(set) => {
                let removed = set.remove(key);
                if removed && set.len() < SMALL_BIN / 2 {
                    *self = Bin::Small(set.iter().copied().collect());
                }
                removed
            }
        }
    }

    fn contains(&self, key: &Key) -> bool {
        match self {
            Bin::Small(v) => v.binary_search(key).is_ok(),
            Bin::Large(set) => set.contains(key),
        }
    }

    fn is_empty(&self) -> bool {
        match self {
            Bin::Small(v) => v.is_empty(),
            Bin::Large(set) => set.is_empty(),
        }
    }

    fn first(&self) -> Option<&Key> {
        match self {
            Bin::Small(v) => v.first(),
            Bin::Large(set) => set.first(),
        }
    }

    fn last(&self) -> Option<&Key> {
        match self {
            Bin::Small(v) => v.last(),
            Bin::Large(set) => set.last(),
        }
    }

    /// The blocks of at least `size` bytes, in order.
    fn at_least(&self, size: usize) -> BinIter<'_> {
        match self {
            Bin::Small(v) => BinIter::Small(v[v.partition_point(|k| k.0 < size)..].iter()),
            Bin::Large(set) => BinIter::Large(set.range((size, 0, 0)..)),
        }
    }

    /// The first block after `key` (which need not be in the bin).
    fn first_after(&self, key: &Key) -> Option<&Key> {
        match self {
            Bin::Small(v) => v.get(v.partition_point(|k| k <= key)),
            Bin::Large(set) => set.range((std::ops::Bound::Excluded(*key), std::ops::Bound::Unbounded)).next(),
        }
    }

    /// The first block of at least `size` bytes.
    fn first_at_least(&self, size: usize) -> Option<&Key> {
        match self {
            Bin::Small(v) => v.get(v.partition_point(|k| k.0 < size)),
            Bin::Large(set) => set.range((size, 0, 0)..).next(),
        }
    }
}

/// An ordered walk over part of a bin (no allocation: under the pool lock).
enum BinIter<'a> {
    Small(std::slice::Iter<'a, Key>),
    Large(std::collections::btree_set::Range<'a, Key>),
}

impl<'a> Iterator for BinIter<'a> {
    type Item = &'a Key;

    fn next(&mut self) -> Option<&'a Key> {
        match self {
            BinIter::Small(i) => i.next(),
            BinIter::Large(r) => r.next(),
        }
    }
}

/// Free blocks by size class (see the module docs).
#[derive(Debug)]
pub(super) struct FreeIndex {
    bins: Vec<Bin>,
    nonempty: [u64; WORDS],
    /// Bit `w` set where `nonempty[w]` is not zero: a search for the next
    /// non-empty class reads two words, not every word up to it.
    words: u64,
    len: usize,
    /// Inserts and removals so far: the same count, the same blocks.
    changes: u64,
}

impl Default for FreeIndex {
    fn default() -> Self {
        FreeIndex {
            bins: (0..CLASSES).map(|_| Bin::default()).collect(),
            nonempty: [0; WORDS],
            words: 0,
            len: 0,
            changes: 0,
        }
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
            self.words |= 1 << (c / 64);
            self.len += 1;
            self.changes += 1;
        }
        added
    }

    /// Removes a free block; `false` if it was not there.
    pub(super) fn remove(&mut self, key: &Key) -> bool {
        let c = class_of(key.0);
        let removed = self.bins[c].remove(key);
        if removed {
            self.len -= 1;
            self.changes += 1;
            if self.bins[c].is_empty() {
                self.nonempty[c / 64] &= !(1 << (c % 64));
                if self.nonempty[c / 64] == 0 {
                    self.words &= !(1 << (c / 64));
                }
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

    /// Inserts and removals so far: the same count, the same blocks.
    pub(super) fn changes(&self) -> u64 {
        self.changes
    }

    /// The first non-empty class after `c`.
    fn next_nonempty(&self, c: usize) -> Option<usize> {
        let start = c + 1;
        let w = start / 64;
        if w >= WORDS {
            return None;
        }
        let bits = self.nonempty[w] & (!0u64 << (start % 64));
        if bits != 0 {
            return Some(w * 64 + bits.trailing_zeros() as usize);
        }
        // The next word with a class in it (`w + 1 < 64`: WORDS < 64).
        let later = self.words & (!0u64 << (w + 1));
        if later == 0 {
            return None;
        }
        let w = later.trailing_zeros() as usize;
        Some(w * 64 + self.nonempty[w].trailing_zeros() as usize)
    }

    /// The smallest block of at least `size` bytes, ties to the lowest one.
    pub(super) fn best_fit(&self, size: usize) -> Option<Key> {
        let c = class_of(size);
        if let Some(&k) = self.bins[c].first_at_least(size) {
            return Some(k);
        }
        let next = self.next_nonempty(c)?;
        self.bins[next].first().copied()
    }

    /// The smallest block of at least `size` bytes other than `skip`,
    /// ties to the lowest address: [`best_fit`](Self::best_fit) that
    /// passes over one block. At most two keys of a bin are looked at, and
    /// the bitmap is read from `size`'s class on, as far as the first
    /// non-empty class past it (no iterator over the bins).
    pub(super) fn best_fit_except(&self, size: usize, skip: Option<Key>) -> Option<Key> {
        let c = class_of(size);
        let mut found = self.bins[c].first_at_least(size).copied();
        let mut class = c;
        loop {
            match found {
                Some(k) if Some(k) == skip => found = self.bins[class].first_after(&k).copied(),
                Some(k) => return Some(k),
                None => {
                    class = self.next_nonempty(class)?;
                    found = self.bins[class].first().copied();
                }
            }
        }
    }

    /// Every block of at least `size` bytes, in `(size, addr)` order.
    pub(super) fn at_least(&self, size: usize) -> impl Iterator<Item = &Key> + '_ {
        let c = class_of(size);
        let first = self.bins[c].at_least(size);
        let rest = std::iter::successors(self.next_nonempty(c), move |&b| self.next_nonempty(b))
            .flat_map(move |b| self.bins[b].at_least(0));
        first.chain(rest)
    }

    /// The largest free block.
    pub(super) fn last(&self) -> Option<&Key> {
        if self.words == 0 {
            return None;
        }
        let w = 63 - self.words.leading_zeros() as usize;
        let c = w * 64 + 63 - self.nonempty[w].leading_zeros() as usize;
        self.bins[c].last()
    }

    /// The last non-empty class before `c` (`CLASSES`: the last of all).
    fn prev_nonempty(&self, c: usize) -> Option<usize> {
        let end = c.checked_sub(1)?;
        let w = end / 64;
        // Classes `w * 64 ..= end` of word `w` (`end % 64 < 64`).
        let bits = self.nonempty[w] & (!0u64 >> (63 - end % 64));
        if bits != 0 {
            return Some(w * 64 + 63 - bits.leading_zeros() as usize);
        }
        // The previous word with a class in it.
        let earlier = self.words & ((1u64 << w) - 1);
        if earlier == 0 {
            return None;
        }
        let w = 63 - earlier.leading_zeros() as usize;
        Some(w * 64 + 63 - self.nonempty[w].leading_zeros() as usize)
    }

    /// Every free block, largest first (ties: the highest address first).
    /// The bitmap leads from one non-empty class to the next, so a look
    /// at the few largest blocks reads no empty class.
    pub(super) fn largest_first(&self) -> impl Iterator<Item = &Key> + '_ {
        let classes = std::iter::successors(self.prev_nonempty(CLASSES), move |&c| self.prev_nonempty(c));
        classes.flat_map(move |c| {
            let bin = &self.bins[c];
            let (small, large) = match bin {
                Bin::Small(v) => (Some(v.iter().rev()), None),
                Bin::Large(set) => (None, Some(set.iter().rev())),
            };
            small.into_iter().flatten().chain(large.into_iter().flatten())
        })
    }

    /// Every free block, in `(size, addr)` order.
    pub(super) fn iter(&self) -> impl Iterator<Item = &Key> + '_ {
        self.at_least(0)
    }
}

#[cfg(test)]
mod tests;
