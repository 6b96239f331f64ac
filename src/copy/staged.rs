//! Copies between pageable host memory (a plain `&[T]` / `&mut [T]`) and
//! device memory through pinned staging blocks from the pinned pool.
//!
//! # Implementation details
//! The copy is cut into chunks. Each *lane* owns two staging blocks and two
//! events and handles every `lanes`-th chunk, double-buffered:
//!
//! ```text
//! to device:  host memcpy k -> stage[k%2] | DMA stage[k%2] -> device | record ev[k%2]
//!             (before reusing stage[b], wait for ev[b]: the DMA two chunks back)
//! to host:    DMA k -> stage[k%2], record ev[k%2]; wait ev[k%2], host memcpy
//!             stage -> host, then queue DMA k+2 into the freed block
//! ```
//!
//! so the host memcpy of one chunk overlaps the DMA of the next. Lane 0
//! runs on the calling thread, the others on helper threads kept for the
//! purpose (`workers.rs`): a single host memcpy thread can't keep up with
//! the DMA engine. All DMAs go to
//! the caller's stream, so they run after the work queued on it before the
//! call. The call returns once every chunk has arrived; the staging blocks
//! go back to the pinned pool only after their DMAs are known complete
//! (when that can't be established, they are leaked rather than reused).

use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::{sys, CudaEvent, CudaStream};
use once_cell::sync::Lazy;

use crate::device::{driver_err, Stream};
use crate::error::{Error, Result};
use crate::manager::{parse_size, MemoryManager};
use crate::sync::{Ordering, StaticAtomicU64};

/// The largest chunk unless `CUMEM_STAGING_CHUNK` says otherwise.
const DEFAULT_CHUNK: usize = 2 << 20;
/// Most lanes (threads) unless `CUMEM_STAGING_LANES` says otherwise: half
/// the cores, 2 to 8 (one memcpy thread moves well under what a DMA
/// engine does; past a handful they share the memory bandwidth).
fn default_lanes() -> usize {
    std::thread::available_parallelism().map_or(4, |n| (n.get() / 2).clamp(2, 8))
}
/// The smallest chunk: below it a DMA's fixed cost dominates.
const MIN_CHUNK: usize = 256 << 10;
/// Chunks each lane gets at least, where the size allows: with fewer the
/// pipeline hardly fills.
const CHUNKS_PER_LANE: usize = 4;

/// The tuning set with [`MemoryManager::set_staging`] (0: not set).
static SET_CHUNK: StaticAtomicU64 = StaticAtomicU64::new(0);
static SET_LANES: StaticAtomicU64 = StaticAtomicU64::new(0);

/// Largest chunk and most lanes from the environment, read once.
static FROM_ENV: Lazy<(usize, usize)> = Lazy::new(|| {
    let chunk = std::env::var("CUMEM_STAGING_CHUNK")
        .ok()
        .and_then(|v| parse_size(&v))
        .map_or(DEFAULT_CHUNK, |c| (c as usize).clamp(MIN_CHUNK, 256 << 20));
    let lanes = std::env::var("CUMEM_STAGING_LANES")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .map_or_else(default_lanes, |l| l.clamp(1, 16));
    (chunk, lanes)
});

/// The largest chunk and the most lanes in effect.
fn tuning() -> (usize, usize) {
    let (env_chunk, env_lanes) = *FROM_ENV;
    let chunk = SET_CHUNK.load(Ordering::Relaxed) as usize;
    let lanes = SET_LANES.load(Ordering::Relaxed) as usize;
    (if chunk == 0 { env_chunk } else { chunk }, if lanes == 0 { env_lanes } else { lanes })
}

/// How a copy of `bytes` is cut: chunk size, chunk count, lanes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Plan {
    chunk: usize,
    chunks: usize,
    lanes: usize,
}

impl Plan {
    /// Chunks of at most `max_chunk` bytes, small enough that every lane
    /// gets [`CHUNKS_PER_LANE`] of them, but not below [`MIN_CHUNK`]
    /// (rounded to 64 KiB); as many lanes as there are pairs of chunks, up
    /// to `max_lanes`.
    fn new(bytes: usize, max_chunk: usize, max_lanes: usize) -> Plan {
        let want = bytes.div_ceil(max_lanes * CHUNKS_PER_LANE).next_multiple_of(64 << 10);
        let chunk = want.clamp(MIN_CHUNK.min(max_chunk), max_chunk);
        let chunks = bytes.div_ceil(chunk);
        // Each lane needs two chunks to overlap anything.
        let lanes = chunks.div_ceil(2).clamp(1, max_lanes);
        Plan { chunk, chunks, lanes }
    }

