//! CUDA virtual memory management: address ranges, chunks, their mappings.
//!
//! ```text
//!  AddressRange (cuMemAddressReserve)      PhysicalChunk (cuMemCreate)
//!  [ptr ........................ end)       [handle, size]
//!      |<- offset ->|<- chunk.size ->|
//!                   `-- map (cuMemMap) + set_access (cuMemSetAccess)
//! ```
//!
//! A range is virtual address space only; a chunk is physical device
//! memory with no address. [`AddressRange::map`] puts a whole chunk at an
//! offset in a range; [`AddressRange::unmap`] takes it out again, exactly as
//! it was mapped (the driver can't unmap part of a mapping). The same chunk
//! can be mapped into another range later: that is how a buffer moves to a
//! bigger range without copying.
//!
//! Owners unmap before they drop: a [`PhysicalChunk`] released while mapped
//! stays alive in the driver until it is unmapped, and an [`AddressRange`]
//! freed while mapped makes `cuMemAddressFree` fail (the failure is logged).
//!
//! Every call that moves physical memory, and every read of the device's
//! free memory, is counted and timed ([`driver_calls`]).

use std::sync::Arc;

use cudarc::driver::sys;
use cudarc::driver::CudaContext;

use super::driver_err;
use crate::error::{Error, Result};

mod calls;

use calls::timed;
#[cfg(not(loom))]
pub(crate) use calls::BackgroundThread;
pub use calls::{
    driver_calls, on_background_mapper, record_background_call, record_call, CallKind, DriverCallCounts, DriverCalls,
};

/// A device's allocation granularity (`cuMemGetAllocationGranularity`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Granularity {
    /// Sizes and offsets of chunks and ranges must be multiples of this.
    pub minimum: usize,
    /// The granularity the driver recommends for performance.
    pub recommended: usize,
}

fn check(call: &'static str, rc: sys::CUresult) -> Result<()> {
    rc.result().map_err(driver_err(call))
}

fn bind(ctx: &CudaContext) -> Result<()> {
    ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))
}

/// Whether device memory at `ctx`'s device can be managed with the VMM API
/// (`cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)`).
///
/// # Errors
/// A driver error if the attribute can't be read.
pub fn vmm_supported(ctx: &CudaContext) -> Result<bool> {
    let attr = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED;
    let value = ctx.attribute(attr).map_err(driver_err("cuDeviceGetAttribute"))?;
    Ok(value != 0)
}

/// Returns `Ok(())` when the device supports virtual memory management and
/// [`Error::UnsupportedMode`] when it does not.
///
/// # Errors
/// [`Error::UnsupportedMode`], or a driver error reading the attribute.
pub fn require_vmm(ctx: &CudaContext) -> Result<()> {
    if vmm_supported(ctx)? {
        return Ok(());
    }
    Err(Error::UnsupportedMode {
        mode: "virtual memory management",
        reason: format!(
            "device {} reports CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 0 \
             (cuMemCreate/cuMemMap unavailable); use the host fallback or a copying buffer",
            ctx.ordinal()
        ),
    })
}

fn device_location(device: sys::CUdevice) -> sys::CUmemLocation {
    sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: device }
}

/// The properties of pinned device memory on `device`, as `cuMemCreate` and
/// `cuMemGetAllocationGranularity` take them; `exportable` asks for memory
/// that can be shared with other processes as a POSIX file descriptor.
fn pinned_prop(device: sys::CUdevice, exportable: bool) -> sys::CUmemAllocationProp {
    let handles = if exportable {
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    } else {
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE
    };
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: handles,
        location: device_location(device),
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// The minimum and recommended granularity of pinned device memory on
/// `ctx`'s device (`cuMemGetAllocationGranularity`).
///
/// # Errors
/// [`Error::UnsupportedMode`] without VMM support; a driver error.
pub fn granularity(ctx: &CudaContext) -> Result<Granularity> {
    require_vmm(ctx)?;
    bind(ctx)?;
    let prop = pinned_prop(ctx.cu_device(), false);
    let mut minimum = 0usize;
    let mut recommended = 0usize;
    let min_flag = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
    let rec_flag = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED;
    // SAFETY: both out-pointers are valid locals and `prop` is a fully
    // initialised property struct that lives across the call.
    check("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(&mut minimum, &prop, min_flag)
    })?;
    // SAFETY: as above.
    check("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(&mut recommended, &prop, rec_flag)
    })?;
    if minimum == 0 || !minimum.is_power_of_two() {
        return Err(Error::Driver {
            call: "cuMemGetAllocationGranularity",
            message: format!("unusable minimum granularity {minimum}"),
            device: Some(ctx.ordinal()),
        });
    }
    let recommended = if recommended >= minimum && recommended % minimum == 0 { recommended } else { minimum };
    Ok(Granularity { minimum, recommended })
}

