//! [`GrowableBuffer`]: device memory that grows without copying.
//!
//! # Implementation details
//! The buffer is a [`Region`]: reserved address space with memory mapped
//! from offset 0 up to the capacity (on the GPU, physical chunks from
//! `cuMemCreate`; on the host fallback, pages committed with `mprotect`).
//! Growing maps one more piece after the last. When the reservation is too
//! small, it is first extended right after its end (`cuMemAddressReserve`
//! with a hint: the pointer stays the same); when those addresses are
//! taken, a larger range is reserved elsewhere and the same pieces are
//! remapped into it. Either way no byte of the contents is copied. The
//! capacity at least doubles each time the reservation grows, so a buffer
//! filled element by element maps O(log n) pieces.

use std::marker::PhantomData;
use std::mem::{align_of, size_of};

use std::sync::Arc;

use cudarc::driver::CudaContext;

use super::interop::CudaShadow;
use crate::cuda::RelaxedCaptureMode;
use crate::cuda::{follow_active_peers, vmm, Stream};
use crate::error::{Error, OomState, PoolKind, Result};
use crate::sync::{lock, MutexGuard};
mod copies;

use crate::upstream::region::{self, GrowPath, Region, Settled, SharedRegion, VmBackend, Waiter};

/// How a [`GrowableBuffer`]'s growths were served.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct GrowStats {
    /// Growths that mapped memory inside the range already reserved.
    pub within_reservation: u64,
    /// Growths that extended the reservation in place (pointer unchanged).
    pub in_place: u64,
    /// Growths remapped into a new range (pointer changed, nothing copied).
    pub remapped: u64,
    /// Map operations so far (one piece per reserved segment each spans).
    pub pieces_mapped: u64,
}

impl GrowStats {
    fn record(&mut self, path: GrowPath) {
        match path {
            GrowPath::Unchanged => {}
            GrowPath::WithinReservation => self.within_reservation += 1,
            GrowPath::InPlace => self.in_place += 1,
            GrowPath::Remapped => self.remapped += 1,
        }
    }
}

/// A buffer of `T` in device memory (or host memory on the fallback) whose
/// capacity grows without copying its contents, on CUDA virtual memory
/// management (`cuMemAddressReserve`, `cuMemCreate`, `cuMemMap`,
/// `cuMemSetAccess`).
///
/// The host never gets a reference into the buffer: data moves with
/// explicit copies (`cuMemcpyHtoD`, `cuMemcpyDtoH`, `cuMemcpyDtoD`), and
/// kernels take [`device_ptr`](Self::device_ptr). The pointer stays the
/// same while growth extends in place and changes when the memory is
/// remapped ([`GrowPath::Remapped`]).
///
/// # Waiting before giving memory back
/// Growth never waits: it maps new memory after the mapped range, which
/// no queued work can be using (`cuMemMap` and `cuMemSetAccess` are not
/// ordered with queued work; they run in the relaxed capture mode, legal
/// beside other threads' captures). Remapping into a new range (the
/// pointer changes) and shrinking and dropping unmap memory that queued
/// work may still read, so they wait first:
/// - a buffer made [`with_capacity_for`](Self::with_capacity_for) a CUDA
///   stream waits for that stream alone (`cuStreamSynchronize`, in the
///   relaxed capture mode: legal while other streams capture, in any
///   mode); work on other streams must be ordered before it. While that
///   stream captures, the release is deferred. Its copies are queued on
///   that stream too.
/// - otherwise it waits for the device (`cuCtxSynchronize`), but never
///   while a capture is known (registered with cumem, or on a blocking
///   stream): the release is then deferred.
///
/// Deferred memory stays mapped (and counted in
/// [`deferred_releases`](Self::deferred_releases)) until a later shrink,
/// drop or [`release_deferred`](Self::release_deferred) can wait; a
/// shrink that can't wait releases nothing. A driver failure during the
/// wait or an unmap leaks the memory (logged) rather than releasing it
/// while it may still be mapped or used. A capture cumem is not told of on
/// a non-blocking stream can't be seen: in programs that capture, give
/// buffers a stream.
///
/// # Examples
/// ```
/// use cumem::{GrowableBuffer, VmBackend};
/// let mut buf = GrowableBuffer::<u32>::with_capacity_on(VmBackend::Host, 1024)?;
/// buf.extend_from_host(&[1, 2, 3])?;
/// buf.reserve(1 << 20)?; // no copy
/// assert_eq!(buf.to_vec()?, vec![1, 2, 3]);
/// # Ok::<(), cumem::Error>(())
/// ```
#[derive(Debug)]
pub struct GrowableBuffer<T: Copy> {
    /// The region, shared with the peer-access registry (so that a later
    /// `enable_peer_access` reaches this buffer's mappings too).
    shared: SharedRegion,
    /// The region's context (it never changes); `None` on the host.
    ctx: Option<Arc<CudaContext>>,
    /// The buffer's own stream ([`with_capacity_for`](Self::with_capacity_for)
    /// with a CUDA stream): copies are ordered on it, and shrinking and
    /// dropping wait for it alone.
    stream: Option<Stream>,
    len: usize,
    stats: GrowStats,
    /// cudarc's view of the first `len` values, made on first use, released
    /// when the length or the address changes (`buffer::interop`).
    cuda: CudaShadow<T>,
    _marker: PhantomData<T>,
}