    /// Offset and length of chunk `i`.
    fn piece(&self, i: usize, bytes: usize) -> (usize, usize) {
        let off = i * self.chunk;
        (off, self.chunk.min(bytes - off))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    ToDevice,
    ToHost,
}

/// One copy's shared description; pointers as integers so lanes on other
/// threads can carry them.
struct Job<'a> {
    mm: &'a MemoryManager,
    stream: &'a Arc<CudaStream>,
    dir: Direction,
    host: usize,
    dev: u64,
    bytes: usize,
    plan: Plan,
}

/// A lane's staging blocks and events.
struct Lane<'a> {
    job: &'a Job<'a>,
    stage: [Option<NonNull<u8>>; 2],
    events: [Option<CudaEvent>; 2],
}

impl<'a> Lane<'a> {
    fn new(job: &'a Job<'a>) -> Lane<'a> {
        Lane { job, stage: [None, None], events: [None, None] }
    }

    /// Staging block and event `b`, made on first use.
    fn slot(&mut self, b: usize) -> Result<(NonNull<u8>, &CudaEvent)> {
        if self.stage[b].is_none() {
            self.stage[b] = Some(self.job.mm.allocate_pinned(self.job.plan.chunk.min(self.job.bytes))?);
        }
        if self.events[b].is_none() {
            let ev = self.job.stream.context().new_event(None).map_err(driver_err("cuEventCreate"))?;
            self.events[b] = Some(ev);
        }
        Ok((self.stage[b].expect("set above"), self.events[b].as_ref().expect("set above")))
    }

    fn wait(&self, b: usize) -> Result<()> {
        match &self.events[b] {
            Some(ev) => ev.synchronize().map_err(driver_err("cuEventSynchronize")),
            None => Ok(()),
        }
    }

    /// Queues the DMA of chunk (`off`, `len`) through staging block `b`
    /// and records event `b` after it.
    fn dma(&mut self, b: usize, off: usize, len: usize) -> Result<()> {
        let (stage, _) = self.slot(b)?;
        let job = self.job;
        let dev = job.dev + off as u64;
        let cu = job.stream.cu_stream();
        // SAFETY: `stage` is a pinned block of at least `chunk >= len`
        // bytes owned by this lane, not touched by the host until event `b`
        // completes; `dev .. dev + len` lies inside the caller's device
        // range (the caller's contract).
        let r = unsafe {
            match job.dir {
                Direction::ToDevice => sys::cuMemcpyHtoDAsync_v2(dev, stage.as_ptr().cast(), len, cu),
                Direction::ToHost => sys::cuMemcpyDtoHAsync_v2(stage.as_ptr().cast(), dev, len, cu),
            }
        };
        r.result().map_err(driver_err(match job.dir {
            Direction::ToDevice => "cuMemcpyHtoDAsync",
            Direction::ToHost => "cuMemcpyDtoHAsync",
        }))?;
        let ev = self.events[b].as_ref().expect("made by slot");
        ev.record(job.stream).map_err(driver_err("cuEventRecord"))
    }

    /// Host memcpy between the caller's memory and staging block `b`.
    fn host_copy(&self, b: usize, off: usize, len: usize) {
        let stage = self.stage[b].expect("made before any host copy").as_ptr();
        let host = (self.job.host + off) as *mut u8;
        // SAFETY: the caller's host range covers `off .. off + len`; the
        // staging block holds at least `len` bytes and no DMA uses it now
        // (its event completed); the two are distinct allocations.
        unsafe {
            match self.job.dir {
                Direction::ToDevice => std::ptr::copy_nonoverlapping(host.cast_const(), stage, len),
                Direction::ToHost => std::ptr::copy_nonoverlapping(stage.cast_const(), host, len),
            }
        }
    }

    /// The chunks of lane `index`.
    fn chunks(&self, index: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        let plan = self.job.plan;
        (index..plan.chunks).step_by(plan.lanes).map(move |i| plan.piece(i, self.job.bytes))
    }

    fn run(&mut self, index: usize) -> Result<()> {
        let pieces: Vec<(usize, usize)> = self.chunks(index).collect();
        match self.job.dir {
            Direction::ToDevice => {
                for (k, &(off, len)) in pieces.iter().enumerate() {
                    let b = k % 2;
                    self.slot(b)?;
                    // The DMA two chunks back read this block: let it finish.
                    self.wait(b)?;
                    self.host_copy(b, off, len);
                    self.dma(b, off, len)?;
                }
            }
            Direction::ToHost => {
                for (k, &(off, len)) in pieces.iter().enumerate().take(2) {
                    self.dma(k % 2, off, len)?;
                }
                for (k, &(off, len)) in pieces.iter().enumerate() {
                    let b = k % 2;
                    self.wait(b)?;
                    self.host_copy(b, off, len);
                    if let Some(&(off2, len2)) = pieces.get(k + 2) {
                        self.dma(b, off2, len2)?;
                    }
                }
            }
        }
        // Every DMA of the lane has arrived.
        self.wait(0)?;
        self.wait(1)
    }

    /// Returns the staging blocks, once their DMAs are known finished.
    fn finish(mut self, result: Result<()>) -> Result<()> {
        let idle = match &result {
            Ok(()) => true,
            // An event may have missed its DMA (a failed record): only an
            // idle stream proves the staging blocks unused.
            Err(_) => self.job.stream.synchronize().is_ok(),
        };
        for stage in self.stage.iter_mut().filter_map(Option::take) {
            if idle {
                // A free of a block this lane allocated can't fail; if it
                // did, the block stays out of use, which is safe.
                let _ = self.job.mm.free_pinned(stage.as_ptr());
            }
        }
        result
    }
}

