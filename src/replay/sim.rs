//! A simulated device upstream for replays: address ranges only, no memory.
//!
//! The pool never reads or writes the memory it manages, so a replay can run
//! it over addresses that are never mapped. [`AddressRange`] hands out
//! chunks from one ascending range with the device's 2 MiB granularity and
//! grows the topmost chunk in place, as CUDA virtual memory (expandable
//! segments) would. It shows the fragmentation an expandable device pool
//! reaches on a trace, on any machine.

use std::time::Instant;

use super::Measurement;
use crate::error::Result;
use crate::manager::Config;
use crate::pool::{Pool, StreamTag, BLOCK_ALIGN};
use crate::sync::{lock, Mutex};
use crate::trace::{Op, Trace};
use crate::upstream::{Chunk, Upstream};

/// The granularity of device memory (large pages).
const GRANULARITY: usize = 2 << 20;

/// Where the simulated range starts (nonzero and aligned).
const BASE: usize = 1 << 40;

/// A simulated address range: chunks are carved from the top; the topmost
/// chunk can grow and shrink in place. Separate chunks are one granule
/// apart, so they never touch.
#[derive(Debug)]
pub struct AddressRange {
    top: Mutex<usize>,
}

impl Default for AddressRange {
    fn default() -> Self {
        AddressRange::new()
    }
}

impl AddressRange {
    /// An empty range.
    pub fn new() -> Self {
        AddressRange { top: Mutex::new(BASE) }
    }
}

impl Upstream for AddressRange {
    fn allocate_chunk(&self, size: usize) -> Result<Chunk> {
        let mut top = lock(&self.top);
        let addr = *top + GRANULARITY;
        *top = addr + size;
        Ok(Chunk { addr, size })
    }

    fn deallocate_chunk(&self, chunk: Chunk) -> Result<()> {
        let mut top = lock(&self.top);
        if chunk.end() == *top {
            *top = chunk.addr - GRANULARITY;
        }
        Ok(())
    }

    fn can_extend(&self) -> bool {
        true
    }

    fn try_extend(&self, chunk: Chunk, extra: usize) -> Result<bool> {
        let mut top = lock(&self.top);
        if chunk.end() != *top {
            return Ok(false);
        }
        *top += extra;
        Ok(true)
    }

    fn try_shrink(&self, chunk: Chunk, amount: usize) -> Result<bool> {
        let mut top = lock(&self.top);
        if chunk.end() != *top || amount > chunk.size {
            return Ok(false);
        }
        *top -= amount;
        Ok(true)
    }

    fn granularity(&self) -> usize {
        GRANULARITY
    }

    fn name(&self) -> &'static str {
        "simulated address range"
    }

    fn host_accessible(&self) -> bool {
        false
    }
}

/// Replays `trace` through a fresh [`Pool`] over an [`AddressRange`], with
/// the device pool settings of `config` (`min_chunk`, `expandable`,
/// `device_pool_size`, `max_device_pool_size`).
pub(super) fn replay_simulated(trace: &Trace, config: &Config, warm: bool) -> Result<Measurement> {
    let pool = Pool::new(AddressRange::new(), config.device_pool_config());
    let mut addrs = vec![0usize; trace.slots];
    let pass = |addrs: &mut Vec<usize>| {
        let mut failures = 0;
        for op in &trace.ops {
            match *op {
                Op::Allocate { slot, size } => match pool.allocate(size, BLOCK_ALIGN) {
                    Ok(a) => addrs[slot as usize] = a.addr,
                    Err(_) => failures += 1,
                },
                Op::Free { slot } => {
                    let a = std::mem::take(&mut addrs[slot as usize]);
                    if a != 0 {
                        failures += usize::from(pool.deallocate(a, StreamTag::NONE).is_err());
                    }
                }
            }
        }
        failures
    };
    if warm {
        // Once untimed, then free what is left: the timed pass finds the
        // pool holding its memory.
        pass(&mut addrs);
        for a in addrs.iter_mut().filter(|a| **a != 0) {
            pool.deallocate(std::mem::take(a), StreamTag::NONE)?;
        }
    }
    let start = Instant::now();
    let failures = pass(&mut addrs);
    let elapsed_ns = start.elapsed().as_nanos() as u64;
    let stats = pool.stats();
    Ok(Measurement { elapsed_ns, peak_live: stats.peak_requested, peak_reserved: Some(stats.peak_reserved), failures })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_top_chunk_grows_and_shrinks_in_place() {
        let r = AddressRange::new();
        let a = r.allocate_chunk(GRANULARITY).unwrap();
        assert!(r.try_extend(a, GRANULARITY).unwrap());
        let a = Chunk { addr: a.addr, size: 2 * GRANULARITY };
        let b = r.allocate_chunk(GRANULARITY).unwrap();
        assert!(b.addr > a.end(), "chunks never touch");
        assert!(!r.try_extend(a, GRANULARITY).unwrap(), "only the top chunk grows");
        assert!(r.try_shrink(b, GRANULARITY).unwrap());
        assert!(!r.try_shrink(a, GRANULARITY).unwrap());
    }
}