impl<T: Copy> GrowableBuffer<T> {
    /// A buffer with room for at least `capacity` elements, on the default
    /// device when CUDA is usable and on the host fallback otherwise
    /// ([`VmBackend::auto`]).
    ///
    /// # Errors
    /// As [`with_capacity_on`](Self::with_capacity_on).
    pub fn with_capacity(capacity: usize) -> Result<Self> {
        Self::with_capacity_on(VmBackend::auto(), capacity)
    }

    /// A buffer with room for at least `capacity` elements on `backend`
    /// (`cuMemAddressReserve`, `cuMemCreate`, `cuMemMap`, `cuMemSetAccess`;
    /// `mmap` and `mprotect` on the host).
    ///
    /// # Errors
    /// [`Error::InvalidSize`] for a zero-sized `T` or an absurd capacity;
    /// [`Error::InvalidAlignment`] when `T` needs more than 256-byte
    /// alignment; [`Error::UnsupportedMode`] on a device without VMM; out of
    /// memory, driver and OS errors.
    pub fn with_capacity_on(backend: VmBackend, capacity: usize) -> Result<Self> {
        if size_of::<T>() == 0 {
            return Err(Error::InvalidSize { size: 0, reason: "a GrowableBuffer can't hold zero-sized types" });
        }
        if align_of::<T>() > crate::upstream::BLOCK_ALIGN {
            return Err(Error::InvalidAlignment { align: align_of::<T>(), max: crate::upstream::BLOCK_ALIGN });
        }
        let bytes = Self::bytes_for(capacity)?;
        // Reserving and mapping touch no stream (see `grow`).
        let _relaxed = RelaxedCaptureMode::enter();
        let shared = Region::reserve_shared(&backend, bytes.max(1), true)?;
        let ctx = lock(&shared).cuda_context().cloned();
        let mut buf = GrowableBuffer {
            shared,
            ctx,
            stream: None,
            len: 0,
            stats: GrowStats::default(),
            cuda: CudaShadow::default(),
            _marker: PhantomData,
        };
        if bytes > 0 {
            let size = buf.region().reserved();
            buf.map(0, size)?;
        }
        Ok(buf)
    }

    /// A buffer with room for at least `capacity` elements on the device
    /// of `stream` (a host queue: as [`with_capacity`](Self::with_capacity)),
    /// whose own stream `stream` becomes: its copies are queued there (and
    /// waited for), and shrinking and dropping wait for that stream alone,
    /// never for the whole device, so they are legal while other streams
    /// capture graphs. Work on other streams that uses the buffer must be
    /// ordered before (an event) or finished when it shrinks or drops.
    ///
    /// # Errors
    /// As [`with_capacity_on`](Self::with_capacity_on).
    pub fn with_capacity_for(stream: &Stream, capacity: usize) -> Result<Self> {
        let mut buf = Self::with_capacity_on(VmBackend::of_stream(stream), capacity)?;
        if stream.cudarc().is_some() {
            buf.region().set_waiter(Waiter::Stream(stream.clone()));
            buf.stream = Some(stream.clone());
        }
        Ok(buf)
    }