/// One lane's whole work.
fn lane(job: &Job<'_>, index: usize) -> Result<()> {
    job.stream.context().bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
    let mut lane = Lane::new(job);
    let r = lane.run(index);
    lane.finish(r)
}

impl MemoryManager {
    /// Sets, for the whole process, the largest staging chunk (bytes,
    /// clamped to 256 KiB ..= 256 MiB) and the most lanes (host threads,
    /// 1 ..= 16) of the staged copies; 0 keeps the current value. The
    /// defaults come from `CUMEM_STAGING_CHUNK` (e.g. `4MiB`) and
    /// `CUMEM_STAGING_LANES`, else 2 MiB and half the cores (2 to 8). A copy cuts its bytes into
    /// chunks small enough for every lane to get four (but at least
    /// 256 KiB) and uses a lane per pair of chunks. Returns the values now
    /// in effect.
    ///
    /// # Examples
    /// ```
    /// use cumem::MemoryManager;
    /// let before = MemoryManager::set_staging(0, 0);
    /// assert_eq!(MemoryManager::set_staging(4 << 20, 8), (4 << 20, 8));
    /// MemoryManager::set_staging(before.0, before.1);
    /// ```
    pub fn set_staging(max_chunk: usize, lanes: usize) -> (usize, usize) {
        if max_chunk != 0 {
            SET_CHUNK.store(max_chunk.clamp(MIN_CHUNK, 256 << 20) as u64, Ordering::Relaxed);
        }
        if lanes != 0 {
            SET_LANES.store(lanes.clamp(1, 16) as u64, Ordering::Relaxed);
        }
        tuning()
    }

    /// Copies `src` (ordinary pageable host memory) to device memory at
    /// `dst` through pinned staging blocks from the pinned pool, in
    /// double-buffered chunks, so the copy runs at close to pinned speed
    /// (`cuMemcpyHtoDAsync` from the staging blocks, `cuEventRecord` /
    /// `cuEventSynchronize` per block). The data lands after the work queued
    /// on `stream` before the call; the call returns once it has landed.
    /// On the host fallback it is a plain copy.
    ///
    /// Tuning: see [`set_staging`](Self::set_staging).
    ///
    /// # Safety
    /// `dst .. dst + size_of_val(src)` is device memory (on the fallback:
    /// host memory) of this manager's device that nothing else uses during
    /// the call, and it does not overlap `src`.
    ///
    /// # Errors
    /// [`Error::InvalidState`] for a host queue on a CUDA manager; pinned
    /// allocation errors; driver errors (the staging blocks are then only
    /// reused once their copies are known finished).
    ///
    /// # Examples
    /// ```
    /// use cumem::{DeviceBuffer, MemoryManager, Stream};
    /// let mm = MemoryManager::global()?;
    /// let stream = Stream::new()?;
    /// let data = vec![7u8; 5 << 20];
    /// let buf = DeviceBuffer::<u8>::new(data.len())?;
    /// // SAFETY: the buffer holds `data.len()` bytes and is used by nothing else.
    /// unsafe { mm.copy_from_pageable(buf.device_ptr(), &data, &stream)? };
    /// assert_eq!(buf.to_vec()?, data);
    /// # Ok::<(), cumem::Error>(())
    /// ```
    pub unsafe fn copy_from_pageable<T: Copy>(&self, dst: u64, src: &[T], stream: &Stream) -> Result<()> {
        let bytes = std::mem::size_of_val(src);
        // SAFETY: the caller's contract, and `src` is valid for `bytes`
        // reads for the whole call.
        unsafe { self.staged(Direction::ToDevice, src.as_ptr() as usize, dst, bytes, stream) }
    }

