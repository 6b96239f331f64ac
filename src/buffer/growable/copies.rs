//! [`GrowableBuffer`]'s copies: host to device, device to host, device to
//! device and between devices, queued on the buffer's own stream when it
//! has one (see `with_capacity_for`), else the legacy-stream forms.

use std::mem::size_of;

use cudarc::driver::sys;

use super::GrowableBuffer;
use crate::cuda::{driver_err, vmm, RelaxedCaptureMode, Stream};
use crate::error::{Error, Result};
use crate::upstream::region::VmBackend;

impl<T: Copy> GrowableBuffer<T> {
    /// Appends `len` elements read from `src` (on the host fallback `src`
    /// is a host address and the copy a `memmove`). Returns once the copy
    /// is complete. With its own stream
    /// ([`with_capacity_for`](Self::with_capacity_for)) the copy is
    /// `cuMemcpyDtoDAsync` on that stream and waits for it alone; without,
    /// it is `cuMemcpyDtoD` on the legacy stream and waits for the legacy
    /// stream, which is illegal while a blocking stream captures a graph in
    /// the global mode (give the buffer a stream in programs that capture).
    ///
    /// # Safety
    /// `src .. src + len * size_of::<T>()` must be readable memory of this
    /// buffer's backend (device memory accessible from its device, or host
    /// memory on the fallback) that holds `len` valid values of `T`, and
    /// nothing may write to it during the call.
    ///
    /// # Errors
    /// As [`grow`](Self::grow); a driver error from the copy.
    pub unsafe fn extend_from_device(&mut self, src: u64, len: usize) -> Result<()> {
        let bytes = Self::bytes_for(len)?;
        self.reserve(len)?;
        let dst = self.region().base() + self.len * size_of::<T>();
        let _relaxed = self.relaxed_for_copy();
        match &self.ctx {
            Some(ctx) => {
                ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
                // SAFETY: the destination is mapped (just reserved) and
                // inside the buffer; the caller vouches for the source.
                // The queue's source and destination stay valid until the
                // wait below returns.
                match self.own_stream() {
                    Some(st) => {
                        // SAFETY: as above; the copy is queued on the
                        // buffer's own stream, waited for before returning.
                        unsafe { sys::cuMemcpyDtoDAsync_v2(dst as u64, src, bytes, st) }
                            .result()
                            .map_err(driver_err("cuMemcpyDtoDAsync"))?;
                        self.wait_own_stream()?;
                    }
                    None => {
                        // SAFETY: as above.
                        unsafe { sys::cuMemcpyDtoD_v2(dst as u64, src, bytes) }
                            .result()
                            .map_err(driver_err("cuMemcpyDtoD"))?;
                        legacy_synchronize()?;
                    }
                }
            }
            // SAFETY: the destination is committed host memory inside the
            // buffer; the caller vouches for the source; `copy` allows
            // overlap.
            None => unsafe { std::ptr::copy(src as usize as *const u8, dst as *mut u8, bytes) },
        }
        self.len += len;
        Ok(())
    }

