//! Copies between pageable host memory (a plain `&[T]` / `&mut [T]`) and
//! device memory through a pinned staging ring: the public calls, their
//! tuning and the driver side of the pipeline (`pipeline.rs` cuts the copy
//! and runs it; `workers.rs` keeps the helper threads).
//!
//! # Implementation details
//! All DMAs go to the caller's stream (`cuMemcpyHtoDAsync` /
//! `cuMemcpyDtoHAsync` from the calling thread), so they run after the
//! work queued on it before the call; each is followed by a
//! `cuEventRecord` of its ring slot's event, watched with `cuEventQuery`.
//! The call returns once every chunk has arrived; the staging ring goes
//! back to the pinned pool only once its DMAs are known complete (when
//! that can't be established, it is leaked rather than reused). Events are
//! kept across calls (per context, a few dozen at most).

use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream};
use once_cell::sync::Lazy;

use super::pipeline::{Direction, Engine, Job, Plan, MIN_CHUNK};
use super::workers::run_with_helpers;
use crate::cuda::{driver_err, Stream};
use crate::error::{Error, Result};
use crate::manager::{parse_size, MemoryManager};
use crate::sync::{lock, Mutex, Ordering, StaticAtomicU64};

/// The largest chunk unless `CUMEM_STAGING_CHUNK` says otherwise.
const DEFAULT_CHUNK: usize = 2 << 20;
/// Most helper threads unless `CUMEM_STAGING_LANES` says otherwise: half
/// the cores, 2 to 8 (one memcpy thread moves well under what a DMA
/// engine does; past a handful they share the memory bandwidth).
fn default_lanes() -> usize {
    std::thread::available_parallelism().map_or(4, |n| (n.get() / 2).clamp(2, 8))
}

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

/// Events kept between copies, with their contexts.
static EVENTS: Lazy<Mutex<Vec<CudaEvent>>> = Lazy::new(|| Mutex::new(Vec::new()));
/// Most events kept.
const KEPT_EVENTS: usize = 64;

/// `n` events of `ctx`: kept ones first, new ones for the rest
/// (`cuEventCreate`, outside the lock).
fn take_events(ctx: &Arc<CudaContext>, n: usize) -> Result<Vec<CudaEvent>> {
    let mut events = Vec::with_capacity(n);
    {
        let mut kept = lock(&EVENTS);
        let mut i = 0;
        while i < kept.len() && events.len() < n {
            if Arc::ptr_eq(kept[i].context(), ctx) {
                events.push(kept.swap_remove(i));
            } else {
                i += 1;
            }
        }
    }
    while events.len() < n {
        events.push(ctx.new_event(None).map_err(driver_err("cuEventCreate"))?);
    }
    Ok(events)
}

/// Keeps `events` (all complete) for later copies; drops the surplus
/// (`cuEventDestroy`) outside the lock.
fn keep_events(mut events: Vec<CudaEvent>) {
    {
        let mut kept = lock(&EVENTS);
        while kept.len() < KEPT_EVENTS {
            match events.pop() {
                Some(ev) => kept.push(ev),
                None => break,
            }
        }
    }
    drop(events);
}

/// The driver side: DMAs on the caller's stream, an event per ring slot.
struct Cuda<'a> {
    stream: &'a CudaStream,
    dir: Direction,
    dev: u64,
    events: &'a [CudaEvent],
}

