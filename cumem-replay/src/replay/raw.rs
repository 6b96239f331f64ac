//! The raw driver targets: every trace operation is one driver call.

use std::time::Instant;

use cudarc::driver::{result, sys};

use super::{fresh_default_pool, run_ops, Measurement};
use crate::trace::Trace;
use cumem::cuda::driver_err;
use cumem::{Error, Result};

fn context(ordinal: usize) -> Result<std::sync::Arc<cudarc::driver::CudaContext>> {
    let ctx = cumem::cuda::device_context(ordinal)?.ok_or(Error::NeedsGpu("a raw driver replay"))?;
    ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
    Ok(ctx)
}

/// Replays through `cuMemAlloc` / `cuMemFree`. The driver reports no
/// reserved figure for these, so `peak_reserved` is `None` and `peak_live`
/// is the trace's own.
pub(super) fn replay_cumemalloc(trace: &Trace, ordinal: usize) -> Result<Measurement> {
    let ctx = context(ordinal)?;
    ctx.synchronize().map_err(driver_err("cuCtxSynchronize"))?;
    let mut ptrs: Vec<sys::CUdeviceptr> = vec![0; trace.slots];
    let start = Instant::now();
    let failures = run_ops(
        trace,
        &mut ptrs,
        // SAFETY: the context is current on this thread; the memory is
        // only kept as an address, never read or written.
        |_, size| unsafe { result::malloc_sync(size) }.ok(),
        // SAFETY: `p` came from cuMemAlloc in this pass and its slot was
        // cleared, so it is freed once; nothing uses it.
        |_, p| unsafe { result::free_sync(p) }.is_ok(),
    );
    let elapsed_ns = start.elapsed().as_nanos() as u64;
    for p in ptrs.into_iter().filter(|&p| p != 0) {
        // SAFETY: a live allocation of this replay, freed once.
        unsafe { result::free_sync(p) }.map_err(driver_err("cuMemFree"))?;
    }
    Ok(Measurement { elapsed_ns, peak_live: trace.peak_live, peak_reserved: None, failures, ..Default::default() })
}

/// Replays through `cuMemAllocAsync` / `cuMemFreeAsync` on one new stream,
/// from the device's default pool (trimmed and its high-water marks reset
/// first; release threshold raised to keep memory cached). Peak reserved
/// is the pool's `CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH`; peak live the
/// trace's own.
pub(super) fn replay_cumemallocasync(trace: &Trace, ordinal: usize, warm: bool) -> Result<Measurement> {
    let ctx = context(ordinal)?;
    let pool = fresh_default_pool(ordinal)?.ok_or(Error::NeedsGpu("a raw driver replay"))?;
    ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
    let stream = ctx.new_stream().map_err(driver_err("cuStreamCreate"))?;
    let cu = stream.cu_stream();
    let pass = |ptrs: &mut Vec<sys::CUdeviceptr>| {
        run_ops(
            trace,
            ptrs,
            // SAFETY: `cu` is a live stream of the current context; the
            // memory is only kept as an address and used on no stream.
            |_, size| unsafe { result::malloc_async(cu, size) }.ok(),
            // SAFETY: `p` came from cuMemAllocAsync on `cu` in this pass and
            // its slot was cleared, so it is freed once; no work uses it.
            |_, p| unsafe { result::free_async(p, cu) }.is_ok(),
        )
    };
    let mut ptrs: Vec<sys::CUdeviceptr> = vec![0; trace.slots];
    if warm {
        pass(&mut ptrs);
        for p in ptrs.iter_mut().filter(|p| **p != 0) {
            // SAFETY: a live warm-up allocation on `cu`; `take` frees it once.
            unsafe { result::free_async(std::mem::take(p), cu) }.map_err(driver_err("cuMemFreeAsync"))?;
        }
        stream.synchronize().map_err(driver_err("cuStreamSynchronize"))?;
    }
    let start = Instant::now();
    let failures = pass(&mut ptrs);
    let elapsed_ns = start.elapsed().as_nanos() as u64;
    for p in ptrs.into_iter().filter(|&p| p != 0) {
        // SAFETY: a live allocation of this replay on `cu`, freed once.
        unsafe { result::free_async(p, cu) }.map_err(driver_err("cuMemFreeAsync"))?;
    }
    stream.synchronize().map_err(driver_err("cuStreamSynchronize"))?;
    let reserved_high = pool.attributes()?.reserved_high as usize;
    pool.trim_to(0)?;
    Ok(Measurement {
        elapsed_ns,
        peak_live: trace.peak_live,
        peak_reserved: Some(reserved_high),
        failures,
        ..Default::default()
    })
}