    /// Appends the contents of `other`, copying device to device
    /// (`cuMemcpyDtoD`, or `cuMemcpyPeer` between two devices), host to
    /// device or device to host as the two backends require.
    ///
    /// Between two devices the copy is a peer copy: with this buffer's own
    /// stream `cuMemcpyPeerAsync` on it (waiting for that stream alone),
    /// else `cuMemcpyPeer` and `cuCtxSynchronize`, which must not run while
    /// any stream of the device captures a graph. Device to device on one
    /// device: as [`extend_from_device`](Self::extend_from_device).
    ///
    /// # Errors
    /// As [`grow`](Self::grow); driver errors.
    pub fn extend_from_buffer(&mut self, other: &GrowableBuffer<T>) -> Result<()> {
        match (self.backend(), other.backend()) {
            (VmBackend::Cuda(a), VmBackend::Cuda(b)) if a != b => {
                let (Some(dst_ctx), Some(src_ctx)) = (self.ctx.clone(), other.ctx.clone()) else {
                    return Err(Error::InvalidState(format!(
                        "GrowableBuffers on devices {b} and {a} without contexts"
                    )));
                };
                let bytes = Self::bytes_for(other.len)?;
                self.reserve(other.len)?;
                let dst = self.region().base() + self.len * size_of::<T>();
                let _relaxed = self.relaxed_for_copy();
                dst_ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
                // SAFETY: the destination is mapped (just reserved) inside
                // this buffer; the source holds `other.len` values and is
                // borrowed, so nothing writes to it.
                let (d, dc, sp, sc) = (dst as u64, dst_ctx.cu_ctx(), other.device_ptr(), src_ctx.cu_ctx());
                match self.own_stream() {
                    Some(st) => {
                        // SAFETY: as above; the copy is queued on this
                        // buffer's stream and waited for before returning.
                        unsafe { sys::cuMemcpyPeerAsync(d, dc, sp, sc, bytes, st) }
                            .result()
                            .map_err(driver_err("cuMemcpyPeerAsync"))?;
                        self.wait_own_stream()?;
                    }
                    None => {
                        // SAFETY: as above.
                        unsafe { sys::cuMemcpyPeer(d, dc, sp, sc, bytes) }
                            .result()
                            .map_err(driver_err("cuMemcpyPeer"))?;
                        vmm::synchronize(&dst_ctx)?;
                    }
                }
                self.len += other.len;
                Ok(())
            }
            (VmBackend::Cuda(_), VmBackend::Host) => {
                // SAFETY: `other` is committed host memory holding
                // `other.len` initialised values of `T`; it is borrowed, so
                // nothing writes to it meanwhile.
                let src = unsafe { std::slice::from_raw_parts(other.region().base() as *const T, other.len) };
                self.extend_from_host(src)
            }
            (VmBackend::Host, VmBackend::Cuda(_)) => {
                let start = self.len;
                self.reserve(other.len)?;
                let dst = self.region().base() + start * size_of::<T>();
                // SAFETY: the destination is committed host memory inside
                // this buffer with room for `other.len` elements (just
                // reserved); `other` is device memory, so they don't overlap.
                unsafe { other.read_into(dst as *mut T, other.len)? };
                self.len += other.len;
                Ok(())
            }
            // SAFETY: `other` holds `other.len` valid elements of the same
            // backend and is borrowed, so nothing writes to it.
            _ => unsafe { self.extend_from_device(other.device_ptr(), other.len) },
        }
    }

    pub(super) fn write_host(&self, at: usize, src: &[T]) -> Result<()> {
        let bytes = std::mem::size_of_val(src);
        let dst = self.region().base() + at * size_of::<T>();
        debug_assert!(at * size_of::<T>() + bytes <= self.capacity_bytes());
        let _relaxed = self.relaxed_for_copy();
        match &self.ctx {
            Some(ctx) => {
                ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
                // SAFETY: the destination lies in mapped memory of this
                // buffer and `src` is a live slice of `bytes` bytes.
                match self.own_stream() {
                    Some(st) => {
                        // SAFETY: as above; `src` outlives the wait below.
                        unsafe { sys::cuMemcpyHtoDAsync_v2(dst as u64, src.as_ptr().cast(), bytes, st) }
                            .result()
                            .map_err(driver_err("cuMemcpyHtoDAsync"))?;
                        self.wait_own_stream()
                    }
                    // SAFETY: as above.
                    None => unsafe { sys::cuMemcpyHtoD_v2(dst as u64, src.as_ptr().cast(), bytes) }
                        .result()
                        .map_err(driver_err("cuMemcpyHtoD")),
                }
            }
            None => {
                // SAFETY: the destination is committed host memory of this
                // buffer, no reference points into it, and it can't overlap
                // the borrowed `src`.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr().cast::<u8>(), dst as *mut u8, bytes) };
                Ok(())
            }
        }
    }