impl Engine for Cuda<'_> {
    fn queue(&mut self, slot: usize, stage: *mut u8, dev_off: usize, len: usize) -> Result<()> {
        let dev = self.dev + dev_off as u64;
        let cu = self.stream.cu_stream();
        // SAFETY: `stage` is a ring slot of at least `len` bytes that no
        // host thread touches until this slot's event completes (the
        // pipeline's gate); `dev .. dev + len` lies inside the caller's
        // device range (the caller's contract).
        let r = unsafe {
            match self.dir {
                Direction::ToDevice => sys::cuMemcpyHtoDAsync_v2(dev, stage.cast_const().cast(), len, cu),
                Direction::ToHost => sys::cuMemcpyDtoHAsync_v2(stage.cast(), dev, len, cu),
            }
        };
        r.result().map_err(driver_err(match self.dir {
            Direction::ToDevice => "cuMemcpyHtoDAsync",
            Direction::ToHost => "cuMemcpyDtoHAsync",
        }))?;
        // SAFETY: the event and the stream belong to the same context,
        // bound to this thread; the event stays alive (owned by the copy).
        unsafe { sys::cuEventRecord(self.events[slot].cu_event(), cu) }.result().map_err(driver_err("cuEventRecord"))
    }

    fn done(&mut self, slot: usize) -> Result<bool> {
        // SAFETY: a live event of the bound context.
        match unsafe { sys::cuEventQuery(self.events[slot].cu_event()) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => Err(driver_err("cuEventQuery")(cudarc::driver::DriverError(e))),
        }
    }
}

/// A staged copy on a CUDA stream.
///
/// # Safety
/// As [`MemoryManager::staged`].
unsafe fn staged_cuda(
    mm: &MemoryManager,
    dir: Direction,
    host: usize,
    dev: u64,
    bytes: usize,
    cs: &Arc<CudaStream>,
) -> Result<()> {
    cs.context().bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
    let (chunk, lanes) = tuning();
    let plan = Plan::new(bytes, chunk, lanes);
    let events = take_events(cs.context(), plan.slots)?;
    let stage: NonNull<u8> = mm.allocate_pinned(plan.ring_bytes())?;
    // SAFETY: the caller's contract covers `host`; the ring is a pinned
    // block of `ring_bytes` owned by this copy until freed below.
    let job = unsafe { Job::new(dir, host, stage.as_ptr() as usize, bytes, plan) };
    let mut cuda = Cuda { stream: cs, dir, dev, events: &events };
    let result = run_with_helpers(plan.helpers, &|| job.help(), |_| job.drive(&mut cuda));
    // After an error an event may miss its DMA: only an idle stream proves it.
    let idle = result.is_ok() || cs.synchronize().is_ok();
    if idle {
        // A free of a block this copy allocated can't fail; if it did,
        // the block stays out of use, which is safe.
        let _ = mm.free_pinned(stage.as_ptr());
    }
    if result.is_ok() {
        keep_events(events);
    }
    result
}

impl MemoryManager {
    /// Sets, for the whole process, the largest staging chunk (one DMA;
    /// bytes, clamped to 256 KiB ..= 256 MiB) and the most lanes (helper
    /// threads doing the host memcpys, 1 ..= 16) of the staged copies; 0
    /// keeps the current value. The defaults come from
    /// `CUMEM_STAGING_CHUNK` (e.g. `4MiB`) and `CUMEM_STAGING_LANES`, else
    /// 2 MiB and half the cores (2 to 8). A copy is cut into about eight
    /// chunks (at least 256 KiB, at most the largest), each copied on the
    /// host in about eight pieces of 64 to 256 KiB shared by the helpers
    /// (one per 2 MiB at most) and the calling thread, which also makes
    /// the driver calls. Returns the values now in effect.
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
    /// `dst` through a pinned staging ring from the pinned pool, the host
    /// memcpy of later chunks (on helper threads) overlapping the DMA of
    /// earlier ones, so the copy runs at close to pinned speed
    /// (`cuMemcpyHtoDAsync` from the ring, `cuEventRecord` /
    /// `cuEventQuery` per chunk). The data lands after the work queued
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
    /// allocation errors; driver errors (the staging ring is then only
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
        // SAFETY: the caller's contract; `src` holds `bytes` for the call.
        unsafe { self.staged(Direction::ToDevice, src.as_ptr() as usize, dst, bytes, stream) }
    }

    /// Copies device memory at `src` into `dst` (ordinary pageable host
    /// memory) through a pinned staging ring, pipelined (see
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
        // On the host fallback device memory is host memory, any stream.
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
        // SAFETY: the caller's contract.
        unsafe { staged_cuda(self, dir, host, dev, bytes, cs) }
    }
}
