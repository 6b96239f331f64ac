//! [`DeviceBuffer`]: typed device memory, freed on drop in stream order.

use std::marker::PhantomData;
use std::mem::size_of;

use cudarc::driver::{sys, DeviceRepr};

use super::interop::CudaShadow;
use crate::cuda::{driver_err, Stream};
use crate::error::{Error, Result};
use crate::manager::MemoryManager;

/// `len` values of `T` in device memory, allocated by the global
/// [`MemoryManager`]: on the device of the stream it is made on
/// ([`new_on`](Self::new_on)), on a device named by ordinal
/// ([`new_on_device`](Self::new_on_device)), or on the default device.
///
/// Device memory is never exposed as a host reference: the contents move
/// through copies ([`copy_from_host`](Self::copy_from_host),
/// [`copy_to_host`](Self::copy_to_host), and their `_async` forms), and
/// kernels get [`device_ptr`](Self::device_ptr).
///
/// A buffer created on a stream is freed on that stream when dropped: work
/// queued on it before the drop may still use the memory, and other streams
/// reuse it only after that work. A buffer created without a stream is
/// freed at once when dropped: synchronise the work that used it first;
/// work cudarc tracked (copies and launches that took the buffer through
/// cudarc's traits) is waited for on cumem's internal stream of the device,
/// where the free is then stream-ordered. A drop never synchronises the
/// legacy stream or the device, which would break a graph capture under
/// way on another thread.
///
/// # Examples
/// ```
/// use cumem::DeviceBuffer;
/// let buf = DeviceBuffer::from_host(&[1u32, 2, 3])?;
/// assert_eq!(buf.to_vec()?, vec![1, 2, 3]);
/// # Ok::<(), cumem::Error>(())
/// ```
pub struct DeviceBuffer<T> {
    ptr: u64,
    len: usize,
    /// The device the memory is on.
    device: usize,
    stream: Option<Stream>,
    mm: &'static MemoryManager,
    /// cudarc's view of the buffer, made on first use (`buffer::interop`).
    cuda: CudaShadow<T>,
    _marker: PhantomData<T>,
}

// SAFETY: the buffer owns device memory addressed by an integer; moving it
// between threads moves that ownership. `T: Send` because values of `T`
// travel through it.
unsafe impl<T: Send> Send for DeviceBuffer<T> {}
// SAFETY: `&DeviceBuffer` only reads (copies out, pointer queries).
unsafe impl<T: Sync> Sync for DeviceBuffer<T> {}

impl<T> std::fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("device", &self.device)
            .finish()
    }
}

fn bytes_of<T>(len: usize) -> Result<usize> {
    len.checked_mul(size_of::<T>())
        .ok_or(Error::InvalidSize { size: usize::MAX, reason: "the element count overflows in bytes" })
}

impl<T: Copy> DeviceBuffer<T> {
    /// Uninitialised device memory for `len` values on the default device,
    /// usable at once by any stream.
    ///
    /// # Errors
    /// [`Error::InvalidSize`] for `len == 0` or a zero-sized `T`; the
    /// manager's allocation errors.
    pub fn new(len: usize) -> Result<Self> {
        let mm = MemoryManager::global()?;
        Self::alloc(mm, len, mm.config().device, None)
    }

    /// Uninitialised device memory for `len` values on the device of
    /// `stream` ([`Stream::device`]), for work on `stream`, freed on
    /// `stream` when dropped.
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn new_on(len: usize, stream: &Stream) -> Result<Self> {
        let mm = MemoryManager::global()?;
        Self::alloc(mm, len, stream.device().unwrap_or(mm.config().device), Some(stream))
    }

    /// Uninitialised device memory for `len` values on device `ordinal`,
    /// usable at once by any stream of that device.
    ///
    /// # Errors
    /// [`Error::NoSuchDevice`] for an ordinal past the last device (on the
    /// host fallback there is one device, 0); as [`new`](Self::new).
    ///
    /// # Examples
    /// ```
    /// use cumem::{DeviceBuffer, Error};
    /// let b = DeviceBuffer::<f32>::new_on_device(0, 16)?;
    /// assert_eq!(b.device(), 0);
    /// assert!(matches!(DeviceBuffer::<f32>::new_on_device(99, 16), Err(Error::NoSuchDevice { .. })));
    /// # Ok::<(), cumem::Error>(())
    /// ```
    pub fn new_on_device(ordinal: usize, len: usize) -> Result<Self> {
        Self::alloc(MemoryManager::global()?, len, ordinal, None)
    }

