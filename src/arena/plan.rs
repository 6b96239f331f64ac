//! [`ArenaPlan`]: the two blocks, typed handles, slices and copies.

use std::mem::{align_of, size_of};
use std::ops::RangeInclusive;
use std::ptr::NonNull;
use std::sync::Arc;

use bytemuck::Pod;
use cudarc::driver::{sys, CudaContext};

use super::handle::{DeviceHandle, HostHandle, Key};
use super::planner::{Lifetime, Memory, Placement, PlanReport, Planner};
use crate::cuda::driver_err;
use crate::error::{Error, Result};
use crate::manager::{Backend, MemoryManager};
use crate::sync::{Ordering, StaticAtomicU64};
use crate::upstream::BLOCK_ALIGN;

fn next_plan_id() -> u64 {
    static NEXT: StaticAtomicU64 = StaticAtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// A two-phase planning arena over one pinned host block and one device
/// block. See the [module documentation](super) for the rules and why they
/// are sound.
///
/// # Examples
/// ```
/// use cumem::arena::ArenaPlan;
/// let mut plan = ArenaPlan::new(1 << 20, 1 << 20)?;
/// let weights = plan.want_device::<f32>(1024)?;
/// let staging = plan.want_host::<f32>(1024)?;
/// let act0 = plan.want_device_for::<f32>(4096, 0..=1)?;
/// let act1 = plan.want_device_for::<f32>(4096, 1..=2)?;
/// let act2 = plan.want_device_for::<f32>(4096, 2..=3)?; // shares act0's bytes
/// let report = plan.commit()?;
/// assert!(report.device.planned_bytes < report.device.requested_bytes);
/// assert_eq!(plan.device_offset(&act0)?, plan.device_offset(&act2)?);
///
/// plan.host_slice_mut(&staging)?.fill(0.5);
/// plan.upload(&staging, &weights)?;
/// let mut back = vec![0.0f32; 1024];
/// plan.copy_from_device(&weights, &mut back)?;
/// assert_eq!(back[7], 0.5);
/// # let _ = act1;
/// # Ok::<(), cumem::Error>(())
/// ```
pub struct ArenaPlan {
    mm: &'static MemoryManager,
    /// The pinned block, when the host capacity is not 0.
    host: Option<NonNull<u8>>,
    /// The device block, when the device capacity is not 0.
    device: Option<u64>,
    /// The device's context; `None` on the host fallback.
    ctx: Option<Arc<CudaContext>>,
    planner: Planner,
    id: u64,
    /// Bumped by `release_all`; handles of older generations are stale.
    generation: u64,
    committed: bool,
    /// Bytes `[0, n)` of each block that cumem has written (zeroed when
    /// first placed); everything a handle can reach lies below.
    initialised: [usize; 2],
}

// SAFETY: the plan owns its two blocks (nothing else refers to them) and
// holds no thread-bound state; the context handle is `Send`.
unsafe impl Send for ArenaPlan {}
// SAFETY: every `&self` method only reads: host slices are shared `&[T]` of
// `T: Pod` (whose shared references allow reads and only reads), device
// copies out read device memory. Writes need `&mut self`.
unsafe impl Sync for ArenaPlan {}

impl std::fmt::Debug for ArenaPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArenaPlan")
            .field("generation", &self.generation)
            .field("committed", &self.committed)
            .field("report", &self.planner.report())
            .finish()
    }
}

impl ArenaPlan {
    /// A plan over `host_bytes` of pinned memory and `device_bytes` of
    /// device memory, both taken from the global [`MemoryManager`]
    /// ([`allocate_pinned`](MemoryManager::allocate_pinned),
    /// [`allocate_device`](MemoryManager::allocate_device)) and returned to
    /// it on drop. A capacity of 0 takes no block.
    ///
    /// # Errors
    /// The manager's allocation errors.
    #[cfg(not(loom))]
    pub fn new(host_bytes: usize, device_bytes: usize) -> Result<Self> {
        Self::with_manager(MemoryManager::global()?, host_bytes, device_bytes)
    }

