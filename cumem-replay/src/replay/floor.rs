//! The page floor of a trace: what exact best fit over one growing
//! address range needs in physical memory, with and without giving back
//! pages that lie wholly in free space.
//!
//! Every allocation of the trace is placed by cumem's own [`BestFit`]
//! (smallest fitting free block, ties to the lowest address) in one range
//! that never runs out. Two figures follow, each a peak over the trace:
//! - `top`: the highest end any block reached, rounded up to a page: the
//!   memory of a pool that maps pages as the range grows and never unmaps
//!   them;
//! - `touched`: the number of pages that intersect a live block, times the
//!   page size: the floor of a pool that unmaps every page lying wholly in
//!   free space (a page partly used can't be given back).
//!
//! Divided by the trace's peak live bytes they are the ratios a replay's
//! "peak reserved / peak live" compares with.

use cumem::pool::{round_size, BestFit, StreamTag, BLOCK_ALIGN};
use cumem::upstream::Chunk;

use crate::trace::{Op, Trace};

/// The page floor of a trace (see the module docs), in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct PageFloor {
    /// The page size the figures count in.
    pub page: usize,
    /// The peak highest end of a block, rounded up to a page.
    pub top: usize,
    /// The peak bytes of pages intersecting a live block.
    pub touched: usize,
}

/// Where the simulated range starts (any page-aligned address will do).
const BASE: usize = 1 << 40;
/// The simulated range's length: larger than any trace's footprint.
const SPAN: usize = 1 << 46;

/// Places `trace` by exact best fit over one range and measures its page
/// floor with pages of `page` bytes (a multiple of 256). Returns `None`
/// when an allocation could not be placed (a size beyond the range).
pub fn page_floor(trace: &Trace, page: usize) -> Option<PageFloor> {
    assert!(page >= BLOCK_ALIGN && page % BLOCK_ALIGN == 0, "page size {page} is not a multiple of 256");
    let mut fit = BestFit::new();
    fit.add_chunk(Chunk { addr: BASE, size: SPAN });
    let mut addrs = vec![0usize; trace.slots];
    // Live blocks per page; pages are counted from BASE.
    let mut users: Vec<u32> = Vec::new();
    let (mut touched, mut peak_touched, mut top) = (0usize, 0usize, 0usize);
    for op in &trace.ops {
        match *op {
            Op::Allocate { slot, size } => {
                let a = fit.allocate(round_size(size)?, BLOCK_ALIGN, size)?;
                addrs[slot as usize] = a.addr;
                let (first, last) = pages_of(a.addr, a.size, page);
                top = top.max((last + 1) * page);
                if users.len() <= last {
                    users.resize(last + 1, 0);
                }
                for u in &mut users[first..=last] {
                    touched += usize::from(*u == 0);
                    *u += 1;
                }
                peak_touched = peak_touched.max(touched);
            }
            Op::Free { slot } => {
                let addr = addrs[slot as usize];
                let freed = fit.free(addr, StreamTag::NONE).ok()?;
                let (first, last) = pages_of(addr, freed.size, page);
                for u in &mut users[first..=last] {
                    *u -= 1;
                    touched -= usize::from(*u == 0);
                }
            }
        }
    }
    Some(PageFloor { page, top, touched: peak_touched * page })
}

/// The first and last page (from [`BASE`]) `[addr, addr + size)` touches.
fn pages_of(addr: usize, size: usize, page: usize) -> (usize, usize) {
    ((addr - BASE) / page, (addr - BASE + size - 1) / page)
}

#[cfg(test)]
mod tests;