    fn region(&self) -> MutexGuard<'_, Region> {
        lock(&self.shared)
    }

    fn bytes_for(elements: usize) -> Result<usize> {
        elements
            .checked_mul(size_of::<T>())
            .filter(|b| *b <= isize::MAX as usize)
            .ok_or(Error::InvalidSize { size: elements, reason: "the element count overflows the address space" })
    }

    fn map(&mut self, offset: usize, size: usize) -> Result<()> {
        let result = self.region().map(offset, size);
        if let Err(e) = result {
            let device = self.ctx.as_ref().map(|c| c.ordinal());
            if vmm::is_out_of_memory(&e) {
                let device_free = self.ctx.as_deref().and_then(|c| vmm::memory_info(c).ok()).map(|(f, _)| f);
                return Err(Error::OutOfMemory {
                    pool: PoolKind::Device,
                    requested: size,
                    state: Box::new(OomState {
                        upstream: Some(e.to_string()),
                        device_free,
                        device,
                        ..Default::default()
                    }),
                });
            }
            return Err(match device {
                Some(d) => e.on_device(d),
                None => e,
            });
        }
        self.stats.pieces_mapped += 1;
        Ok(())
    }

    /// Where the memory lives.
    pub fn backend(&self) -> VmBackend {
        self.region().backend()
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The number of elements the mapped memory holds.
    pub fn capacity(&self) -> usize {
        self.region().mapped_prefix() / size_of::<T>()
    }

    /// The bytes of memory mapped.
    pub fn capacity_bytes(&self) -> usize {
        self.region().mapped_prefix()
    }

    /// The bytes of address space reserved (at least
    /// [`capacity_bytes`](Self::capacity_bytes)).
    pub fn reserved_bytes(&self) -> usize {
        self.region().reserved()
    }

    /// The bytes of address space (no memory) held right after the
    /// reservation so that growth can extend in place (0: none).
    pub fn headroom_bytes(&self) -> usize {
        self.region().headroom()
    }

    /// Whether to keep the addresses after the reservation reserved
    /// (address space only, no memory), so that the next growths extend in
    /// place and the pointer stays the same. On by default; off gives them
    /// back (`cuMemAddressFree`; `munmap` on the host), and growth then
    /// extends in place only where nobody else took them.
    pub fn set_headroom(&mut self, on: bool) {
        self.region().set_headroom(on);
    }

    /// The unit memory is mapped in: the device's minimum VMM granularity
    /// (2 MiB on current GPUs) or the host page size.
    pub fn granularity(&self) -> usize {
        self.region().granularity()
    }

    /// The address of the first element, for kernels (a `CUdeviceptr`; a
    /// host address on the fallback). It changes when a growth remaps.
    pub fn device_ptr(&self) -> u64 {
        self.region().base() as u64
    }

    /// How growths were served so far.
    pub fn stats(&self) -> GrowStats {
        self.stats
    }

    /// Makes room for at least `min_capacity` elements, without copying:
    /// maps more memory (`cuMemCreate`, `cuMemMap`, `cuMemSetAccess`),
    /// first extending the reservation in place (`cuMemAddressReserve` with
    /// the current end as hint), else remapping the same chunks into a
    /// larger range (`cuMemUnmap`, `cuMemAddressFree` of the old one). Capacity grows at least twofold, or
    /// to just what is asked for when the device can't map twice as much.
    ///
    /// # Errors
    /// [`Error::OutOfMemory`] when the device has no memory for it; driver
    /// and OS errors. The contents are unchanged on error.
    pub fn grow(&mut self, min_capacity: usize) -> Result<GrowPath> {
        self.forget_cuda();
        // Mapping touches no stream: legal beside a global capture (relaxed).
        let _relaxed = RelaxedCaptureMode::enter();
        if min_capacity <= self.capacity() {
            return Ok(GrowPath::Unchanged);
        }
        if self.ctx.is_some() {
            // Newly active peers get access before the map, region unlocked.
            follow_active_peers()?;
        }
        let needed = self.region().round(Self::bytes_for(min_capacity)?)?;
        let mapped = self.region().mapped_prefix();
        let target = self.region().round(needed.max(mapped.saturating_mul(2)))?;
        let mut path = GrowPath::WithinReservation;
        if target > self.region().reserved() {
            path = self.region().grow_reservation(target)?;
        }
        match self.map(mapped, target - mapped) {
            Ok(()) => {}
            // Doubling asked more than the device has: map just what was asked.
            Err(Error::OutOfMemory { .. }) if target > needed => self.map(mapped, needed - mapped)?,
            Err(e) => return Err(e),
        }
        self.stats.record(path);
        Ok(path)
    }

    /// Makes room for `additional` more elements (see [`grow`](Self::grow)).
    ///
    /// # Errors
    /// As [`grow`](Self::grow).
    pub fn reserve(&mut self, additional: usize) -> Result<GrowPath> {
        let want = self
            .len
            .checked_add(additional)
            .ok_or(Error::InvalidSize { size: additional, reason: "the element count overflows" })?;
        self.grow(want)
    }

    /// Sets the length to `new_len`, new elements `value` (from the host).
    ///
    /// # Errors
    /// As [`grow`](Self::grow) and the copies.
    pub fn resize(&mut self, new_len: usize, value: T) -> Result<()> {
        self.forget_cuda();
        if new_len <= self.len {
            self.len = new_len;
            return Ok(());
        }
        self.grow(new_len)?;
        let block = vec![value; (new_len - self.len).min((1 << 20) / size_of::<T>() + 1)];
        while self.len < new_len {
            let n = block.len().min(new_len - self.len);
            self.write_host(self.len, &block[..n])?;
            self.len += n;
        }
        Ok(())
    }

    /// Shortens the buffer to `new_len` (if longer); the memory stays mapped.
    pub fn truncate(&mut self, new_len: usize) {
        self.forget_cuda();
        self.len = self.len.min(new_len);
    }

    /// Removes every element; the memory stays mapped.
    pub fn clear(&mut self) {
        self.forget_cuda();
        self.len = 0;
    }

    /// Appends `src` (`cuMemcpyHtoD`), growing without copying first.
    ///
    /// # Errors
    /// As [`grow`](Self::grow); a driver error from the copy.
    pub fn extend_from_host(&mut self, src: &[T]) -> Result<()> {
        self.forget_cuda();
        self.reserve(src.len())?;
        self.write_host(self.len, src)?;
        self.len += src.len();
        Ok(())
    }

    /// Unmaps and releases the memory beyond what the length needs
    /// (`cuMemUnmap`, `cuMemRelease`; `madvise` on the host), whole pieces
    /// at a time; the address range stays reserved for later growth.
    /// Returns the bytes released. It first waits for the work that may
    /// use the memory (see the type's "Waiting before giving memory
    /// back"); while a capture forbids that wait, it releases nothing and
    /// returns 0.
    ///
    /// # Errors
    /// Driver or OS errors (from the wait: nothing is released).
    pub fn shrink_to_fit(&mut self) -> Result<usize> {
        let _relaxed = RelaxedCaptureMode::enter();
        let keep = self.len * size_of::<T>();
        let mapped = self.region().mapped_prefix();
        let cut = self.region().piece_bounds().map(|(start, _)| start).find(|start| *start >= keep).unwrap_or(mapped);
        if cut >= mapped {
            return Ok(0);
        }
        let mut region = self.region();
        if region.settle()? == Settled::Later {
            return Ok(0);
        }
        if !region.unmap(cut, mapped - cut)? {
            return Err(Error::InvalidState("the buffer's mapped pieces are not contiguous".into()));
        }
        Ok(mapped - cut)
    }

    /// Gives the devices in `peers` (ordinals) read-write access to the
    /// buffer too (added to those that have it), now and after every growth
    /// (`cuMemSetAccess`). Nothing to do on the host fallback. Devices
    /// granted with [`enable_peer_access`](crate::cuda::enable_peer_access),
    /// and (by default) every device that can reach this one and whose
    /// context is active, have access already; one whose context becomes
    /// active later gets it at cumem's next mapping (see
    /// [`mapped_peers`](crate::cuda::mapped_peers)), so a program that
    /// enables peer access the CUDA way and reads memory mapped before the
    /// peer's context existed, with no cumem mapping in between, calls
    /// this or `enable_peer_access`.
    ///
    /// # Errors
    /// A driver error, for example for a device that can't access this one.
    pub fn set_peer_access(&mut self, peers: &[usize]) -> Result<()> {
        self.region().set_peers(peers)
    }

    /// The devices given access to the buffer besides its own.
    pub fn peers(&self) -> Vec<usize> {
        self.region().peers().to_vec()
    }

    /// Process-wide: how many dropped or remapped buffers' memory waits for
    /// a capture to end before it is given back, and how many were leaked
    /// after a driver failure (see the type's "Waiting before giving memory
    /// back").
    pub fn deferred_releases() -> (usize, u64) {
        region::deferred_and_leaked()
    }

    /// Gives back the memory whose release a capture deferred, where the
    /// wait it needs is now allowed (every later shrink or drop does it
    /// too). Call it after a capture ends.
    pub fn release_deferred() {
        let _relaxed = RelaxedCaptureMode::enter();
        region::release_deferred();
    }
}