    fn alloc(mm: &'static MemoryManager, len: usize, device: usize, stream: Option<&Stream>) -> Result<Self> {
        let bytes = bytes_of::<T>(len)?;
        let ptr = match stream {
            Some(s) => mm.allocate_device_on(bytes, s)?,
            None => mm.allocate_device_for(device, bytes)?,
        };
        Ok(DeviceBuffer {
            ptr,
            len,
            device,
            stream: stream.cloned(),
            mm,
            cuda: CudaShadow::default(),
            _marker: PhantomData,
        })
    }

    /// The ordinal of the device the memory is on (0 on the host fallback).
    pub fn device(&self) -> usize {
        self.device
    }

    /// A buffer holding a copy of `data` (synchronous).
    ///
    /// # Errors
    /// As [`new`](Self::new), and copy errors.
    pub fn from_host(data: &[T]) -> Result<Self> {
        let mut b = Self::new(data.len())?;
        b.copy_from_host(data)?;
        Ok(b)
    }

    /// The number of values.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no values (never: empty buffers are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The size in bytes.
    pub fn num_bytes(&self) -> usize {
        self.len * size_of::<T>()
    }

    /// The device address, for kernel arguments (`CUdeviceptr`).
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// The stream the buffer is freed on, if any.
    pub fn stream(&self) -> Option<&Stream> {
        self.stream.as_ref()
    }

    fn check_len(&self, n: usize) -> Result<()> {
        if n != self.len {
            return Err(Error::InvalidState(format!(
                "copy of {n} values into or out of a device buffer of {} values",
                self.len
            )));
        }
        Ok(())
    }

