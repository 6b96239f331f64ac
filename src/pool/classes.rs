//! Size classes of the thread caches, and a cheap hash of block addresses.
//!
//! Classes: exact 256 B steps up to 4 KiB (16 classes), then 16 classes per
//! doubling up to [`MAX_CACHED_BLOCK`] (224 more), so a class is at most
//! 1/16 (6.25 %) larger than the request rounded to 256 B.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::upstream::BLOCK_ALIGN;

/// The largest block size (after class rounding) the thread caches hold.
pub const MAX_CACHED_BLOCK: usize = 64 << 20;
/// Classes in exact 256 B steps end here.
pub(super) const EXACT_LIMIT: usize = 4096;
/// Classes per doubling above [`EXACT_LIMIT`].
const STEPS: usize = 16;
/// Number of classes: 16 exact ones, then 16 per doubling up to 64 MiB.
pub(super) const CLASSES: usize = EXACT_LIMIT / BLOCK_ALIGN + 14 * STEPS;

/// The class of a request already rounded to 256 B: `(index, class size)`,
/// or `None` when such blocks aren't cached.
pub(super) fn class_of(rounded: usize) -> Option<(usize, usize)> {
    debug_assert!(rounded % BLOCK_ALIGN == 0 && rounded > 0);
    if rounded <= EXACT_LIMIT {
        return Some((rounded / BLOCK_ALIGN - 1, rounded));
    }
    if rounded > MAX_CACHED_BLOCK {
        return None;
    }
    // `rounded` lies in (2^p, 2^(p+1)], cut into STEPS classes.
    let p = (usize::BITS - 1 - (rounded - 1).leading_zeros()) as usize;
    let base = 1usize << p;
    let step = base / STEPS;
    let size = rounded.next_multiple_of(step);
    let k = (size - base) / step;
    Some((EXACT_LIMIT / BLOCK_ALIGN + (p - 12) * STEPS + k - 1, size))
}

/// A cheap hash for 256-aligned addresses.
#[derive(Default)]
pub(super) struct AddrHasher(u64);

impl Hasher for AddrHasher {
    fn finish(&self) -> u64 {
        self.0 ^ (self.0 >> 29)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_usize(&mut self, x: usize) {
        self.0 = ((x as u64) >> 8).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

pub(super) type AddrMap<V> = HashMap<usize, V, BuildHasherDefault<AddrHasher>>;

#[cfg(test)]
mod tests;
