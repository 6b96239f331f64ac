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
///
/// Unless `one_stream`, each of the trace's streams frees with a tag of its
/// own (stream index + 1, with a sequence number per free), and an
/// allocation handed a block last freed on another stream counts as a
/// stream wait (what the device pool would order with an event).
pub(super) fn replay_simulated(trace: &Trace, config: &Config, warm: bool, one_stream: bool) -> Result<Measurement> {
    let pool = Pool::new(AddressRange::new(), config.device_pool_config());
    let mut addrs = vec![0usize; trace.slots];
    let seq = std::cell::Cell::new(0u64);
    let stream_of = |i: usize| if one_stream { 1 } else { u64::from(trace.op_streams[i]) + 1 };
    let pass = |addrs: &mut Vec<usize>| {
        let (mut failures, mut waits) = (0, 0u64);
        for (i, op) in trace.ops.iter().enumerate() {
            let stream = stream_of(i);
            match *op {
                Op::Allocate { slot, size } => match pool.allocate_for(size, BLOCK_ALIGN, stream) {
                    Ok(a) => {
                        addrs[slot as usize] = a.addr;
                        waits += u64::from(a.tag != StreamTag::NONE && a.tag.stream != stream);
                    }
                    Err(_) => failures += 1,
                },
                Op::Free { slot } => {
                    let a = std::mem::take(&mut addrs[slot as usize]);
                    if a != 0 {
                        seq.set(seq.get() + 1);
                        let tag = StreamTag { stream, seq: seq.get() };
                        failures += usize::from(pool.deallocate(a, tag).is_err());
                    }
                }
            }
        }
        (failures, waits)
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
    let (failures, stream_waits) = pass(&mut addrs);
    let elapsed_ns = start.elapsed().as_nanos() as u64;
    let stats = pool.stats();
    Ok(Measurement {
        elapsed_ns,
        peak_live: stats.peak_requested,
        peak_reserved: Some(stats.peak_reserved),
        failures,
        stream_waits,
        stream_wait_ns: 0,
    })
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