    /// As [`new`](Self::new), with the blocks from `mm`.
    ///
    /// # Errors
    /// The manager's allocation errors.
    pub fn with_manager(mm: &'static MemoryManager, host_bytes: usize, device_bytes: usize) -> Result<Self> {
        Self::with_manager_on_device(mm, mm.config().device, host_bytes, device_bytes)
    }

    /// As [`new`](Self::new), with the device block on device `ordinal`
    /// (pinned memory serves every device).
    ///
    /// # Errors
    /// [`Error::NoSuchDevice`]; the manager's allocation errors.
    #[cfg(not(loom))]
    pub fn new_on_device(ordinal: usize, host_bytes: usize, device_bytes: usize) -> Result<Self> {
        Self::with_manager_on_device(MemoryManager::global()?, ordinal, host_bytes, device_bytes)
    }

    /// As [`with_manager`](Self::with_manager), on device `ordinal`.
    ///
    /// # Errors
    /// [`Error::NoSuchDevice`]; the manager's allocation errors.
    pub fn with_manager_on_device(
        mm: &'static MemoryManager,
        ordinal: usize,
        host_bytes: usize,
        device_bytes: usize,
    ) -> Result<Self> {
        let ctx = match mm.backend() {
            Backend::Cuda { .. } => mm.device(ordinal)?.context().cloned(),
            Backend::Host { .. } => {
                mm.device(ordinal)?;
                None
            }
        };
        let host = if host_bytes > 0 { Some(mm.allocate_pinned(host_bytes)?) } else { None };
        let device = if device_bytes > 0 {
            match mm.allocate_device_for(ordinal, device_bytes) {
                Ok(d) => Some(d),
                Err(e) => {
                    if let Some(h) = host {
                        let _ = mm.free_pinned(h.as_ptr());
                    }
                    return Err(e);
                }
            }
        } else {
            None
        };
        Ok(ArenaPlan {
            mm,
            host,
            device,
            ctx,
            planner: Planner::new(host_bytes, device_bytes),
            id: next_plan_id(),
            generation: 0,
            committed: false,
            initialised: [0, 0],
        })
    }

    /// The backend the blocks live on (the manager's).
    pub fn backend(&self) -> &Backend {
        self.mm.backend()
    }

    /// The size of the pinned host block.
    pub fn host_capacity(&self) -> usize {
        self.planner.report().host.capacity
    }

    /// The size of the device block.
    pub fn device_capacity(&self) -> usize {
        self.planner.report().device.capacity
    }

    // ---- phase one: requests ----

    fn want<T: Pod>(&mut self, memory: Memory, len: usize, lifetime: Lifetime) -> Result<Key> {
        if self.committed {
            return Err(Error::ArenaCommitted(match memory {
                Memory::Host => "a new host request",
                Memory::Device => "a new device request",
            }));
        }
        if align_of::<T>() > BLOCK_ALIGN {
            return Err(Error::InvalidAlignment { align: align_of::<T>(), max: BLOCK_ALIGN });
        }
        let bytes = len
            .checked_mul(size_of::<T>())
            .ok_or(Error::InvalidSize { size: usize::MAX, reason: "the element count overflows in bytes" })?;
        let index = self.planner.request(memory, bytes, lifetime)?;
        Ok(Key { plan: self.id, generation: self.generation, index, len })
    }

    /// Requests `len` values of `T` in pinned host memory for the whole
    /// plan. Nothing is assigned until [`satisfy`](Self::satisfy).
    ///
    /// # Errors
    /// [`Error::ArenaCommitted`]; [`Error::InvalidSize`] for 0 bytes or an
    /// overflow; [`Error::InvalidAlignment`] for `T` aligned to more than
    /// 256; [`Error::ArenaTooSmall`] when the request alone exceeds the block.
    pub fn want_host<T: Pod>(&mut self, len: usize) -> Result<HostHandle<T>> {
        let key = self.want::<T>(Memory::Host, len, Lifetime::WHOLE)?;
        Ok(HostHandle::new(key))
    }