/// A reserved range of virtual addresses, with no memory behind it until
/// chunks are mapped (`cuMemAddressReserve`; `cuMemAddressFree` on drop).
#[derive(Debug)]
pub struct AddressRange {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    size: usize,
}

impl AddressRange {
    /// Reserves `size` bytes (a multiple of the minimum granularity) of
    /// virtual address space, preferably starting at `hint` (0 for no
    /// preference). The driver may ignore the hint: compare
    /// [`ptr`](Self::ptr) with it.
    ///
    /// # Errors
    /// [`Error::InvalidSize`] for an empty size; a driver error from
    /// `cuMemAddressReserve` (for example when the address space is full).
    pub fn reserve(ctx: &Arc<CudaContext>, size: usize, hint: u64) -> Result<Self> {
        if size == 0 {
            return Err(Error::InvalidSize { size, reason: "an address range can't be empty" });
        }
        crate::fault::check(crate::fault::Point::Reserve)?;
        bind(ctx)?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is a valid out-pointer; reserving address space
        // touches no existing memory, whatever the hint.
        check("cuMemAddressReserve", unsafe { sys::cuMemAddressReserve(&mut ptr, size, 0, hint, 0) })?;
        Ok(AddressRange { ctx: ctx.clone(), ptr, size })
    }

    /// The first address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The length in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// One past the last address.
    pub fn end(&self) -> u64 {
        self.ptr + self.size as u64
    }

    /// The context the range belongs to.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The same range under another name that never frees it, to map and
    /// set access with the owner's lock dropped.
    ///
    /// # Safety
    /// The alias must not be used after this range is dropped (its
    /// addresses may then be another reservation's).
    pub(crate) unsafe fn alias(&self) -> RangeAlias {
        RangeAlias(std::mem::ManuallyDrop::new(AddressRange { ctx: self.ctx.clone(), ptr: self.ptr, size: self.size }))
    }

    fn check_inside(&self, offset: usize, size: usize) -> Result<()> {
        match offset.checked_add(size) {
            Some(end) if size > 0 && end <= self.size => Ok(()),
            _ => Err(Error::InvalidState(format!(
                "{size} B at offset {offset} does not fit in the {} B address range at {:#x}",
                self.size, self.ptr
            ))),
        }
    }

    /// Maps all of `chunk` at `offset` (`cuMemMap`). The memory is not
    /// accessible until [`set_access`](Self::set_access) is called.
    ///
    /// # Errors
    /// [`Error::InvalidState`] when the chunk does not fit; a driver error
    /// (for example when part of the target is already mapped).
    pub fn map(&self, offset: usize, chunk: &PhysicalChunk) -> Result<()> {
        self.check_inside(offset, chunk.size)?;
        crate::fault::check(crate::fault::Point::Map)?;
        bind(&self.ctx)?;
        // SAFETY: the target lies inside this reservation (checked above)
        // and `chunk.handle` is a live allocation handle; the driver
        // refuses the call if part of the target is already mapped.
        let rc =
            timed(CallKind::Map, || unsafe { sys::cuMemMap(self.ptr + offset as u64, chunk.size, 0, chunk.handle, 0) });
        check("cuMemMap", rc)
    }

    /// Gives this device (and each ordinal in `peers`) read-write access to
    /// `size` mapped bytes at `offset` (`cuMemSetAccess`).
    ///
    /// # Errors
    /// [`Error::InvalidState`] for a span outside the range; a driver error
    /// (for example for an unmapped span or a peer that can't access it).
    pub fn set_access(&self, offset: usize, size: usize, peers: &[usize]) -> Result<()> {
        self.check_inside(offset, size)?;
        crate::fault::check(crate::fault::Point::SetAccess)?;
        bind(&self.ctx)?;
        let mut devices = vec![self.ctx.cu_device()];
        for &peer in peers {
            let id = i32::try_from(peer).map_err(|_| Error::NoSuchDevice { ordinal: peer, count: 0 })?;
            let dev = cudarc::driver::result::device::get(id).map_err(driver_err("cuDeviceGet"))?;
            if !devices.contains(&dev) {
                devices.push(dev);
            }
        }
        let descs: Vec<sys::CUmemAccessDesc> = devices
            .into_iter()
            .map(|dev| sys::CUmemAccessDesc {
                location: device_location(dev),
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            })
            .collect();
        // SAFETY: the span lies inside this reservation and `descs` holds
        // `descs.len()` initialised descriptors that outlive the call.
        let rc = timed(CallKind::SetAccess, || unsafe {
            sys::cuMemSetAccess(self.ptr + offset as u64, size, descs.as_ptr(), descs.len())
        });
        check("cuMemSetAccess", rc)
    }

