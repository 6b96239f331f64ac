//! The placement algorithm of the arena: requests with lifetimes, placed
//! by greedy-by-size over intervals, all or nothing. No memory, no CUDA.

use std::fmt;
use std::ops::RangeInclusive;

use crate::error::{Error, PoolKind, Result};
use crate::manager::human_bytes;
use crate::upstream::BLOCK_ALIGN;

/// The steps during which a request's memory is in use, both ends
/// included. Two requests whose lifetimes overlap never share memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Lifetime {
    first: usize,
    last: usize,
}

impl Lifetime {
    /// Every step: the lifetime of requests made without one.
    pub(crate) const WHOLE: Lifetime = Lifetime { first: 0, last: usize::MAX };

    /// The steps `steps`.
    ///
    /// # Errors
    /// [`Error::InvalidState`] for an empty range (`last < first`).
    pub(crate) fn new(steps: RangeInclusive<usize>) -> Result<Self> {
        let (first, last) = steps.into_inner();
        if last < first {
            return Err(Error::InvalidState(format!(
                "the lifetime {first}..={last} is empty: a request's last step can't come before its first"
            )));
        }
        Ok(Lifetime { first, last })
    }

    /// Whether some step is in both lifetimes.
    pub(crate) fn overlaps(&self, other: &Lifetime) -> bool {
        self.first <= other.last && other.first <= self.last
    }
}

/// Which of the arena's two blocks a request lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Memory {
    /// The pinned host block.
    Host = 0,
    /// The device block.
    Device = 1,
}

impl Memory {
    fn kind(self) -> PoolKind {
        match self {
            Memory::Host => PoolKind::Pinned,
            Memory::Device => PoolKind::Device,
        }
    }
}

/// One request: its size, lifetime and, once satisfied, its offset.
#[derive(Debug, Clone)]
struct Request {
    bytes: usize,
    lifetime: Lifetime,
    offset: Option<usize>,
}

impl Request {
    /// The bytes it occupies for placement: its size rounded up to
    /// [`BLOCK_ALIGN`], so the next request may start at its end.
    fn extent(&self) -> usize {
        round_up(self.bytes)
    }
}

fn round_up(bytes: usize) -> usize {
    // Requests are at most the block's capacity, itself a pool block, so
    // this can't overflow (`request` checks).
    bytes.div_ceil(BLOCK_ALIGN) * BLOCK_ALIGN
}

/// The requests of one block.
///
/// Invariants: every index in `pending` names a request without an offset,
/// and every request without an offset is in `pending`; assigned requests
/// are 256-aligned, end within `capacity`, and no two whose lifetimes
/// overlap share a byte; `end` is the largest `offset + bytes` of the
/// assigned requests.
#[derive(Debug, Clone)]
struct Block {
    capacity: usize,
    requests: Vec<Request>,
    pending: Vec<usize>,
    end: usize,
}

impl Block {
    fn new(capacity: usize) -> Self {
        Block { capacity, requests: Vec::new(), pending: Vec::new(), end: 0 }
    }

    /// Places every pending request without changing anything; returns the
    /// offsets (in the order of `pending`) and the block's new end.
    ///
    /// Greedy by size over intervals (as TFLite's arena planner does): the
    /// largest request first (ties: the earlier first step, then the
    /// earlier request), each at the lowest 256-aligned offset where it
    /// overlaps no placed request whose lifetime overlaps its own. Requests
    /// assigned by earlier `satisfy` calls stay where they are; new ones
    /// fill the gaps around them.
    fn place(&self) -> (Vec<usize>, usize) {
        let mut order: Vec<usize> = (0..self.pending.len()).collect();
        order.sort_by(|&a, &b| {
            let (ra, rb) = (&self.requests[self.pending[a]], &self.requests[self.pending[b]]);
            rb.bytes.cmp(&ra.bytes).then(ra.lifetime.first.cmp(&rb.lifetime.first)).then(a.cmp(&b))
        });
        // (lifetime, start, end of extent) of everything placed so far.
        let mut placed: Vec<(Lifetime, usize, usize)> =
            self.requests.iter().filter_map(|r| r.offset.map(|o| (r.lifetime, o, o + r.extent()))).collect();
        let mut offsets = vec![0; self.pending.len()];
        let mut end = self.end;
        let mut conflicts = Vec::new();
        for i in order {
            let r = &self.requests[self.pending[i]];
            conflicts.clear();
            conflicts.extend(placed.iter().filter(|p| p.0.overlaps(&r.lifetime)).map(|p| (p.1, p.2)));
            conflicts.sort_unstable();
            let extent = r.extent();
            let mut offset = 0;
            for &(start, stop) in &conflicts {
                if offset + extent <= start {
                    break;
                }
                offset = offset.max(stop);
            }
            offsets[i] = offset;
            end = end.max(offset + r.bytes);
            placed.push((r.lifetime, offset, offset + extent));
        }
        (offsets, end)
    }