    /// Requests `len` values of `T` in pinned host memory, used during the
    /// steps `steps` only: requests whose steps don't overlap may share
    /// bytes.
    ///
    /// # Errors
    /// As [`want_host`](Self::want_host); [`Error::InvalidState`] for no steps.
    pub fn want_host_for<T: Pod>(&mut self, len: usize, steps: RangeInclusive<usize>) -> Result<HostHandle<T>> {
        let key = self.want::<T>(Memory::Host, len, Lifetime::new(steps)?)?;
        Ok(HostHandle::new(key))
    }

    /// Requests `len` values of `T` in device memory for the whole plan.
    ///
    /// # Errors
    /// As [`want_host`](Self::want_host).
    pub fn want_device<T: Pod>(&mut self, len: usize) -> Result<DeviceHandle<T>> {
        let key = self.want::<T>(Memory::Device, len, Lifetime::WHOLE)?;
        Ok(DeviceHandle::new(key))
    }

    /// Requests `len` values of `T` in device memory during `steps` only.
    ///
    /// # Errors
    /// As [`want_host_for`](Self::want_host_for).
    pub fn want_device_for<T: Pod>(&mut self, len: usize, steps: RangeInclusive<usize>) -> Result<DeviceHandle<T>> {
        let key = self.want::<T>(Memory::Device, len, Lifetime::new(steps)?)?;
        Ok(DeviceHandle::new(key))
    }

    // ---- phase two: assignment ----

    /// Assigns every pending request a 256-aligned offset in its block, all
    /// in one step, and returns the plan so far. Requests assigned before
    /// keep their offsets; new ones fill the room around them.
    ///
    /// All or nothing: when a block is too small, nothing is assigned, the
    /// requests stay pending (add capacity by building a larger plan, or
    /// [`release_all`](Self::release_all)), and earlier assignments stand.
    ///
    /// # Errors
    /// [`Error::ArenaCommitted`]; [`Error::ArenaTooSmall`] naming the bytes
    /// the plan needs and the bytes the block holds; a driver error zeroing
    /// fresh device memory (nothing assigned then either).
    pub fn satisfy(&mut self) -> Result<PlanReport> {
        if self.committed {
            return Err(Error::ArenaCommitted("satisfy"));
        }
        let placement = self.planner.plan()?;
        self.initialise(&placement)?;
        self.planner.apply(placement);
        Ok(self.planner.report())
    }

    /// Zeroes the bytes `placement` hands out for the first time, so that
    /// no handle ever reaches memory cumem has not written.
    fn initialise(&mut self, placement: &Placement) -> Result<()> {
        let (from, to) = (self.initialised[0], placement.end(Memory::Host));
        if let (Some(base), true) = (self.host, to > from) {
            // SAFETY: `[from, to)` lies within the host block (`to` passed
            // the capacity check), which this plan owns; no slice into it
            // exists while `self` is borrowed mutably.
            unsafe { std::ptr::write_bytes(base.as_ptr().add(from), 0, to - from) };
            self.initialised[0] = to;
        }
        let (from, to) = (self.initialised[1], placement.end(Memory::Device));
        if let (Some(base), true) = (self.device, to > from) {
            let start = base + from as u64;
            match &self.ctx {
                Some(ctx) => {
                    ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
                    // SAFETY: `[from, to)` lies within the device block, which
                    // this plan owns; no request was ever placed there, so no
                    // queued work uses it.
                    unsafe { sys::cuMemsetD8_v2(start, 0, to - from) }.result().map_err(driver_err("cuMemsetD8"))?;
                    // The memset may still run when it returns; kernels on
                    // non-blocking streams must not see it late.
                    sync_legacy_stream()?;
                }
                // SAFETY: on the host fallback the device block is host
                // memory this plan owns; the range lies within it.
                None => unsafe { std::ptr::write_bytes(start as usize as *mut u8, 0, to - from) },
            }
            self.initialised[1] = to;
        }
        Ok(())
    }