    /// Unmaps the `size` bytes at `offset` (`cuMemUnmap`), which must be
    /// exactly what one or more [`map`](Self::map) calls mapped. Work still
    /// queued on the device that uses the span must have finished: callers
    /// synchronise first.
    ///
    /// # Errors
    /// [`Error::InvalidState`] for a span outside the range; a driver error.
    pub fn unmap(&self, offset: usize, size: usize) -> Result<()> {
        self.check_inside(offset, size)?;
        bind(&self.ctx)?;
        // SAFETY: the span lies inside this reservation; unmapping device
        // memory invalidates no host reference (none are ever made to it).
        let rc = timed(CallKind::Unmap, || unsafe { sys::cuMemUnmap(self.ptr + offset as u64, size) });
        check("cuMemUnmap", rc)
    }
}

/// An [`AddressRange`] under another name ([`AddressRange::alias`]):
/// dropping it frees no address, only its hold on the context.
pub(crate) struct RangeAlias(std::mem::ManuallyDrop<AddressRange>);

impl std::ops::Deref for RangeAlias {
    type Target = AddressRange;
    fn deref(&self) -> &AddressRange {
        &self.0
    }
}

impl Drop for RangeAlias {
    fn drop(&mut self) {
        // SAFETY: the inner range is never dropped (it is wrapped in
        // `ManuallyDrop`, so its addresses stay the owner's); its context
        // handle is read out exactly once, here, and dropped, which gives
        // back the reference the alias took.
        drop(unsafe { std::ptr::read(&self.0.ctx) });
    }
}

impl Drop for AddressRange {
    fn drop(&mut self) {
        if let Err(e) = bind(&self.ctx) {
            eprintln!("cumem: leaking address range {:#x}+{}: {e}", self.ptr, self.size);
            return;
        }
        // SAFETY: this struct reserved exactly this range and frees it once.
        let rc = unsafe { sys::cuMemAddressFree(self.ptr, self.size) };
        if let Err(e) = check("cuMemAddressFree", rc) {
            eprintln!("cumem: {e} (range {:#x}+{})", self.ptr, self.size);
        }
    }
}

/// Physical device memory with no address of its own (`cuMemCreate` of
/// pinned device memory; `cuMemRelease` on drop).
#[derive(Debug)]
pub struct PhysicalChunk {
    ctx: Arc<CudaContext>,
    handle: sys::CUmemGenericAllocationHandle,
    size: usize,
}

impl PhysicalChunk {
    /// Allocates `size` bytes (a multiple of the minimum
    /// [`granularity`]) of pinned memory on `ctx`'s device (`cuMemCreate`).
    ///
    /// The memory is made exportable to other processes as a POSIX file
    /// descriptor ([`crate::ipc`]) where the device supports it
    /// (`CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`);
    /// if the driver refuses such memory for any reason but lack of memory,
    /// this and every later chunk of the process is made without.
    ///
    /// # Errors
    /// [`Error::InvalidSize`] for an empty size; a driver error, for
    /// example `CUDA_ERROR_OUT_OF_MEMORY` (see [`is_out_of_memory`]).
    pub fn create(ctx: &Arc<CudaContext>, size: usize) -> Result<Self> {
        use crate::sync::{Ordering, StaticAtomicU64};
        /// 1 once the driver refused exportable memory.
        static EXPORT_REFUSED: StaticAtomicU64 = StaticAtomicU64::new(0);
        let exportable = EXPORT_REFUSED.load(Ordering::Relaxed) == 0 && posix_fd_supported(ctx);
        match Self::create_with(ctx, size, exportable) {
            Err(e) if exportable && !is_out_of_memory(&e) => {
                EXPORT_REFUSED.store(1, Ordering::Relaxed);
                Self::create_with(ctx, size, false)
            }
            r => r,
        }
    }