    /// Copies `src` into the buffer and waits for the copy
    /// (`cuMemcpyHtoD`). `src.len()` must equal [`len`](Self::len).
    ///
    /// # Errors
    /// A length mismatch ([`Error::InvalidState`]) or a driver error.
    pub fn copy_from_host(&mut self, src: &[T]) -> Result<()> {
        self.check_len(src.len())?;
        match self.mm.backend().is_host() {
            // SAFETY: on the host fallback the buffer is host memory of
            // `num_bytes()` bytes owned by `self` (borrowed mutably), and
            // `src` is a distinct allocation of the same length.
            true => unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr as usize as *mut T, self.len) },
            false => {
                self.bind()?;
                self.legacy_after_cudarc_uses();
                // SAFETY: `src` is valid for `num_bytes()` reads for the whole
                // synchronous call; the destination is this buffer.
                unsafe { sys::cuMemcpyHtoD_v2(self.ptr, src.as_ptr().cast(), self.num_bytes()) }
                    .result()
                    .map_err(driver_err("cuMemcpyHtoD"))
                    .map_err(|e| e.on_device(self.device))?;
                // From pageable memory the call may return once the data is
                // staged, before it reaches the device; the copy runs on the
                // legacy stream, which non-blocking streams don't wait for.
                self.sync_legacy_stream()?
            }
        }
        Ok(())
    }

    /// Copies the buffer into `dst` and waits (`cuMemcpyDtoH`).
    /// `dst.len()` must equal [`len`](Self::len).
    ///
    /// # Errors
    /// A length mismatch or a driver error.
    pub fn copy_to_host(&self, dst: &mut [T]) -> Result<()> {
        self.check_len(dst.len())?;
        // SAFETY: `dst` is an exclusively borrowed slice of `len` values.
        unsafe { self.copy_out(dst.as_mut_ptr()) }
    }

    /// Copies the whole buffer to `dst` and waits.
    ///
    /// # Safety
    /// `dst` is valid for writes of `len` values, not overlapping the buffer.
    unsafe fn copy_out(&self, dst: *mut T) -> Result<()> {
        if self.mm.backend().is_host() {
            // SAFETY: on the host fallback the buffer is host memory of
            // `num_bytes()` bytes; the caller vouches for `dst`.
            unsafe { std::ptr::copy_nonoverlapping(self.ptr as usize as *const T, dst, self.len) };
            return Ok(());
        }
        self.bind()?;
        self.legacy_after_cudarc_writes();
        // SAFETY: the caller vouches for `dst` for the whole synchronous call.
        unsafe { sys::cuMemcpyDtoH_v2(dst.cast(), self.ptr, self.num_bytes()) }
            .result()
            .map_err(driver_err("cuMemcpyDtoH"))
            .map_err(|e| e.on_device(self.device))
    }

    /// The contents, copied to a new `Vec`.
    ///
    /// # Errors
    /// A driver error.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        let mut v = Vec::with_capacity(self.len);
        // SAFETY: spare capacity for `len` values, distinct from the buffer.
        unsafe { self.copy_out(v.as_mut_ptr())? };
        // SAFETY: `copy_out` initialised all `len` values.
        unsafe { v.set_len(self.len) };
        Ok(v)
    }

    /// Queues a copy from `src` on `stream` (`cuMemcpyHtoDAsync`).
    ///
    /// # Safety
    /// `src` must stay alive and unmodified until the copy is done
    /// (synchronise `stream`).
    ///
    /// # Errors
    /// A length mismatch or a driver error.
    pub unsafe fn copy_from_host_async(&mut self, src: &[T], stream: &Stream) -> Result<()> {
        self.check_len(src.len())?;
        // SAFETY: the destination is this buffer, exactly `num_bytes()`
        // long; the caller keeps `src` alive until the copy is done.
        unsafe { self.mm.copy_to_device_async(self.ptr, src.as_ptr().cast(), self.num_bytes(), stream) }
    }

    /// Queues a copy into `dst` on `stream` (`cuMemcpyDtoHAsync`).
    ///
    /// # Safety
    /// `dst` must stay alive and untouched until the copy is done
    /// (synchronise `stream`).
    ///
    /// # Errors
    /// A length mismatch or a driver error.
    pub unsafe fn copy_to_host_async(&self, dst: &mut [T], stream: &Stream) -> Result<()> {
        self.check_len(dst.len())?;
        // SAFETY: the source is this buffer; the caller keeps `dst` alive
        // and untouched until the copy is done.
        unsafe { self.mm.copy_to_host_async(dst.as_mut_ptr().cast(), self.ptr, self.num_bytes(), stream) }
    }

    /// Queues a copy of all of `src` into this buffer on `stream`: a peer
    /// copy when the two are on different devices (`cuMemcpyPeerAsync`,
    /// which needs no peer access), else `cuMemcpyDtoDAsync`. Work queued on
    /// `stream` before it is done first; work queued after it sees the data.
    ///
    /// # Safety
    /// Both buffers must stay alive, and `src` unmodified, until the copy is
    /// done (synchronise `stream`): dropping either meanwhile, or writing
    /// `src` from another stream, races with the copy.
    ///
    /// # Errors
    /// A length mismatch ([`Error::InvalidState`]) or a driver error.
    pub unsafe fn copy_from_buffer_async(&mut self, src: &DeviceBuffer<T>, stream: &Stream) -> Result<()> {
        self.check_len(src.len)?;
        // SAFETY: both ranges are whole buffers of `num_bytes()` bytes on
        // the devices recorded; distinct buffers don't overlap (`&mut self`
        // and `&src` can't be the same buffer); the caller keeps both alive
        // until the stream's copy is done.
        unsafe { self.mm.copy_peer_async(self.ptr, self.device, src.ptr, src.device, self.num_bytes(), stream) }
    }

    /// Copies all of `src` into this buffer and waits for the copy
    /// (`cuMemcpyPeer` between devices, `cuMemcpyDtoD` within one). Like
    /// the other synchronous copies it runs on the legacy stream: work on
    /// other streams that writes either buffer must be finished first.
    ///
    /// # Errors
    /// A length mismatch or a driver error.
    pub fn copy_from_buffer(&mut self, src: &DeviceBuffer<T>) -> Result<()> {
        self.check_len(src.len)?;
        if self.mm.backend().is_host() {
            // SAFETY: on the host fallback both buffers are distinct host
            // allocations of `num_bytes()` bytes, `self` borrowed mutably.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    src.ptr as usize as *const u8,
                    self.ptr as usize as *mut u8,
                    self.num_bytes(),
                )
            };
            return Ok(());
        }
        let (dst_ctx, src_ctx) = (self.context()?, src.context()?);
        dst_ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
        // SAFETY: both ranges are whole, distinct, live buffers of
        // `num_bytes()` bytes on the devices of the two contexts.
        unsafe { sys::cuMemcpyPeer(self.ptr, dst_ctx.cu_ctx(), src.ptr, src_ctx.cu_ctx(), self.num_bytes()) }
            .result()
            .map_err(driver_err("cuMemcpyPeer"))
            .map_err(|e| e.on_device(self.device))?;
        // A device-to-device copy may return before it is done.
        self.sync_legacy_stream()
    }

    fn context(&self) -> Result<std::sync::Arc<cudarc::driver::CudaContext>> {
        self.mm.device(self.device)?.context().cloned().ok_or(Error::NeedsGpu("a device-to-device copy"))
    }

    /// Waits for the legacy default stream, where the synchronous copy and
    /// memset functions run (`cuStreamSynchronize(0)`).
    fn sync_legacy_stream(&self) -> Result<()> {
        // SAFETY: the null stream is always valid in the current context.
        unsafe { sys::cuStreamSynchronize(std::ptr::null_mut()) }
            .result()
            .map_err(driver_err("cuStreamSynchronize"))
            .map_err(|e| e.on_device(self.device))
    }

    fn bind(&self) -> Result<()> {
        if let Some(ctx) = self.mm.device(self.device)?.context() {
            ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent")).map_err(|e| e.on_device(self.device))?;
        }
        Ok(())
    }
}

