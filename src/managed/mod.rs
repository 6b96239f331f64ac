//! Managed (unified) memory: [`ManagedAlloc`], an `Allocator` over a
//! best-fit pool of `cuMemAllocManaged` memory, so that
//! [`ManagedVec<T>`] is one vector the host and kernels both use; and
//! [`prefetch`] / [`advise`] to steer where its pages live.
//!
//! The manager owns the pool and creates it on first use, with
//! [`CudaManagedMemory`] as its upstream (host memory on the host
//! fallback, where the helpers do nothing).
//!
//! Host code may touch managed memory while kernels run only on devices
//! with concurrent managed access (`CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS`,
//! true on Linux with Pascal or newer); elsewhere synchronise first. As
//! with pinned memory, a block must no longer be used by queued work when
//! it is freed.

mod upstream;

pub use upstream::CudaManagedMemory;

use std::ptr::NonNull;

#[cfg(doc)]
use allocator_api2::alloc::Allocator;
use cudarc::driver::sys;

use crate::alloc::HostBlocks;
use crate::cuda::{driver_err, Stream};
use crate::error::{Error, PoolKind, Result};
use crate::manager::MemoryManager;
use crate::pool::{Pool, PoolConfig, PoolStats};
use crate::tag::StreamTag;
use crate::upstream::BLOCK_ALIGN;
use crate::upstream::{Host, Upstream};

/// A `Vec` in managed memory (see [`ManagedAlloc`]).
///
/// # Examples
/// See [`ManagedAlloc`].
pub type ManagedVec<T> = allocator_api2::vec::Vec<T, ManagedAlloc>;

/// A `Box` in managed memory.
///
/// # Examples
/// ```
/// use cumem::{ManagedAlloc, ManagedBox};
/// let b: ManagedBox<[u64; 512]> = ManagedBox::new_in([1; 512], ManagedAlloc);
/// assert_eq!(b.iter().sum::<u64>(), 512);
/// ```
pub type ManagedBox<T> = allocator_api2::boxed::Box<T, ManagedAlloc>;

impl MemoryManager {
    /// The managed pool, created on first use (its upstream is
    /// [`CudaManagedMemory`] on the default device, or host memory on the
    /// fallback).
    ///
    /// # Errors
    /// [`Error::InvalidState`] where managed memory is lacking; driver errors.
    pub fn managed_pool(&self) -> Result<&Pool<Box<dyn Upstream>>> {
        let (cell, ctx) = self.managed_cell();
        cell.get_or_try_init(|| {
            let upstream: Box<dyn Upstream> = match ctx {
                Some(ctx) => Box::new(CudaManagedMemory::new(ctx.clone())?),
                None => Box::new(Host::new()),
            };
            let mut pc = PoolConfig::new(PoolKind::Managed);
            pc.min_chunk = self.config().min_chunk;
            Ok(Pool::new(upstream, pc))
        })
    }

    /// Allocates `size` bytes of managed memory, 256-byte aligned, from the
    /// managed pool (`cuMemAllocManaged` when it grows).
    ///
    /// # Errors
    /// [`Error::InvalidSize`] for 0 or absurd sizes, [`Error::ShutDown`],
    /// [`Error::OutOfMemory`], errors of [`managed_pool`](Self::managed_pool).
    ///
    /// # Examples
    /// ```
    /// let mm = cumem::MemoryManager::global()?;
    /// let p = mm.allocate_managed(1000)?;
    /// // SAFETY: 1000 fresh bytes, host-accessible.
    /// unsafe { p.as_ptr().write_bytes(7, 1000) };
    /// mm.free_managed(p.as_ptr())?;
    /// # Ok::<(), cumem::Error>(())
    /// ```
    pub fn allocate_managed(&self, size: usize) -> Result<NonNull<u8>> {
        let a = self.allocate_managed_block(size, BLOCK_ALIGN)?;
        Ok(NonNull::new(a.addr as *mut u8).expect("pools never hand out address 0"))
    }

    fn allocate_managed_block(&self, size: usize, align: usize) -> Result<crate::pool::Allocation> {
        if self.is_shut_down() {
            return Err(Error::ShutDown("managed allocation"));
        }
        self.managed_pool()?.allocate(size, align)
    }

    /// Returns managed memory to the pool; nothing (host or device) may use it.
    ///
    /// # Errors
    /// [`Error::DoubleFree`], [`Error::InteriorPointer`],
    /// [`Error::UnknownPointer`]; the pool is unchanged then.
    pub fn free_managed(&self, ptr: *mut u8) -> Result<()> {
        match self.managed_cell().0.get() {
            Some(pool) => pool.deallocate(ptr as usize, StreamTag::NONE).map(|_| ()),
            None => Err(Error::UnknownPointer { pool: PoolKind::Managed, addr: ptr as usize }),
        }
    }

    /// The managed pool's statistics (`None` before its first use).
    pub fn managed_stats(&self) -> Option<PoolStats> {
        self.managed_cell().0.get().map(|p| p.stats())
    }
}

/// A handle to the global manager's managed pool that implements
/// [`Allocator`] (allocator-api2 0.2), so `ManagedVec<T>` and
/// `ManagedBox<T>` live in memory the host and kernels share: fill a
/// vector on the host, pass `v.as_ptr()` to a kernel, read the results
/// back without a copy. `grow` and `shrink` resize in place when the next
/// block is free.
///
/// Without a GPU the pool holds ordinary host memory, and works the same.
///
/// # Examples
/// ```
/// use cumem::managed::{prefetch, Location, ManagedAlloc, ManagedVec};
/// let mut v: ManagedVec<u32> = ManagedVec::new_in(ManagedAlloc);
/// v.extend(0..1000);
/// // Move the pages to device 0 ahead of a kernel (a no-op on the fallback).
/// prefetch(&v, Location::Device(0), &cumem::Stream::new()?)?;
/// assert_eq!(v[999], 999);
/// # Ok::<(), cumem::Error>(())
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ManagedAlloc;