    /// [`create`](Self::create) with the handle type chosen by the caller:
    /// `exportable` asks for memory shareable as a POSIX file descriptor
    /// (and fails where the driver can't make it).
    ///
    /// # Errors
    /// As [`create`](Self::create).
    pub fn create_with(ctx: &Arc<CudaContext>, size: usize, exportable: bool) -> Result<Self> {
        if size == 0 {
            return Err(Error::InvalidSize { size, reason: "a physical chunk can't be empty" });
        }
        crate::fault::check(crate::fault::Point::Create)?;
        bind(ctx)?;
        let prop = pinned_prop(ctx.cu_device(), exportable);
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: `handle` is a valid out-pointer and `prop` a fully
        // initialised property struct that lives across the call.
        let rc = timed(CallKind::Create, || unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) });
        check("cuMemCreate", rc)?;
        Ok(PhysicalChunk { ctx: ctx.clone(), handle, size })
    }

    /// The physical memory another process exported as the POSIX file
    /// descriptor `fd` (`cuMemImportFromShareableHandle`), `size` bytes
    /// long, for mapping in `ctx`. The descriptor stays open (the caller
    /// closes it); the memory lives until this chunk and every mapping of
    /// it are gone, in every process.
    ///
    /// # Errors
    /// A driver error (not a descriptor of exported device memory).
    pub fn import(ctx: &Arc<CudaContext>, fd: std::os::fd::BorrowedFd<'_>, size: usize) -> Result<Self> {
        use std::os::fd::AsRawFd;
        bind(ctx)?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        let kind = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        // SAFETY: `handle` is a valid out-pointer; for POSIX descriptors the
        // driver takes the descriptor's number in place of a pointer and
        // only reads through it (it does not close it).
        let rc = unsafe { sys::cuMemImportFromShareableHandle(&mut handle, fd.as_raw_fd() as usize as *mut _, kind) };
        check("cuMemImportFromShareableHandle", rc)?;
        Ok(PhysicalChunk { ctx: ctx.clone(), handle, size })
    }

    /// The length in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The driver's handle: which memory this is, while it lives.
    pub(crate) fn handle(&self) -> u64 {
        self.handle
    }
}

/// Whether `ctx`'s device can share memory as POSIX file descriptors
/// (`CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`).
pub fn posix_fd_supported(ctx: &CudaContext) -> bool {
    let attr = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED;
    cfg!(unix) && ctx.attribute(attr).is_ok_and(|v| v != 0)
}

/// Exports the physical memory mapped at `addr` (any address inside one
/// mapping made with `cuMemMap`) as a POSIX file descriptor another
/// process can import ([`PhysicalChunk::import`]):
/// `cuMemRetainAllocationHandle`, `cuMemExportToShareableHandle`,
/// `cuMemRelease` of the retained handle.
///
/// # Errors
/// A driver error: nothing mapped there, or no exportable handle type.
pub fn export_mapping(ctx: &CudaContext, addr: u64) -> Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    bind(ctx)?;
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: `handle` is a valid out-pointer; the driver only looks the
    // address up (device memory is never dereferenced on the host).
    check("cuMemRetainAllocationHandle", unsafe { sys::cuMemRetainAllocationHandle(&mut handle, addr as *mut _) })?;
    let mut fd: std::ffi::c_int = -1;
    let kind = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    // SAFETY: for POSIX descriptors the driver writes one `int` through the
    // pointer, which points at `fd`; `handle` is live (retained above).
    let exported =
        unsafe { sys::cuMemExportToShareableHandle(&mut fd as *mut std::ffi::c_int as *mut _, handle, kind, 0) };
    // SAFETY: the retain above took one reference, given back once here.
    let released = unsafe { sys::cuMemRelease(handle) };
    check("cuMemExportToShareableHandle", exported)?;
    check("cuMemRelease", released)?;
    if fd < 0 {
        return Err(Error::InvalidState(format!("cuMemExportToShareableHandle returned descriptor {fd}")));
    }
    // SAFETY: the driver made this descriptor for the caller, its sole owner.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

impl Drop for PhysicalChunk {
    fn drop(&mut self) {
        if let Err(e) = bind(&self.ctx) {
            eprintln!("cumem: leaking physical chunk of {} B: {e}", self.size);
            return;
        }
        // SAFETY: the handle came from cuMemCreate and is released once;
        // mappings that still use it keep the memory alive in the driver.
        let rc = timed(CallKind::Release, || unsafe { sys::cuMemRelease(self.handle) });
        if let Err(e) = check("cuMemRelease", rc) {
            eprintln!("cumem: {e} (chunk of {} B)", self.size);
        }
    }
}

/// Whether `err` is the driver's out-of-memory error.
pub fn is_out_of_memory(err: &Error) -> bool {
    matches!(err, Error::Driver { message, .. } if message.contains("CUDA_ERROR_OUT_OF_MEMORY"))
}

/// The device's free and total memory in bytes (`cuMemGetInfo`).
///
/// # Errors
/// A driver error.
pub fn memory_info(ctx: &CudaContext) -> Result<(usize, usize)> {
    bind(ctx)?;
    timed(CallKind::Query, cudarc::driver::result::mem_get_info).map_err(driver_err("cuMemGetInfo"))
}

/// Waits for all work on `ctx`'s device (`cuCtxSynchronize`), before
/// memory that work may use is unmapped.
///
/// # Errors
/// A driver error (including errors of earlier asynchronous work).
pub fn synchronize(ctx: &CudaContext) -> Result<()> {
    ctx.synchronize().map_err(driver_err("cuCtxSynchronize"))
}
