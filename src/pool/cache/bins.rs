//! A thread cache's own bookkeeping: the blocks it lent out (to catch
//! frees of them), its bins of parked blocks by size class, and the
//! statistics difference it owes the shared pool.

use std::num::NonZeroU32;

use super::{AddrMap, CLASSES, EXACT_LIMIT, MAX_CACHED_BLOCK, NEIGHBOURS};
use crate::tag::StreamTag;
use crate::upstream::BLOCK_ALIGN;

/// A lent block held by a user. Lent blocks are at most
/// [`MAX_CACHED_BLOCK`] bytes, so every figure fits 32 bits, and the entry
/// (16 bytes, `Option` included) travels in registers.
#[derive(Debug, Clone, Copy)]
pub(super) struct LiveEntry {
    pub(super) size: NonZeroU32,
    /// The bin it goes to when freed; [`NO_BIN`](super::NO_BIN) when it can't be cached.
    pub(super) bin: u32,
    /// What the user asked for this time.
    pub(super) requested: u32,
    /// What the shared pool recorded when it lent the block.
    pub(super) pool_requested: u32,
}

const _: () = assert!(MAX_CACHED_BLOCK <= u32::MAX as usize);

impl LiveEntry {
    /// An entry for a lent block (`size`, `requested` and `pool_requested`
    /// at most [`MAX_CACHED_BLOCK`], `size` non-zero: pool blocks are).
    pub(super) fn new(size: usize, bin: u32, requested: usize, pool_requested: usize) -> LiveEntry {
        debug_assert!(size <= MAX_CACHED_BLOCK && requested <= size && pool_requested <= size);
        LiveEntry {
            size: NonZeroU32::new(size as u32).expect("pool blocks are never empty"),
            bin,
            requested: requested as u32,
            pool_requested: pool_requested as u32,
        }
    }

    pub(super) fn size(&self) -> usize {
        self.size.get() as usize
    }
}

/// A lent block parked in a bin.
#[derive(Debug, Clone, Copy)]
pub(super) struct CachedBlock {
    pub(super) addr: usize,
    pub(super) size: usize,
    /// Its own bin (a hit may come from a neighbouring one).
    pub(super) bin: u32,
    pub(super) pool_requested: usize,
    /// The stream whose queued work may still use it (as the pool's tags).
    pub(super) tag: StreamTag,
}

impl CachedBlock {
    /// Whether a request on stream `want` (0: no stream) may take this
    /// block without waiting: nothing is pending on it, or only work of
    /// `want` itself, which is ordered before the requester's.
    #[inline]
    pub(super) fn usable_by(&self, want: u64) -> bool {
        self.tag == StreamTag::NONE || (want != 0 && self.tag.stream == want)
    }
}

/// Blocks of a bin a hit looks at, from the newest, for one the request
/// can use (exact size, usable stream).
const SCAN: usize = 8;

/// The difference between what the shared pool counts (every lent block as
/// live, with the request it was lent for) and what users hold.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Delta {
    pub(super) in_use: isize,
    pub(super) requested: isize,
    pub(super) live: isize,
    pub(super) allocations: i64,
    pub(super) frees: i64,
}

impl Delta {
    pub(super) fn add(&mut self, o: Delta) {
        self.in_use += o.in_use;
        self.requested += o.requested;
        self.live += o.live;
        self.allocations += o.allocations;
        self.frees += o.frees;
    }
}

#[derive(Default)]
pub(super) struct Local {
    pub(super) live: AddrMap<LiveEntry>,
    pub(super) bins: Vec<Vec<CachedBlock>>,
    pub(super) cached_bytes: usize,
    /// Per bin, the fewest blocks it held since the last look
    /// ([`collect`](Local::collect)): its oldest blocks that many no hit
    /// took meanwhile.
    pub(super) low: Vec<u32>,
    /// Frees into the cache since the last look.
    pub(super) frees_since_look: u32,
    pub(super) delta: Delta,
    /// The pool shut down or was dropped: cache nothing any more.
    pub(super) closed: bool,
    /// The owning thread exited: cache nothing any more.
    pub(super) dead: bool,
}

impl Local {
    /// Takes whole bins out, in the order of `classes`, until at most
    /// `keep_bytes` stay cached; corrects the statistics as if the blocks
    /// were already back in the pool.
    pub(super) fn take(&mut self, classes: impl Iterator<Item = usize>, keep_bytes: usize, out: &mut Vec<CachedBlock>) {
        for c in classes {
            if self.cached_bytes <= keep_bytes {
                break;
            }
            let n = self.bins[c].len();
            self.take_oldest(c, n, out);
        }
    }

    /// Takes a block of bin `class` that a request of `size` bytes on
    /// stream `want` can use: of exactly `size` bytes when `exact`, of the
    /// class's size otherwise (every block of a class bin has it then).
    #[inline]
    pub(super) fn pop(&mut self, class: usize, size: usize, want: u64, exact: bool) -> Option<CachedBlock> {
        let bin = &mut self.bins[class];
        let last = bin.last()?;
        let b = if last.usable_by(want) && (!exact || last.size == size) {
            bin.pop()?
        } else {
            let i = bin.iter().rev().take(SCAN).position(|b| b.usable_by(want) && (!exact || b.size == size))?;
            bin.remove(bin.len() - 1 - i)
        };
        let left = bin.len() as u32;
        let low = &mut self.low[class];
        if left < *low {
            *low = left;
        }
        Some(b)
    }

    /// The look every [`LOOK_EVERY`](super::LOOK_EVERY) frees: of the
    /// blocks each bin held throughout since the last look (its oldest,
    /// which no hit took), three quarters go back to the pool, so a cache
    /// keeps what its thread reuses and lets the rest go within a few
    /// looks, whatever its byte budget.
    pub(super) fn collect(&mut self, out: &mut Vec<CachedBlock>) {
        for c in 0..self.bins.len() {
            let idle = (self.low[c] as usize).min(self.bins[c].len());
            let n = idle - idle / 4;
            if n > 0 {
                self.take_oldest(c, n, out);
            }
            self.low[c] = self.bins[c].len() as u32;
        }
        self.frees_since_look = 0;
    }

    /// On a miss in bin `class`: a block of the next [`NEIGHBOURS`] larger
    /// classes (at most 12.5 % larger), where classes are 1/16 of a
    /// doubling apart.
    #[cold]
    pub(super) fn pop_larger(&mut self, class: usize, want: u64) -> Option<CachedBlock> {
        if class < EXACT_LIMIT / BLOCK_ALIGN {
            return None;
        }
        (class + 1..(class + 1 + NEIGHBOURS).min(CLASSES)).find_map(|c| self.pop(c, 0, want, false))
    }

    /// Takes the oldest `n` blocks of bin `class` out (as [`Local::take`]).
    pub(super) fn take_oldest(&mut self, class: usize, n: usize, out: &mut Vec<CachedBlock>) {
        for i in 0..n {
            let b = self.bins[class][i];
            self.unpark(b, out);
        }
        self.bins[class].drain(..n);
        // They were the bin's oldest: among those no hit took, if any.
        self.low[class] = self.low[class].saturating_sub(n as u32);
    }

    /// A block leaves its bin for the pool: the statistics count it as the
    /// pool does (lent, live) until the pool frees it.
    pub(super) fn unpark(&mut self, b: CachedBlock, out: &mut Vec<CachedBlock>) {
        self.cached_bytes -= b.size;
        self.delta.add(Delta {
            in_use: b.size as isize,
            requested: b.pool_requested as isize,
            live: 1,
            allocations: 0,
            frees: -1,
        });
        out.push(b);
    }
}
