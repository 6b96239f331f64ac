//! cudarc interop: [`DeviceBuffer`] and [`GrowableBuffer`] speak cudarc's
//! own traits, so cudarc's copies and kernel launches take them directly.
//!
//! # Implementation details
//! cudarc keeps two events per allocation (the last read, the last write)
//! and its copy and launch functions record and wait for them when the
//! context manages stream synchronisation
//! ([`CudaContext::is_managing_stream_synchronization`]). A launch argument
//! can add those events only through cudarc's own `PushKernelArg`
//! implementations (the launch's lists are private to cudarc), so each
//! cumem buffer keeps a *shadow*: a cudarc [`CudaSlice`] over the same
//! memory, made on first use with [`CudaStream::upgrade_device_ptr`]
//! (which creates the events when tracking is on). Every trait method
//! forwards to the shadow, so reads and writes are tracked exactly as for
//! cudarc's own slices.
//!
//! The shadow never frees memory: it sits in a `ManuallyDrop` and is given
//! up with [`CudaSlice::leak`] before the buffer frees or moves its memory.
//! `leak` queues waits for the last read and write on the shadow's stream,
//! which is the buffer's own stream, or for a [`DeviceBuffer`] without
//! one cumem's internal stream of its device; the buffer's free is then
//! stream-ordered on that stream, after them. No host wait and no call on
//! the legacy stream: synchronising it (or the device) while another
//! thread captures a graph would invalidate that capture. A
//! [`GrowableBuffer`]'s shadow lives on the legacy default stream, which
//! the host synchronises before the memory moves.
//!
//! The shadow's stream is what [`DeviceSlice::stream`] answers.

use std::mem::ManuallyDrop;
use std::ops::{Bound, RangeBounds};
use std::sync::Arc;

use cudarc::driver::{
    CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice, LaunchArgs, PushKernelArg,
    SyncOnDrop,
};
use once_cell::sync::OnceCell;

use super::{DeviceBuffer, GrowableBuffer};
use crate::cuda::driver_err;
use crate::error::{Error, Result};

/// A buffer's cudarc shadow: a `CudaSlice` over the buffer's memory that
/// never frees it (see the module documentation).
pub(crate) struct CudaShadow<T> {
    cell: OnceCell<ManuallyDrop<CudaSlice<T>>>,
}

impl<T> std::fmt::Debug for CudaShadow<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaShadow").field("made", &self.is_made()).finish()
    }
}

impl<T> Default for CudaShadow<T> {
    fn default() -> Self {
        CudaShadow { cell: OnceCell::new() }
    }
}

impl<T> CudaShadow<T> {
    /// The shadow of `len` values at `ptr`, made on `home` on first use.
    ///
    /// # Safety
    /// `ptr` is a live device allocation of at least `len` values that
    /// stays live, unmoved and of that length until [`release`](Self::release).
    unsafe fn get(&self, ptr: u64, len: usize, home: impl FnOnce() -> Result<Arc<CudaStream>>) -> &CudaSlice<T> {
        self.cell.get_or_init(|| {
            let stream = home().unwrap_or_else(|e| panic!("cumem: a buffer used through cudarc's API: {e}"));
            // SAFETY: the caller vouches for the allocation until
            // `release`, which gives the slice up with `leak` (never
            // `drop`: it sits in a ManuallyDrop), so cudarc never frees
            // memory cumem owns.
            ManuallyDrop::new(unsafe { stream.upgrade_device_ptr::<T>(ptr, len) })
        })
    }

    /// As [`get`](Self::get), mutably.
    ///
    /// # Safety
    /// As [`get`](Self::get).
    unsafe fn get_mut(
        &mut self,
        ptr: u64,
        len: usize,
        home: impl FnOnce() -> Result<Arc<CudaStream>>,
    ) -> &mut CudaSlice<T> {
        // SAFETY: the caller's contract is `get`'s.
        unsafe { self.get(ptr, len, home) };
        self.cell.get_mut().expect("initialised just above")
    }

    /// Whether cudarc has seen the buffer.
    fn is_made(&self) -> bool {
        self.cell.get().is_some()
    }

    /// The shadow, if cudarc has seen the buffer.
    fn made(&self) -> Option<&CudaSlice<T>> {
        self.cell.get().map(|s| &**s)
    }

    /// As [`made`](Self::made), mutably.
    fn made_mut(&mut self) -> Option<&mut CudaSlice<T>> {
        self.cell.get_mut().map(|s| &mut **s)
    }

    /// Gives the shadow up before the memory is freed, moved or resized:
    /// its stream waits for the last tracked read and write
    /// (`cuStreamWaitEvent`). Returns that stream, for callers that free
    /// at once and must wait on the host.
    pub(crate) fn release(&mut self) -> Option<Arc<CudaStream>> {
        let slice = ManuallyDrop::into_inner(self.cell.take()?);
        let stream = slice.stream().clone();
        // `leak` queues the waits and drops the events, never the memory.
        let _ = slice.leak();
        Some(stream)
    }