    /// Copies device memory at `src` into `dst` (ordinary pageable host
    /// memory) through pinned staging blocks, double-buffered (see
    /// [`copy_from_pageable`](Self::copy_from_pageable)). The copy starts
    /// after the work queued on `stream` before the call; the call returns
    /// once `dst` holds the data.
    ///
    /// # Safety
    /// `src .. src + size_of_val(dst)` is device memory (on the fallback:
    /// host memory) of this manager's device holding valid values of `T`,
    /// not written during the call, and it does not overlap `dst`.
    ///
    /// # Errors
    /// As [`copy_from_pageable`](Self::copy_from_pageable).
    ///
    /// # Examples
    /// ```
    /// use cumem::{DeviceBuffer, MemoryManager, Stream};
    /// let mm = MemoryManager::global()?;
    /// let buf = DeviceBuffer::from_host(&vec![3u32; 1 << 20])?;
    /// let mut out = vec![0u32; 1 << 20];
    /// // SAFETY: the buffer holds `out.len()` u32 values.
    /// unsafe { mm.copy_to_pageable(&mut out, buf.device_ptr(), &Stream::new()?)? };
    /// assert!(out.iter().all(|v| *v == 3));
    /// # Ok::<(), cumem::Error>(())
    /// ```
    pub unsafe fn copy_to_pageable<T: Copy>(&self, dst: &mut [T], src: u64, stream: &Stream) -> Result<()> {
        let bytes = std::mem::size_of_val(dst);
        // SAFETY: the caller's contract, and `dst` is valid for `bytes`
        // writes for the whole call (borrowed mutably).
        unsafe { self.staged(Direction::ToHost, dst.as_mut_ptr() as usize, src, bytes, stream) }
    }

    /// # Safety
    /// `host` is valid for `bytes` reads (to device) or writes (to host),
    /// `dev` for the same on the device, for the whole call; they don't
    /// overlap.
    unsafe fn staged(&self, dir: Direction, host: usize, dev: u64, bytes: usize, stream: &Stream) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        if !self.backend().is_host() && stream.is_host() {
            return Err(Error::InvalidState("a host queue can't copy CUDA device memory; use a CUDA stream".into()));
        }
        // On the host fallback device memory is host memory, whatever the
        // stream.
        let Some(cs) = stream.cudarc().filter(|_| !self.backend().is_host()) else {
            let (h, d) = (host as *mut u8, dev as usize as *mut u8);
            // SAFETY: on the host fallback device memory is host memory;
            // the caller vouches for both ranges and that they don't overlap.
            unsafe {
                match dir {
                    Direction::ToDevice => std::ptr::copy_nonoverlapping(h.cast_const(), d, bytes),
                    Direction::ToHost => std::ptr::copy_nonoverlapping(d.cast_const(), h, bytes),
                }
            }
            return Ok(());
        };
        let (chunk, lanes) = tuning();
        let job = Job { mm: self, stream: cs, dir, host, dev, bytes, plan: Plan::new(bytes, chunk, lanes) };
        super::workers::run_lanes(job.plan.lanes, &|i| lane(&job, i))
    }
}

#[cfg(test)]
mod tests {
    use super::Plan;

    #[test]
    fn plans_cover_every_byte_once() {
        for bytes in [1usize, 255, 2 << 20, (2 << 20) + 1, 8 << 20, 300 << 20, 12_345_678] {
            for lanes in [1, 3, 4, 16] {
                let p = Plan::new(bytes, 2 << 20, lanes);
                assert!(p.lanes >= 1 && p.lanes <= lanes);
                assert!(p.chunk <= 2 << 20 && (p.chunk >= 256 << 10 || p.chunks == 1));
                let mut covered = 0;
                for i in 0..p.chunks {
                    let (off, len) = p.piece(i, bytes);
                    assert_eq!(off, covered);
                    assert!(len > 0 && len <= p.chunk);
                    covered += len;
                }
                assert_eq!(covered, bytes);
            }
        }
        // 8 MiB on four lanes: 512 KiB chunks, four lanes of four.
        assert_eq!(Plan::new(8 << 20, 2 << 20, 4), Plan { chunk: 512 << 10, chunks: 16, lanes: 4 });
        // 256 MiB: the largest chunks.
        assert_eq!(Plan::new(256 << 20, 2 << 20, 4), Plan { chunk: 2 << 20, chunks: 128, lanes: 4 });
    }
}