    /// Copies the first `dst.len()` elements into `dst` (`cuMemcpyDtoH`,
    /// which returns once the copy is complete).
    ///
    /// # Errors
    /// [`Error::InvalidState`] if `dst` is longer than the buffer; a driver error.
    pub fn copy_to_host(&self, dst: &mut [T]) -> Result<()> {
        // SAFETY: `dst` is a live, exclusive slice of `dst.len()` elements.
        unsafe { self.read_into(dst.as_mut_ptr(), dst.len()) }
    }

    /// Copies the first `n` elements to `dst`.
    ///
    /// # Safety
    /// `dst` must be valid for writes of `n` elements of `T` (it may be
    /// uninitialised) and not overlap this buffer.
    pub(super) unsafe fn read_into(&self, dst: *mut T, n: usize) -> Result<()> {
        if n > self.len {
            return Err(Error::InvalidState(format!(
                "copy_to_host of {n} elements from a GrowableBuffer of {}",
                self.len
            )));
        }
        let bytes = n * size_of::<T>();
        let src = self.region().base();
        let _relaxed = self.relaxed_for_copy();
        match &self.ctx {
            Some(ctx) => {
                ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
                // SAFETY: the source lies in mapped memory holding `n`
                // values of `T` written earlier; the caller vouches that
                // `dst` takes `bytes` bytes.
                match self.own_stream() {
                    Some(st) => {
                        // SAFETY: as above; `dst` outlives the wait below.
                        unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast(), src as u64, bytes, st) }
                            .result()
                            .map_err(driver_err("cuMemcpyDtoHAsync"))?;
                        self.wait_own_stream()
                    }
                    // SAFETY: as above.
                    None => unsafe { sys::cuMemcpyDtoH_v2(dst.cast(), src as u64, bytes) }
                        .result()
                        .map_err(driver_err("cuMemcpyDtoH")),
                }
            }
            None => {
                // SAFETY: the source is committed host memory holding `n`
                // values of `T`; the caller vouches for `dst` and that the
                // two don't overlap.
                unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.cast::<u8>(), bytes) };
                Ok(())
            }
        }
    }

    /// The contents, copied to a new `Vec` (`cuMemcpyDtoH`).
    ///
    /// # Errors
    /// A driver error.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        let mut out = Vec::with_capacity(self.len);
        // SAFETY: the Vec's buffer takes `self.len` elements, apart from this.
        unsafe { self.read_into(out.as_mut_ptr(), self.len)? };
        // SAFETY: all `self.len` elements were initialised just above.
        unsafe { out.set_len(self.len) };
        Ok(out)
    }
}

impl<T: Copy> GrowableBuffer<T> {
    /// The raw handle of the buffer's own stream, if it has one. Copies
    /// queued on it and the waits for it run in the relaxed capture mode:
    /// during another thread's global-mode capture the driver refuses even
    /// `cuStreamSynchronize` of an unrelated stream otherwise (and the
    /// refusal invalidates that capture), although the stream takes no
    /// part in it.
    fn own_stream(&self) -> Option<sys::CUstream> {
        self.stream.as_ref().and_then(|s| s.cudarc()).map(|c| c.cu_stream())
    }

    /// Waits for the buffer's own stream (after a copy queued on it).
    fn wait_own_stream(&self) -> Result<()> {
        self.stream.as_ref().map_or(Ok(()), Stream::synchronize)
    }

    /// The relaxed capture mode while a copy on the buffer's own stream
    /// runs (see [`own_stream`](Self::own_stream)); nothing without one.
    fn relaxed_for_copy(&self) -> Option<RelaxedCaptureMode> {
        self.stream.as_ref().map(|_| RelaxedCaptureMode::enter())
    }
}

/// Waits for the current context's legacy stream (`cuStreamSynchronize` of
/// the null stream), after a copy queued there.
fn legacy_synchronize() -> Result<()> {
    // SAFETY: the null stream is the bound current context's legacy stream.
    unsafe { sys::cuStreamSynchronize(std::ptr::null_mut()) }.result().map_err(driver_err("cuStreamSynchronize"))
}