impl<T: Copy + DeviceRepr> DeviceBuffer<T> {
    /// Fills the buffer with zero bytes (`cuMemsetD8`).
    ///
    /// # Errors
    /// A driver error.
    pub fn zero(&mut self) -> Result<()> {
        if self.mm.backend().is_host() {
            // SAFETY: host fallback: `num_bytes()` host bytes `self` owns.
            unsafe { std::ptr::write_bytes(self.ptr as usize as *mut u8, 0, self.num_bytes()) };
            return Ok(());
        }
        self.bind()?;
        self.legacy_after_cudarc_uses();
        // SAFETY: the range is exactly this buffer.
        unsafe { sys::cuMemsetD8_v2(self.ptr, 0, self.num_bytes()) }
            .result()
            .map_err(driver_err("cuMemsetD8"))
            .map_err(|e| e.on_device(self.device))?;
        // The memset may still be running on the legacy stream.
        self.sync_legacy_stream()
    }
}

impl<T> DeviceBuffer<T> {
    pub(super) fn raw_ptr(&self) -> u64 {
        self.ptr
    }

    pub(super) fn own_stream(&self) -> Option<&Stream> {
        self.stream.as_ref()
    }

    pub(super) fn len_raw(&self) -> usize {
        self.len
    }

    pub(super) fn cuda_shadow(&self) -> &CudaShadow<T> {
        &self.cuda
    }

    pub(super) fn cuda_shadow_mut(&mut self) -> &mut CudaShadow<T> {
        &mut self.cuda
    }

    /// cumem's internal stream of the buffer's device.
    pub(super) fn internal_stream(&self) -> Result<&'static Stream> {
        self.mm.device(self.device)?.internal_stream()
    }

    /// The context of the memory's device (`None` on the host fallback).
    pub(super) fn cuda_context(&self) -> Result<Option<std::sync::Arc<cudarc::driver::CudaContext>>> {
        if let Some(ctx) = self.stream.as_ref().and_then(|s| s.context()) {
            return Ok(Some(ctx.clone()));
        }
        Ok(self.mm.default_device()?.context().cloned())
    }
}

impl<T> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        // Uses tracked by cudarc's events come first, queued on the
        // shadow's stream (the buffer's own, or the device's internal one),
        // ahead of a free stream-ordered on that stream: no host wait, no
        // legacy-stream call (module documentation of `interop`).
        let tracked = self.cuda.release().is_some();
        let r = match &self.stream {
            Some(s) if !s.is_host() => self.mm.free_device_on(self.ptr, s),
            _ if tracked => self.internal_stream().and_then(|s| self.mm.free_device_on(self.ptr, s)),
            Some(s) => self.mm.free_device_on(self.ptr, s),
            None => self.mm.free_device(self.ptr),
        };
        if let Err(e) = r {
            eprintln!("cumem: freeing a DeviceBuffer failed: {e}");
        }
    }
}