    fn apply(&mut self, offsets: Vec<usize>, end: usize) {
        for (i, offset) in self.pending.drain(..).zip(offsets) {
            self.requests[i].offset = Some(offset);
        }
        self.end = end;
    }

    fn report(&self) -> BlockReport {
        let assigned = self.requests.iter().filter(|r| r.offset.is_some());
        BlockReport {
            requests: self.requests.len() - self.pending.len(),
            pending: self.pending.len(),
            requested_bytes: assigned.map(|r| r.bytes).sum(),
            planned_bytes: self.end,
            capacity: self.capacity,
        }
    }
}

/// Offsets for every pending request of both blocks, not yet applied.
#[derive(Debug)]
pub(crate) struct Placement {
    blocks: [(Vec<usize>, usize); 2],
}

impl Placement {
    /// Where the plan in `memory` would end.
    pub(crate) fn end(&self, memory: Memory) -> usize {
        self.blocks[memory as usize].1
    }
}

/// The requests of both blocks, and their placement.
#[derive(Debug, Clone)]
pub(crate) struct Planner {
    blocks: [Block; 2],
}

impl Planner {
    /// A planner for blocks of `host` (host) and `device` (device) bytes.
    pub(crate) fn new(host: usize, device: usize) -> Self {
        Planner { blocks: [Block::new(host), Block::new(device)] }
    }

    fn block(&self, memory: Memory) -> &Block {
        &self.blocks[memory as usize]
    }

    /// Registers a pending request of `bytes` in `memory`; returns its index.
    ///
    /// # Errors
    /// [`Error::InvalidSize`] for 0 bytes; [`Error::ArenaTooSmall`] when the
    /// request alone is larger than the block (it could never be placed).
    pub(crate) fn request(&mut self, memory: Memory, bytes: usize, lifetime: Lifetime) -> Result<usize> {
        if bytes == 0 {
            return Err(Error::InvalidSize { size: 0, reason: "an arena request must be at least one byte" });
        }
        let block = &mut self.blocks[memory as usize];
        if bytes > block.capacity {
            return Err(Error::ArenaTooSmall { memory: memory.kind(), desired: bytes, available: block.capacity });
        }
        block.requests.push(Request { bytes, lifetime, offset: None });
        block.pending.push(block.requests.len() - 1);
        Ok(block.requests.len() - 1)
    }

    /// Places every pending request of both blocks, changing nothing:
    /// [`apply`](Self::apply) makes the placement the plan's.
    ///
    /// # Errors
    /// [`Error::ArenaTooSmall`] naming the first block (host, then device)
    /// whose plan would end past its capacity.
    pub(crate) fn plan(&self) -> Result<Placement> {
        let blocks = [self.blocks[0].place(), self.blocks[1].place()];
        for (memory, block, (_, end)) in
            [(Memory::Host, &self.blocks[0], &blocks[0]), (Memory::Device, &self.blocks[1], &blocks[1])]
        {
            if *end > block.capacity {
                return Err(Error::ArenaTooSmall { memory: memory.kind(), desired: *end, available: block.capacity });
            }
        }
        Ok(Placement { blocks })
    }