    /// Satisfies what is pending and freezes the plan: further requests
    /// and `satisfy` are refused until [`release_all`](Self::release_all).
    /// Handles keep working.
    ///
    /// # Errors
    /// [`Error::ArenaCommitted`] if committed already; the errors of
    /// [`satisfy`](Self::satisfy), leaving the plan open.
    pub fn commit(&mut self) -> Result<PlanReport> {
        let report = self.satisfy()?;
        self.committed = true;
        Ok(report)
    }

    /// Whether [`commit`](Self::commit) froze the plan.
    pub fn is_committed(&self) -> bool {
        self.committed
    }

    /// Forgets every request and reopens the plan; the blocks stay. Waits
    /// for all work queued on the device (`cuCtxSynchronize`) first, so
    /// nothing still running uses the memory new requests will get. Every
    /// handle made so far is stale from now on: using one is an error.
    ///
    /// The memory keeps its contents; new requests over it see them.
    ///
    /// # Errors
    /// A driver error from the device's queued work (the plan is reset anyway).
    pub fn release_all(&mut self) -> Result<()> {
        let synced = self.synchronize();
        self.planner.clear();
        self.generation += 1;
        self.committed = false;
        synced
    }

    fn synchronize(&self) -> Result<()> {
        match &self.ctx {
            Some(ctx) => ctx.synchronize().map_err(driver_err("cuCtxSynchronize")),
            None => Ok(()),
        }
    }

    /// The plan so far: per block, requests, bytes requested and planned.
    pub fn report(&self) -> PlanReport {
        self.planner.report()
    }

    /// How many requests wait for [`satisfy`](Self::satisfy).
    pub fn pending(&self) -> usize {
        self.planner.pending()
    }

    // ---- resolving handles ----

    fn resolve(&self, memory: Memory, key: &Key) -> Result<usize> {
        if key.plan != self.id {
            return Err(Error::InvalidHandle("the handle belongs to another arena plan".into()));
        }
        if key.generation != self.generation {
            return Err(Error::InvalidHandle(format!(
                "the handle is stale: release_all() reset the plan after it was made (handle generation {}, plan \
                 generation {})",
                key.generation, self.generation
            )));
        }
        self.planner.offset(memory, key.index).ok_or_else(|| {
            Error::InvalidHandle("the request is not assigned yet: call satisfy() or commit() first".into())
        })
    }

    /// The offset of a host request in the pinned block (a multiple of 256).
    ///
    /// # Errors
    /// [`Error::InvalidHandle`]: another plan's, a stale or an unassigned one.
    pub fn host_offset<T>(&self, h: &HostHandle<T>) -> Result<usize> {
        self.resolve(Memory::Host, &h.key)
    }

    /// A device request's offset in the device block (a multiple of 256).
    ///
    /// # Errors
    /// As [`host_offset`](Self::host_offset).
    pub fn device_offset<T>(&self, h: &DeviceHandle<T>) -> Result<usize> {
        self.resolve(Memory::Device, &h.key)
    }

    /// A raw pointer to a host request's memory, for asynchronous copies
    /// ([`MemoryManager::copy_to_device_async`]); valid until the plan is
    /// dropped. Prefer [`host_slice`](Self::host_slice).
    ///
    /// # Errors
    /// As [`host_offset`](Self::host_offset).
    pub fn host_ptr<T>(&self, h: &HostHandle<T>) -> Result<*mut T> {
        let offset = self.host_offset(h)?;
        let base = self.host.expect("an assigned host request implies a host block");
        // SAFETY: `offset` is within the host block (the planner placed the
        // request there, ending within the capacity).
        Ok(unsafe { base.as_ptr().add(offset) }.cast())
    }

