//! Copies on a stream: host to device, device to host, between devices.

use cudarc::driver::sys;

use super::MemoryManager;
use crate::cuda::Stream;
use crate::error::{Error, Result};

impl MemoryManager {
    /// Queues a copy of `size` bytes from host memory `src` to device memory
    /// `dst` on `stream` (`cuMemcpyHtoDAsync`). From pinned memory the copy
    /// runs asynchronously; from pageable memory the driver stages it. On
    /// the host fallback it happens at once.
    ///
    /// # Safety
    /// `src` must be valid for reads of `size` bytes and `dst` a device
    /// allocation of at least `size` bytes, both until the copy is done
    /// (synchronise `stream`), and neither may be written meanwhile.
    ///
    /// # Errors
    /// A driver error.
    pub unsafe fn copy_to_device_async(&self, dst: u64, src: *const u8, size: usize, stream: &Stream) -> Result<()> {
        if size == 0 {
            return Ok(());
        }
        match stream.context() {
            Some(ctx) => {
                ctx.bind_to_thread().map_err(crate::cuda::driver_err("cuCtxSetCurrent"))?;
                // SAFETY: the caller guarantees both ranges until it is done.
                unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), size, stream.cu_stream()) }
                    .result()
                    .map_err(crate::cuda::driver_err("cuMemcpyHtoDAsync"))
            }
            None => {
                self.host_copy_check()?;
                // SAFETY: on the host fallback device memory is host memory;
                // the caller guarantees both ranges and that they don't
                // overlap (they are distinct allocations).
                unsafe { std::ptr::copy_nonoverlapping(src, dst as usize as *mut u8, size) };
                Ok(())
            }
        }
    }

    /// Queues a copy of `size` bytes from device memory `src` to host memory
    /// `dst` on `stream` (`cuMemcpyDtoHAsync`).
    ///
    /// # Safety
    /// `dst` must be valid for writes of `size` bytes and `src` a device
    /// allocation of at least `size` bytes, both until the copy is done, and
    /// `dst` must not be read or written meanwhile.
    ///
    /// # Errors
    /// A driver error.
    pub unsafe fn copy_to_host_async(&self, dst: *mut u8, src: u64, size: usize, stream: &Stream) -> Result<()> {
        if size == 0 {
            return Ok(());
        }
        match stream.context() {
            Some(ctx) => {
                ctx.bind_to_thread().map_err(crate::cuda::driver_err("cuCtxSetCurrent"))?;
                // SAFETY: the caller guarantees both ranges until it is done.
                unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, size, stream.cu_stream()) }
                    .result()
                    .map_err(crate::cuda::driver_err("cuMemcpyDtoHAsync"))
            }
            None => {
                self.host_copy_check()?;
                // SAFETY: host memory on the fallback; the caller vouches.
                unsafe { std::ptr::copy_nonoverlapping(src as usize as *const u8, dst, size) };
                Ok(())
            }
        }
    }

    fn host_copy_check(&self) -> Result<()> {
        if self.backend.is_host() {
            Ok(())
        } else {
            Err(Error::InvalidState("a host stream can't copy CUDA device memory; use a CUDA stream".into()))
        }
    }

    /// Queues a copy of `size` bytes from device memory `src` on device
    /// `src_device` to device memory `dst` on device `dst_device`, on
    /// `stream` (`cuMemcpyPeerAsync`; within one device
    /// `cuMemcpyDtoDAsync`). It needs no peer access (the driver stages it
    /// when there is none). On the host fallback it happens at once.
    ///
    /// # Safety
    /// `src` must be readable and `dst` writable device memory of at least
    /// `size` bytes on the devices named, both live and `src` unmodified
    /// until the copy is done (synchronise `stream`), and the two ranges
    /// must not overlap.
    ///
    /// # Errors
    /// [`Error::NoSuchDevice`]; a driver error naming the call.
    pub unsafe fn copy_peer_async(
        &self,
        dst: u64,
        dst_device: usize,
        src: u64,
        src_device: usize,
        size: usize,
        stream: &Stream,
    ) -> Result<()> {
        let (dst_ctx, src_ctx) = (self.device(dst_device)?.context(), self.device(src_device)?.context());
        if size == 0 {
            return Ok(());
        }
        match (dst_ctx, src_ctx, stream.context()) {
            (Some(d), Some(s), Some(own)) => {
                own.bind_to_thread().map_err(crate::cuda::driver_err("cuCtxSetCurrent"))?;
                let rc = if dst_device == src_device {
                    // SAFETY: the caller guarantees both until it is done.
                    unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, size, stream.cu_stream()) }
                } else {
                    // SAFETY: as above; both contexts are live primary
                    // contexts of the devices that own the ranges.
                    unsafe { sys::cuMemcpyPeerAsync(dst, d.cu_ctx(), src, s.cu_ctx(), size, stream.cu_stream()) }
                };
                let call = if dst_device == src_device { "cuMemcpyDtoDAsync" } else { "cuMemcpyPeerAsync" };
                rc.result().map_err(crate::cuda::driver_err(call)).map_err(|e| e.on_device(dst_device))
            }
            (None, None, None) => {
                // SAFETY: on the host fallback device memory is host memory;
                // the caller guarantees both ranges, not overlapping.
                unsafe { std::ptr::copy_nonoverlapping(src as usize as *const u8, dst as usize as *mut u8, size) };
                Ok(())
            }
            _ => {
                Err(Error::InvalidState("a peer copy needs a CUDA stream and CUDA memory (or all on the host)".into()))
            }
        }
    }
}