    /// Releases the shadow and waits on the host for the uses it tracked
    /// (`cuStreamSynchronize` of its stream).
    pub(crate) fn release_and_wait(&mut self) -> Result<()> {
        match self.release() {
            Some(s) => s.synchronize().map_err(driver_err("cuStreamSynchronize")),
            None => Ok(()),
        }
    }
}

/// `start..end` of a range over `len` values, or an error.
fn bounds(range: impl RangeBounds<usize>, len: usize) -> Result<(usize, usize)> {
    let start = match range.start_bound() {
        Bound::Included(&s) => Some(s),
        Bound::Excluded(&s) => s.checked_add(1),
        Bound::Unbounded => Some(0),
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e.checked_add(1),
        Bound::Excluded(&e) => Some(e),
        Bound::Unbounded => Some(len),
    };
    match (start, end) {
        (Some(s), Some(e)) if s <= e && e <= len => Ok((s, e)),
        _ => Err(Error::InvalidState(format!("range out of bounds for a buffer of {len} values"))),
    }
}

/// How a buffer type reaches its shadow.
trait Shadowed<T> {
    fn shadow(&self) -> &CudaSlice<T>;
    fn shadow_mut(&mut self) -> &mut CudaSlice<T>;
    fn values(&self) -> usize;
}

impl<T> DeviceBuffer<T> {
    /// The cudarc stream of the buffer's shadow: its own stream, else
    /// cumem's internal stream of its device (never the legacy stream: the
    /// drop frees in stream order on it, see the module documentation).
    fn home_stream(&self) -> Result<Arc<CudaStream>> {
        if let Some(s) = self.own_stream().and_then(|s| s.cudarc()) {
            return Ok(s.clone());
        }
        self.internal_stream()?.cudarc().cloned().ok_or(Error::NeedsGpu("cudarc's API"))
    }
}

impl<T> DeviceBuffer<T> {
    /// Before a synchronous read on the legacy default stream (cumem's own
    /// copies out): that stream waits for cudarc's tracked writes of the
    /// buffer (`cuStreamWaitEvent`). Nothing to do before cudarc has seen
    /// the buffer. The read is recorded as a use at once: the copy
    /// completes before the call that makes it returns.
    pub(super) fn legacy_after_cudarc_writes(&self) {
        if let (Some(shadow), Ok(Some(ctx))) = (self.cuda_shadow().made(), self.cuda_context()) {
            let legacy = ctx.default_stream();
            drop(DevicePtr::device_ptr(shadow, &legacy));
        }
    }

    /// Before a synchronous write on the legacy default stream (cumem's own
    /// copies in, memset): that stream waits for cudarc's tracked reads
    /// and writes of the buffer.
    pub(super) fn legacy_after_cudarc_uses(&mut self) {
        let Ok(Some(ctx)) = self.cuda_context() else { return };
        if let Some(shadow) = self.cuda_shadow_mut().made_mut() {
            let legacy = ctx.default_stream();
            drop(DevicePtrMut::device_ptr_mut(shadow, &legacy));
        }
    }
}

impl<T> Shadowed<T> for DeviceBuffer<T> {
    fn shadow(&self) -> &CudaSlice<T> {
        // SAFETY: the buffer owns `len` values at `ptr` until it drops,
        // which releases the shadow first.
        unsafe { self.cuda_shadow().get(self.raw_ptr(), self.len_raw(), || self.home_stream()) }
    }
    fn shadow_mut(&mut self) -> &mut CudaSlice<T> {
        let (ptr, len, home) = (self.raw_ptr(), self.len_raw(), self.home_stream());
        // SAFETY: as in `shadow`.
        unsafe { self.cuda_shadow_mut().get_mut(ptr, len, || home) }
    }
    fn values(&self) -> usize {
        self.len_raw()
    }
}

impl<T: Copy> GrowableBuffer<T> {
    fn home_stream(&self) -> Result<Arc<CudaStream>> {
        match self.cuda_context() {
            Some(ctx) => Ok(ctx.default_stream()),
            None => Err(Error::NeedsGpu("cudarc's API")),
        }
    }
}

impl<T: Copy> Shadowed<T> for GrowableBuffer<T> {
    fn shadow(&self) -> &CudaSlice<T> {
        // SAFETY: the buffer's first `len` values stay mapped at
        // `device_ptr()` until a `&mut self` method changes the length or
        // the address, and each of those releases the shadow first.
        unsafe { self.cuda_shadow().get(self.device_ptr(), self.len(), || self.home_stream()) }
    }
    fn shadow_mut(&mut self) -> &mut CudaSlice<T> {
        let (ptr, len, home) = (self.device_ptr(), self.len(), self.home_stream());
        // SAFETY: as in `shadow`.
        unsafe { self.cuda_shadow_mut().get_mut(ptr, len, || home) }
    }
    fn values(&self) -> usize {
        self.len()
    }
}