    /// The device address of a device request (`CUdeviceptr`, 256-aligned),
    /// for kernel arguments and raw copies.
    ///
    /// # Errors
    /// As [`host_offset`](Self::host_offset).
    pub fn device_ptr<T>(&self, h: &DeviceHandle<T>) -> Result<u64> {
        let offset = self.device_offset(h)?;
        Ok(self.device.expect("an assigned device request implies a device block") + offset as u64)
    }

    /// A host request's values.
    ///
    /// # Errors
    /// As [`host_offset`](Self::host_offset).
    pub fn host_slice<T: Pod>(&self, h: &HostHandle<T>) -> Result<&[T]> {
        let ptr = self.host_ptr(h)?;
        // SAFETY: the request's `len` values lie within the host block, at a
        // 256-aligned offset of a 256-aligned block (`T`'s alignment is at
        // most 256, checked at `want`), and were initialised at `satisfy`
        // (`initialise`) or written since as `Pod` values; any bytes are a
        // valid `T`. The slice borrows `self`, so no `&mut` slice of the
        // plan exists while it lives.
        Ok(unsafe { std::slice::from_raw_parts(ptr, h.len()) })
    }

    /// A host request's values, mutably. The slice borrows the whole plan
    /// mutably: two requests may share bytes (disjoint lifetimes), so only
    /// one slice may be written at a time.
    ///
    /// # Errors
    /// As [`host_offset`](Self::host_offset).
    pub fn host_slice_mut<T: Pod>(&mut self, h: &HostHandle<T>) -> Result<&mut [T]> {
        let ptr = self.host_ptr(h)?;
        // SAFETY: as in `host_slice`; and the exclusive borrow of `self`
        // means no other slice of the plan's memory exists while this one
        // lives.
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr, h.len()) })
    }

    // ---- copies ----

    fn check_len(handle: usize, slice: usize) -> Result<()> {
        if handle != slice {
            return Err(Error::InvalidState(format!(
                "copy of {slice} values into or out of an arena request of {handle} values"
            )));
        }
        Ok(())
    }

    /// Copies `src` into a device request and waits until the data is on
    /// the device (`cuMemcpyHtoD`, then `cuStreamSynchronize` of the legacy
    /// stream; a memcpy on the host fallback). `src.len()` must equal the
    /// request's.
    ///
    /// # Errors
    /// [`Error::InvalidHandle`], a length mismatch, a driver error.
    pub fn copy_to_device<T: Pod>(&mut self, h: &DeviceHandle<T>, src: &[T]) -> Result<()> {
        Self::check_len(h.len(), src.len())?;
        let dst = self.device_ptr(h)?;
        // SAFETY: `src` is a live slice of `num_bytes` bytes; `dst` is this
        // request, within the device block; they are distinct allocations.
        unsafe { self.htod(dst, src.as_ptr().cast(), h.num_bytes()) }
    }

    /// Copies a device request into `dst` and waits (`cuMemcpyDtoH`).
    /// `dst.len()` must equal the request's.
    ///
    /// # Errors
    /// As [`copy_to_device`](Self::copy_to_device).
    pub fn copy_from_device<T: Pod>(&self, h: &DeviceHandle<T>, dst: &mut [T]) -> Result<()> {
        Self::check_len(h.len(), dst.len())?;
        let src = self.device_ptr(h)?;
        // SAFETY: `dst` is an exclusively borrowed slice of `num_bytes`
        // bytes, so not part of this plan (borrowed shared here); any bytes
        // are a valid `T`.
        unsafe { self.dtoh(dst.as_mut_ptr().cast(), src, h.num_bytes()) }
    }

    /// Copies a host request into a device request of the same length and
    /// waits: from pinned memory, at full DMA speed.
    ///
    /// # Errors
    /// As [`copy_to_device`](Self::copy_to_device).
    pub fn upload<T: Pod>(&mut self, from: &HostHandle<T>, to: &DeviceHandle<T>) -> Result<()> {
        Self::check_len(to.len(), from.len())?;
        let (src, dst) = (self.host_ptr(from)?, self.device_ptr(to)?);
        // SAFETY: both are requests of this plan, within their blocks, of
        // `num_bytes` bytes; the blocks are distinct allocations.
        unsafe { self.htod(dst, src.cast_const().cast(), to.num_bytes()) }
    }

    /// Copies a device request into a host request of its length and waits.
    ///
    /// # Errors
    /// As [`copy_to_device`](Self::copy_to_device).
    pub fn download<T: Pod>(&mut self, from: &DeviceHandle<T>, to: &HostHandle<T>) -> Result<()> {
        Self::check_len(from.len(), to.len())?;
        let (src, dst) = (self.device_ptr(from)?, self.host_ptr(to)?);
        // SAFETY: as in `upload`; `self` is borrowed mutably, so no slice of
        // the host block is alive to see the write.
        unsafe { self.dtoh(dst.cast(), src, from.num_bytes()) }
    }

    /// Synchronous host-to-device copy.
    ///
    /// # Safety
    /// `src` is valid for reads of `bytes` bytes and `dst..dst + bytes` lies
    /// within the device block; they don't overlap.
    unsafe fn htod(&self, dst: u64, src: *const u8, bytes: usize) -> Result<()> {
        match &self.ctx {
            Some(ctx) => {
                ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
                // SAFETY: the caller vouches for both ranges for the call.
                unsafe { sys::cuMemcpyHtoD_v2(dst, src.cast(), bytes) }.result().map_err(driver_err("cuMemcpyHtoD"))?;
                // From pageable memory the call returns once the data is
                // staged, before it reaches the device: wait for it, so the
                // copy is done for every stream.
                sync_legacy_stream()
            }
            None => {
                // SAFETY: on the host fallback the device block is host
                // memory; the caller vouches for both ranges.
                unsafe { std::ptr::copy_nonoverlapping(src, dst as usize as *mut u8, bytes) };
                Ok(())
            }
        }
    }

    /// Synchronous device-to-host copy.
    ///
    /// # Safety
    /// `dst` is valid for writes of `bytes` bytes and nothing reads it
    /// meanwhile; `src..src + bytes` lies within the device block.
    unsafe fn dtoh(&self, dst: *mut u8, src: u64, bytes: usize) -> Result<()> {
        match &self.ctx {
            Some(ctx) => {
                ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
                // SAFETY: the caller vouches for both ranges for the call.
                unsafe { sys::cuMemcpyDtoH_v2(dst.cast(), src, bytes) }.result().map_err(driver_err("cuMemcpyDtoH"))
            }
            None => {
                // SAFETY: on the host fallback the device block is host
                // memory; the caller vouches for both ranges.
                unsafe { std::ptr::copy_nonoverlapping(src as usize as *const u8, dst, bytes) };
                Ok(())
            }
        }
    }
}

/// Waits for the work queued on the current context's legacy default
/// stream (`cuStreamSynchronize(NULL)`), where the synchronous copies and
/// memsets run.
fn sync_legacy_stream() -> Result<()> {
    // SAFETY: the null stream is the bound current context's legacy stream.
    unsafe { sys::cuStreamSynchronize(std::ptr::null_mut()) }.result().map_err(driver_err("cuStreamSynchronize"))
}

impl Drop for ArenaPlan {
    fn drop(&mut self) {
        if let Err(e) = self.synchronize() {
            eprintln!("cumem: waiting for device work before freeing an ArenaPlan failed: {e}");
        }
        if let Some(h) = self.host {
            if let Err(e) = self.mm.free_pinned(h.as_ptr()) {
                eprintln!("cumem: freeing an ArenaPlan's pinned block failed: {e}");
            }
        }
        if let Some(d) = self.device {
            if let Err(e) = self.mm.free_device(d) {
                eprintln!("cumem: freeing an ArenaPlan's device block failed: {e}");
            }
        }
    }
}
