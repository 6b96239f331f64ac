//! The live blocks by address: an open-addressing table from a block's
//! start to its slot, for the two look-ups every allocation and free make.
//!
//! # Implementation details
//!
//! - Block addresses are multiples of 256, so `usize::MAX` never is one:
//!   it marks an empty entry.
//! - The hash is Fibonacci hashing of the address over 256 (one multiply
//!   and one shift), and collisions probe the next entries (linear
//!   probing). Blocks of a pool are spread over its chunks, and
//!   neighbouring blocks land on neighbouring entries only when their
//!   addresses differ in the high bits the multiply folds in.
//! - The table is at most half full: it doubles before an insert would
//!   pass that, so a probe ends at an empty entry after a few steps.
//! - A removal shifts the entries after it back (backward-shift deletion):
//!   no tombstones, so a table that churns never fills with them.

/// An empty entry: no block starts at an odd address.
const EMPTY: usize = usize::MAX;

/// The fewest entries a table that holds anything has.
const MIN_ENTRIES: usize = 16;

/// Live blocks' starts and slots (see the module docs).
#[derive(Debug, Default)]
pub(super) struct LiveMap {
    /// `(start, slot)`; `start == EMPTY` when the entry is empty. Its
    /// length is 0 or a power of two.
    entries: Vec<(usize, u32)>,
    len: usize,
}

impl LiveMap {
    /// How many blocks are live.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// The entry where a probe for `addr` starts.
    #[inline]
    fn home(&self, addr: usize) -> usize {
        let bits = self.entries.len().trailing_zeros();
        let h = ((addr >> 8) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        // `bits` is at least 4: the shift is less than 64.
        (h >> (64 - bits)) as usize
    }

    /// The index of `addr`'s entry, if it is in the table.
    #[inline]
    fn find(&self, addr: usize) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        let mask = self.entries.len() - 1;
        let mut i = self.home(addr);
        loop {
            let (key, _) = self.entries[i];
            if key == addr {
                return Some(i);
            }
            if key == EMPTY {
                return None;
            }
            i = (i + 1) & mask;
        }
    }

    /// The slot of the live block starting at `addr`.
    #[inline]
    pub(super) fn get(&self, addr: usize) -> Option<u32> {
        self.find(addr).map(|i| self.entries[i].1)
    }

    /// Whether a live block starts at `addr`.
    pub(super) fn contains(&self, addr: usize) -> bool {
        self.find(addr).is_some()
    }

    /// Records the live block at `addr` (a multiple of 256) in `slot`;
    /// replaces the slot if `addr` was recorded already.
    #[inline]
    pub(super) fn insert(&mut self, addr: usize, slot: u32) {
        debug_assert!(addr != EMPTY, "block starts are multiples of 256");
        if (self.len + 1) * 2 > self.entries.len() {
            self.grow();
        }
        let mask = self.entries.len() - 1;
        let mut i = self.home(addr);
        loop {
            let key = self.entries[i].0;
            if key == EMPTY {
                self.entries[i] = (addr, slot);
                self.len += 1;
                return;
            }
            if key == addr {
                self.entries[i].1 = slot;
                return;
            }
            i = (i + 1) & mask;
        }
    }

    /// Forgets the live block at `addr`; its slot, if it was recorded.
    #[inline]
    pub(super) fn remove(&mut self, addr: usize) -> Option<u32> {
        let mut hole = self.find(addr)?;
        let slot = self.entries[hole].1;
        self.len -= 1;
        // Backward shift: each later entry of the run that may sit at the
        // hole (its probe starts at or before the hole, cyclically) moves
        // into it, until the run ends.
        let mask = self.entries.len() - 1;
        let mut i = hole;
        loop {
            i = (i + 1) & mask;
            let (key, _) = self.entries[i];
            if key == EMPTY {
                break;
            }
            let home = self.home(key);
            // Distance from the entry's home to the hole, and to where it
            // sits now: it moves only if the hole is on its probe path.
            if (hole.wrapping_sub(home) & mask) < (i.wrapping_sub(home) & mask) {
                self.entries[hole] = self.entries[i];
                hole = i;
            }
        }
        self.entries[hole] = (EMPTY, 0);
        Some(slot)
    }

    /// Doubles the table (or makes it) and puts every entry back.
    #[cold]
    fn grow(&mut self) {
        let entries = (self.entries.len() * 2).max(MIN_ENTRIES);
        let old = std::mem::replace(&mut self.entries, vec![(EMPTY, 0); entries]);
        self.len = 0;
        for (key, slot) in old {
            if key != EMPTY {
                self.insert(key, slot);
            }
        }
    }
}

#[cfg(test)]
mod tests;