impl<T: Copy> GrowableBuffer<T> {
    pub(super) fn cuda_shadow(&self) -> &CudaShadow<T> {
        &self.cuda
    }

    pub(super) fn cuda_shadow_mut(&mut self) -> &mut CudaShadow<T> {
        &mut self.cuda
    }

    /// The context of the buffer's device (`None` on the host fallback).
    pub(super) fn cuda_context(&self) -> Option<&std::sync::Arc<cudarc::driver::CudaContext>> {
        self.ctx.as_ref()
    }
}

impl<T: Copy> GrowableBuffer<T> {
    /// Before the length or the address changes: cudarc's tracked uses of
    /// the buffer finish (the host waits), and its cudarc shadow, which
    /// describes the old length and address, is dropped.
    fn forget_cuda(&mut self) {
        if let Err(e) = self.cuda.release_and_wait() {
            eprintln!("cumem: waiting for cudarc's uses of a GrowableBuffer: {e}");
        }
    }
}

impl<T: Copy> Drop for GrowableBuffer<T> {
    fn drop(&mut self) {
        // Uses tracked by cudarc's events finish before the region unmaps.
        if let Err(e) = self.cuda.release_and_wait() {
            eprintln!("cumem: waiting for cudarc's uses of a GrowableBuffer: {e}");
        }
    }
}