/// Views and the cudarc traits, the same for both buffer types.
macro_rules! cudarc_surface {
    ($ty:ident, $($bound:tt)*) => {
        impl<T: $($bound)*> $ty<T> {
            /// A cudarc view of `range` (read-only), for
            /// `stream.memcpy_dtoh(&view, ..)`, `memcpy_dtod` or
            /// `launch.arg(&view)`; reads through it are tracked like those
            /// of the whole buffer.
            ///
            /// # Errors
            /// [`Error::NeedsGpu`] on the host fallback; [`Error::InvalidState`]
            /// for a range outside the buffer.
            ///
            /// # Examples
            /// ```no_run
            /// use cumem::{DeviceBuffer, GrowableBuffer};
            /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
            /// let ctx = cumem::cuda::device_context(0)?.expect("a GPU");
            /// let s = ctx.default_stream();
            /// let buf = DeviceBuffer::from_host(&[1u32, 2, 3, 4])?;
            /// let mut part = [0u32; 2];
            /// s.memcpy_dtoh(&buf.cuda_view(1..3)?, &mut part)?;
            /// let mut g = GrowableBuffer::<u32>::with_capacity(4)?;
            /// g.resize(4, 0)?;
            /// s.memcpy_htod(&[9u32, 9], &mut g.cuda_view_mut(..2)?)?;
            /// s.synchronize()?;
            /// # Ok(()) }
            /// ```
            pub fn cuda_view(&self, range: impl RangeBounds<usize>) -> Result<CudaView<'_, T>> {
                let (s, e) = bounds(range, self.values())?;
                self.check_cuda()?;
                Ok(self.shadow().slice(s..e))
            }

            /// A mutable cudarc view of `range`, for
            /// `stream.memcpy_htod(&host, &mut view)` or `launch.arg(&mut view)`.
            ///
            /// # Errors
            /// As [`cuda_view`](Self::cuda_view).
            ///
            /// # Examples
            /// See [`cuda_view`](Self::cuda_view).
            pub fn cuda_view_mut(&mut self, range: impl RangeBounds<usize>) -> Result<CudaViewMut<'_, T>> {
                let (s, e) = bounds(range, self.values())?;
                self.check_cuda()?;
                Ok(self.shadow_mut().slice_mut(s..e))
            }

            fn check_cuda(&self) -> Result<()> {
                self.home_stream().map(|_| ())
            }
        }

        /// # Panics
        /// [`stream`](DeviceSlice::stream) panics on the host fallback,
        /// where no CUDA stream exists (no cudarc call can reach the buffer
        /// there: cudarc's copies and launches need a CUDA stream too).
        impl<T: $($bound)*> DeviceSlice<T> for $ty<T> {
            fn len(&self) -> usize {
                self.values()
            }
            fn stream(&self) -> &Arc<CudaStream> {
                self.shadow().stream()
            }
        }

        impl<T: $($bound)*> DevicePtr<T> for $ty<T> {
            fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
                self.shadow().device_ptr(stream)
            }
        }

        impl<T: $($bound)*> DevicePtrMut<T> for $ty<T> {
            fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
                self.shadow_mut().device_ptr_mut(stream)
            }
        }

        // SAFETY: the argument pushed is the shadow's `CUdeviceptr`, a field
        // that lives as long as the borrow `'b` of the buffer, through
        // cudarc's own implementation for `&CudaSlice` (which also adds the
        // read/write events to the launch).
        unsafe impl<'a, 'b: 'a, T: $($bound)*> PushKernelArg<&'b $ty<T>> for LaunchArgs<'a> {
            #[inline(always)]
            fn arg(&mut self, arg: &'b $ty<T>) -> &mut Self {
                self.arg(arg.shadow())
            }
        }

        // SAFETY: as above, through cudarc's implementation for
        // `&mut CudaSlice` (the launch waits for earlier reads and writes and
        // records its write). The `&mut` shadow never leaves cudarc's code.
        unsafe impl<'a, 'b: 'a, T: $($bound)*> PushKernelArg<&'b mut $ty<T>> for LaunchArgs<'a> {
            #[inline(always)]
            fn arg(&mut self, arg: &'b mut $ty<T>) -> &mut Self {
                self.arg(arg.shadow_mut())
            }
        }
    };
}

cudarc_surface!(DeviceBuffer, Sized);
cudarc_surface!(GrowableBuffer, Copy);