impl HostBlocks for ManagedAlloc {
    fn allocate_block(&self, size: usize, align: usize) -> Result<crate::pool::Allocation> {
        MemoryManager::global()?.allocate_managed_block(size, align)
    }

    fn free_block(&self, addr: usize) -> Result<()> {
        MemoryManager::global()?.free_managed(addr as *mut u8)
    }

    fn pool(&self) -> Result<&'static Pool<Box<dyn Upstream>>> {
        MemoryManager::global()?.managed_pool()
    }

    fn name(&self) -> &'static str {
        "ManagedAlloc"
    }
}

crate::alloc::host_allocator!(ManagedAlloc);

/// Where managed pages should go.
///
/// # Examples
/// See [`ManagedAlloc`] and [`prefetch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Location {
    /// The memory of device `ordinal`.
    Device(usize),
    /// Host memory.
    Host,
}

/// Hints for the driver about how a managed range is used (`cuMemAdvise`).
///
/// # Examples
/// See [`advise`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Advice {
    /// Mostly read: devices that read it get their own copies
    /// (`CU_MEM_ADVISE_SET_READ_MOSTLY`).
    ReadMostly,
    /// Keep the pages here when possible
    /// (`CU_MEM_ADVISE_SET_PREFERRED_LOCATION`).
    PreferredLocation(Location),
    /// This device (or the host) accesses the range: keep it mapped there
    /// (`CU_MEM_ADVISE_SET_ACCESSED_BY`).
    AccessedBy(Location),
}

fn location(at: Location) -> Result<sys::CUmemLocation> {
    Ok(match at {
        Location::Device(ordinal) => {
            let count = crate::cuda::driver_status().devices();
            if ordinal >= count {
                return Err(Error::NoSuchDevice { ordinal, count });
            }
            sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: ordinal as i32 }
        }
        Location::Host => sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST, id: 0 },
    })
}

/// The manager, its context current on this thread (`None`: host fallback).
fn cuda_manager() -> Result<Option<&'static MemoryManager>> {
    let mm = MemoryManager::global()?;
    match mm.managed_cell().1 {
        Some(ctx) => {
            ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
            Ok(Some(mm))
        }
        None => Ok(None),
    }
}

/// Queues a migration of the pages under `data` (managed memory) to `to`
/// on `stream` (`cuMemPrefetchAsync`), so a kernel there, or the host,
/// finds them in place instead of faulting them in. Does nothing on the
/// host fallback or for an empty slice.
///
/// # Errors
/// [`Error::NoSuchDevice`]; a driver error (`data` not managed memory, ...).
///
/// # Examples
/// See [`ManagedAlloc`].
pub fn prefetch<T>(data: &[T], to: Location, stream: &Stream) -> Result<()> {
    let bytes = std::mem::size_of_val(data);
    let Some(_mm) = cuda_manager()? else { return Ok(()) };
    if bytes == 0 {
        return Ok(());
    }
    let loc = location(to)?;
    // SAFETY: a prefetch only moves pages of the range (which `data`
    // borrows, so it is live); it never changes their contents.
    unsafe { sys::cuMemPrefetchAsync_v2(data.as_ptr() as u64, bytes, loc, 0, stream.cu_stream()) }
        .result()
        .map_err(driver_err("cuMemPrefetchAsync"))
}

/// Sets (`set == true`) or clears an [`Advice`] for the pages under `data`
/// (managed memory; `cuMemAdvise`). Does nothing on the host fallback or
/// for an empty slice.
///
/// # Errors
/// As [`prefetch`].
///
/// # Examples
/// ```
/// use cumem::managed::{advise, Advice, Location, ManagedAlloc, ManagedVec};
/// let mut v: ManagedVec<f32> = ManagedVec::new_in(ManagedAlloc);
/// v.resize(1 << 16, 1.0);
/// advise(&v, Advice::ReadMostly, true)?;
/// advise(&v, Advice::PreferredLocation(Location::Host), true)?;
/// # Ok::<(), cumem::Error>(())
/// ```
pub fn advise<T>(data: &[T], advice: Advice, set: bool) -> Result<()> {
    use sys::CUmem_advise as A;
    let bytes = std::mem::size_of_val(data);
    let Some(_mm) = cuda_manager()? else { return Ok(()) };
    if bytes == 0 {
        return Ok(());
    }
    let (flag, at) = match (advice, set) {
        (Advice::ReadMostly, true) => (A::CU_MEM_ADVISE_SET_READ_MOSTLY, Location::Host),
        (Advice::ReadMostly, false) => (A::CU_MEM_ADVISE_UNSET_READ_MOSTLY, Location::Host),
        (Advice::PreferredLocation(l), true) => (A::CU_MEM_ADVISE_SET_PREFERRED_LOCATION, l),
        (Advice::PreferredLocation(l), false) => (A::CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION, l),
        (Advice::AccessedBy(l), true) => (A::CU_MEM_ADVISE_SET_ACCESSED_BY, l),
        (Advice::AccessedBy(l), false) => (A::CU_MEM_ADVISE_UNSET_ACCESSED_BY, l),
    };
    let loc = location(at)?;
    // SAFETY: advice moves pages, never changes them; the range is borrowed.
    unsafe { sys::cuMemAdvise_v2(data.as_ptr() as u64, bytes, flag, loc) }.result().map_err(driver_err("cuMemAdvise"))
}