    /// Assigns the offsets [`plan`](Self::plan) made, with no request since.
    pub(crate) fn apply(&mut self, placement: Placement) {
        for (block, (offsets, end)) in self.blocks.iter_mut().zip(placement.blocks) {
            debug_assert_eq!(offsets.len(), block.pending.len(), "requests were added after plan()");
            block.apply(offsets, end);
        }
    }

    /// [`plan`](Self::plan) then [`apply`](Self::apply).
    #[cfg(test)]
    fn satisfy(&mut self) -> Result<()> {
        let placement = self.plan()?;
        self.apply(placement);
        Ok(())
    }

    /// The offset of request `index` in `memory`, once assigned.
    pub(crate) fn offset(&self, memory: Memory, index: usize) -> Option<usize> {
        self.block(memory).requests.get(index).and_then(|r| r.offset)
    }

    /// How many requests wait for `satisfy`.
    pub(crate) fn pending(&self) -> usize {
        self.blocks.iter().map(|b| b.pending.len()).sum()
    }

    /// The plan so far.
    pub(crate) fn report(&self) -> PlanReport {
        PlanReport { host: self.blocks[0].report(), device: self.blocks[1].report() }
    }

    /// Forgets every request.
    pub(crate) fn clear(&mut self) {
        for b in &mut self.blocks {
            *b = Block::new(b.capacity);
        }
    }

    /// Checks the invariants (tests).
    #[cfg(test)]
    pub(crate) fn check_invariants(&self) {
        for b in &self.blocks {
            let assigned: Vec<&Request> = b.requests.iter().filter(|r| r.offset.is_some()).collect();
            assert_eq!(assigned.len() + b.pending.len(), b.requests.len());
            assert!(b.pending.iter().all(|&i| b.requests[i].offset.is_none()));
            let mut end = 0;
            for (i, r) in assigned.iter().enumerate() {
                let o = r.offset.unwrap();
                assert_eq!(o % BLOCK_ALIGN, 0);
                assert!(o + r.bytes <= b.capacity);
                end = end.max(o + r.bytes);
                for s in &assigned[i + 1..] {
                    let so = s.offset.unwrap();
                    if r.lifetime.overlaps(&s.lifetime) {
                        assert!(o + r.bytes <= so || so + s.bytes <= o, "overlapping lifetimes share memory");
                    }
                }
            }
            assert_eq!(end, b.end);
        }
    }
}

/// One block's part of a [`PlanReport`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BlockReport {
    /// Requests assigned an offset.
    pub requests: usize,
    /// Requests waiting for `satisfy`.
    pub pending: usize,
    /// The sum of the assigned requests' sizes: what they would take if
    /// none shared memory (alignment padding not counted).
    pub requested_bytes: usize,
    /// The bytes the plan uses: the end of its last-ending request.
    pub planned_bytes: usize,
    /// The block's size.
    pub capacity: usize,
}

impl BlockReport {
    /// The bytes sharing saves: `requested_bytes - planned_bytes`, at least 0.
    pub fn saved_bytes(&self) -> usize {
        self.requested_bytes.saturating_sub(self.planned_bytes)
    }
}

impl fmt::Display for BlockReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} request(s), {} requested, {} planned",
            self.requests,
            human_bytes(self.requested_bytes),
            human_bytes(self.planned_bytes)
        )?;
        if self.requested_bytes > 0 {
            write!(f, " ({:.1}% of the sum)", 100.0 * self.planned_bytes as f64 / self.requested_bytes as f64)?;
        }
        write!(f, ", block {}", human_bytes(self.capacity))?;
        if self.pending > 0 {
            write!(f, ", {} pending", self.pending)?;
        }
        Ok(())
    }
}

/// What an [`ArenaPlan`](super::ArenaPlan) assigned: per block, the
/// requests, the sum of their sizes, and the bytes the plan actually needs
/// once requests with disjoint lifetimes share memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PlanReport {
    /// The pinned host block.
    pub host: BlockReport,
    /// The device block.
    pub device: BlockReport,
}

impl fmt::Display for PlanReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "host:   {}", self.host)?;
        write!(f, "device: {}", self.device)
    }
}

#[cfg(test)]
mod tests;
