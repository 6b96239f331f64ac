//! The copies of sleep and wake, overlapped with the page moves: copies go
//! out in batches of about [`BATCH`] bytes on two streams per device, and
//! an event after each batch tells when its blocks' pages may go (sleep);
//! on wake, the pages of the next batch are mapped while the copies of the
//! one before run.

use cudarc::driver::CudaEvent;

use super::Saved;
use crate::cuda::{driver_err, Stream};
use crate::device::DeviceAllocator;
use crate::error::Result;
use crate::manager::MemoryManager;

/// The bytes of one batch of copies.
pub(super) const BATCH: usize = 256 << 20;

/// Which way a copy goes.
#[derive(Debug, Clone, Copy)]
pub(super) enum Direction {
    /// Device to pinned host memory (sleep).
    Out,
    /// Pinned host memory to device (wake).
    In,
}

/// The point the copies queued so far reach (`None`: done: host fallback).
pub(super) struct Mark(Option<[CudaEvent; 2]>);

impl Mark {
    /// Waits until the copies queued before the mark are done.
    pub(super) fn wait(&self) -> Result<()> {
        for e in self.0.iter().flatten() {
            e.synchronize().map_err(driver_err("cuEventSynchronize"))?;
        }
        Ok(())
    }
}

/// Two copy streams of one device, used in turn.
struct Lanes {
    ordinal: usize,
    streams: [Stream; 2],
    next: usize,
}

/// The lanes of every device a sleep or a wake copies on.
#[derive(Default)]
pub(super) struct LaneSet(Vec<Lanes>);

impl LaneSet {
    fn of(&mut self, d: &DeviceAllocator) -> Result<&mut Lanes> {
        let i = match self.0.iter().position(|l| l.ordinal == d.ordinal()) {
            Some(i) => i,
            None => {
                self.0.push(Lanes { ordinal: d.ordinal(), streams: [stream(d)?, stream(d)?], next: 0 });
                self.0.len() - 1
            }
        };
        Ok(&mut self.0[i])
    }

    /// Queues `batch`'s copies between device `d` and `host`; marks their end.
    ///
    /// # Safety
    /// Every `host + offset .. + len` lies in a pinned block nothing else
    /// uses, and every `addr .. + len` in a live block of a tag that
    /// sleeps or wakes (no allocation reaches it, the device was
    /// synchronised); both stay so until the mark is waited for or the set
    /// synchronised.
    pub(super) unsafe fn copy(
        &mut self,
        mm: &MemoryManager,
        d: &DeviceAllocator,
        dir: Direction,
        host: usize,
        batch: &[Saved],
    ) -> Result<Mark> {
        let lanes = self.of(d)?;
        for s in batch {
            let stream = &lanes.streams[lanes.next % 2];
            lanes.next += 1;
            let at = host + s.offset;
            // SAFETY: the caller's promise, for this block.
            unsafe {
                match dir {
                    Direction::Out => mm.copy_to_host_async(at as *mut u8, s.addr as u64, s.len, stream)?,
                    Direction::In => mm.copy_to_device_async(s.addr as u64, at as *const u8, s.len, stream)?,
                }
            }
        }
        let events = match (lanes.streams[0].cudarc(), lanes.streams[1].cudarc()) {
            (Some(a), Some(b)) => Some([
                a.record_event(None).map_err(driver_err("cuEventRecord"))?,
                b.record_event(None).map_err(driver_err("cuEventRecord"))?,
            ]),
            _ => None,
        };
        Ok(Mark(events))
    }

    /// Waits for every copy queued.
    pub(super) fn synchronize(&self) -> Result<()> {
        for l in &self.0 {
            for s in &l.streams {
                s.synchronize()?;
            }
        }
        Ok(())
    }
}

/// A stream for the copies on `d` (a host queue on the fallback).
fn stream(d: &DeviceAllocator) -> Result<Stream> {
    match d.context() {
        Some(ctx) => Ok(Stream::from_cudarc(ctx.new_stream().map_err(driver_err("cuStreamCreate"))?)),
        None => Ok(Stream::host()),
    }
}

/// `saved` (in address order) cut into batches of about [`BATCH`] bytes.
pub(super) fn batches(saved: &[Saved]) -> Vec<&[Saved]> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, s) in saved.iter().enumerate() {
        bytes += s.len;
        if bytes >= BATCH {
            out.push(&saved[start..=i]);
            (start, bytes) = (i + 1, 0);
        }
    }
    if start < saved.len() {
        out.push(&saved[start..]);
    }
    out
}

#[cfg(test)]
mod tests;
