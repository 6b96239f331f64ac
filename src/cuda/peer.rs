//! Peer access: letting kernels on one device read and write another
//! device's memory, for every kind of memory cumem hands out.
//!
//! # Implementation details
//!
//! Peer access is a process-wide fact (contexts are the devices' primary
//! contexts), so it is kept in one table: the grants made so far
//! (accessor, owner), the dedicated native pools alive per device, and the
//! CUDA VMM regions alive per device (expandable segments and growable
//! buffers), as weak references. One grant covers:
//!
//! - `cuMemAlloc` memory (sync-pool chunks without expandable segments,
//!   the arena's block when it came from them): the accessor's context
//!   peer access (`cuCtxEnablePeerAccess`) covers all of the owner's
//!   `cuMemAlloc` memory, present and future;
//! - the owner's default pool (`cuMemAllocAsync`) and every dedicated pool
//!   (`cuMemPoolCreate`): `cuMemPoolSetAccess`, which covers the pool's
//!   present and future allocations; pools created later get the table's
//!   grants when they are registered;
//! - memory mapped with `cuMemMap`: context peer access does not reach it.
//!   Each live region gets `cuMemSetAccess` for every mapped piece, and
//!   keeps the accessor in its list, which every later mapping names.
//!
//! **Peer access enabled the CUDA way.** Programs enable peer access with
//! `cuCtxEnablePeerAccess` / `cudaDeviceEnablePeerAccess` (PyTorch does),
//! never telling cumem, and expect every pointer of the owner to be
//! reachable from then on. For `cuMemMap` memory that takes a
//! `cuMemSetAccess` naming the accessor, and the driver offers no way to
//! learn that a context enabled peer access. So every mapping cumem makes
//! (expandable segments, growable buffers, graph pools over them, page
//! remapping, IPC imports) names, in its one `cuMemSetAccess` call, the
//! owner and every device [`reachable_peers`] lists: those that
//! `cuDeviceCanAccessPeer` says can reach the owner (as NCCL maps its own
//! buffers). Memory is reachable before any peer access exists, and stays
//! so, and [`enable_peer_access`] has nothing left to add for it. On one
//! device the list is empty and a mapping names the owner alone, as
//! before.
//!
//! That is not free on a host of several GPUs: a `cuMemSetAccess` naming a
//! peer took about 1 ms (2 to 128 MiB; about 10 ms from 512 MiB) on two
//! H200s against 0.05 to 0.5 ms for the owner alone, up to twice that
//! while the peer's context did not exist yet. A process that never lets
//! another GPU touch its memory (one GPU per process, as in DDP) can set
//! `CUMEM_MAP_PEERS=0`: mappings then name the owner and the devices
//! granted with [`enable_peer_access`] (or `peer_access` in `CUMEM_CONF`)
//! only, and peer access enabled the CUDA way does not reach them.
//!
//! A grant holds the table's lock while it applies itself, and a pool or
//! region registers under the same lock, so each one either sees the grant
//! in the table or is reached by it. The lock is never taken while a
//! region's own lock is held (only the other way round), and it guards no
//! pool: driver calls under it are allowed.

use std::sync::{Arc, Weak};

use cudarc::driver::{result, sys, CudaContext};
use once_cell::sync::{Lazy, OnceCell};

use super::{device_context, driver_err};
use crate::error::{Error, Result};
use crate::sync::{lock, Mutex};

/// Memory mapped with CUDA VMM that can be opened to more devices.
pub(crate) trait PeerMapped: Send + Sync {
    /// Names `peers` (device ordinals) in the access of every piece mapped
    /// now and of every piece mapped later (`cuMemSetAccess`).
    fn set_peers(&self, peers: &[usize]) -> Result<()>;
}

#[derive(Default)]
struct Table {
    /// `(accessor, owner)` pairs granted so far.
    granted: Vec<(usize, usize)>,
    /// Dedicated native pools alive, by owner: the raw handle as an
    /// address (handles are plain identifiers, usable from any thread).
    pools: Vec<(usize, usize)>,
    /// VMM regions alive (or recently dropped), by owner.
    mapped: Vec<(usize, Weak<dyn PeerMapped>)>,
}

impl Table {
    fn peers_of(&self, owner: usize) -> Vec<usize> {
        self.granted.iter().filter(|(_, o)| *o == owner).map(|(a, _)| *a).collect()
    }
}

static TABLE: Lazy<Mutex<Table>> = Lazy::new(|| Mutex::new(Table::default()));

/// The devices granted access to `owner`'s memory so far.
pub fn peers_of(owner: usize) -> Vec<usize> {
    lock(&TABLE).peers_of(owner)
}

/// Whether kernels on device `accessor` can be given access to device
/// `owner`'s memory (`cuDeviceCanAccessPeer`). A device can always access
/// its own memory.
///
/// # Errors
/// [`Error::NoSuchDevice`], [`Error::NeedsGpu`] on the host fallback, or a
/// driver error.
pub fn can_access_peer(accessor: usize, owner: usize) -> Result<bool> {
    let a = device_context(accessor)?.ok_or(Error::NeedsGpu("peer access"))?;
    let b = device_context(owner)?.ok_or(Error::NeedsGpu("peer access"))?;
    if accessor == owner {
        return Ok(true);
    }
    let mut can = 0i32;
    // SAFETY: `can` is a valid out-pointer; both device handles come from
    // live contexts.
    unsafe { sys::cuDeviceCanAccessPeer(&mut can, a.cu_device(), b.cu_device()) }
        .result()
        .map_err(driver_err("cuDeviceCanAccessPeer"))?;
    Ok(can != 0)
}

/// The devices, besides `owner`, whose kernels can reach `owner`'s memory
/// (`cuDeviceCanAccessPeer`): every VMM mapping of `owner` names them in
/// its access (see the module documentation). Asked once per process for
/// every pair of devices (`cuDeviceGet`, no context is created) and kept;
/// empty on one device, on the host fallback, when the driver can't
/// answer, and with `CUMEM_MAP_PEERS=0` in the environment (see the module
/// documentation).
pub(crate) fn reachable_peers(owner: usize) -> &'static [usize] {
    static REACH: OnceCell<Vec<Vec<usize>>> = OnceCell::new();
    let reach = REACH.get_or_init(|| {
        let count = match super::driver_status() {
            _ if !map_peers(std::env::var("CUMEM_MAP_PEERS").ok().as_deref()) => 0,
            super::DriverStatus::Available { devices } => *devices,
            super::DriverStatus::Unavailable(_) => 0,
        };
        let devices: Vec<Option<sys::CUdevice>> =
            (0..count).map(|i| i32::try_from(i).ok().and_then(|i| result::device::get(i).ok())).collect();
        (0..count)
            .map(|o| {
                (0..count)
                    .filter(|&a| a != o)
                    .filter(|&a| {
                        let (Some(dev_a), Some(dev_o)) = (devices[a], devices[o]) else { return false };
                        let mut can = 0i32;
                        // SAFETY: `can` is a valid out-pointer; both handles
                        // come from `cuDeviceGet` of ordinals below the count.
                        let rc = unsafe { sys::cuDeviceCanAccessPeer(&mut can, dev_a, dev_o) };
                        rc.result().is_ok() && can != 0
                    })
                    .collect()
            })
            .collect()
    });
    reach.get(owner).map_or(&[], Vec::as_slice)
}

/// Whether mappings name every reachable peer, from `CUMEM_MAP_PEERS`:
/// on unless it is `0`, `false`, `no` or `off`.
fn map_peers(var: Option<&str>) -> bool {
    !matches!(var.map(str::trim), Some("0" | "false" | "no" | "off"))
}

fn access_desc(device: usize) -> sys::CUmemAccessDesc {
    sys::CUmemAccessDesc {
        location: sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: device as i32 },
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

/// Gives device `accessor` read-write access to the memory of native pool
/// `pool` (`cuMemPoolSetAccess`).
fn pool_set_access(ctx: &CudaContext, pool: sys::CUmemoryPool, accessor: usize) -> Result<()> {
    ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
    let desc = access_desc(accessor);
    // SAFETY: the pool is live (registered pools unregister before they are
    // destroyed, under the table's lock held by every caller; default pools
    // live as long as the device); `desc` is one initialised descriptor.
    unsafe { sys::cuMemPoolSetAccess(pool, &desc, 1) }.result().map_err(driver_err("cuMemPoolSetAccess"))
}

/// Lets kernels on device `accessor` read and write all memory of device
/// `owner` that cumem hands out, now and later: context peer access for
/// `cuMemAlloc` memory (`cuCtxEnablePeerAccess`), `cuMemPoolSetAccess` for
/// the owner's default pool and dedicated pools, `cuMemSetAccess` for every
/// VMM region of the owner (expandable segments, growable buffers).
/// Granting twice is harmless; `accessor == owner` does nothing.
///
/// Access is one-way: call it again with the roles swapped for the other
/// direction.
///
/// # Errors
/// [`Error::PeerAccess`] when the devices can't reach each other;
/// [`Error::NoSuchDevice`]; [`Error::NeedsGpu`] on the host fallback; a
/// driver error (what was applied before it stays applied).
pub fn enable_peer_access(accessor: usize, owner: usize) -> Result<()> {
    if accessor == owner {
        device_context(owner)?;
        return Ok(());
    }
    if !can_access_peer(accessor, owner)? {
        return Err(Error::PeerAccess {
            accessor,
            owner,
            reason: "cuDeviceCanAccessPeer reports no peer path between them (no NVLink or shared PCIe root)".into(),
        });
    }
    let a = device_context(accessor)?.ok_or(Error::NeedsGpu("peer access"))?;
    let b = device_context(owner)?.ok_or(Error::NeedsGpu("peer access"))?;
    let mut table = lock(&TABLE);
    if table.granted.contains(&(accessor, owner)) {
        return Ok(());
    }
    a.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
    // SAFETY: both contexts are live primary contexts; flags must be 0.
    let rc = unsafe { sys::cuCtxEnablePeerAccess(b.cu_ctx(), 0) };
    if rc != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
        rc.result().map_err(|e| Error::PeerAccess {
            accessor,
            owner,
            reason: format!("cuCtxEnablePeerAccess: {e}"),
        })?;
    }
    if b.has_async_alloc() {
        // SAFETY: the device handle comes from a live context.
        let default = unsafe { result::device::get_default_mem_pool(b.cu_device()) }
            .map_err(driver_err("cuDeviceGetDefaultMemPool"))?;
        pool_set_access(&b, default, accessor)?;
    }
    for &(_, pool) in table.pools.iter().filter(|(o, _)| *o == owner) {
        pool_set_access(&b, pool as sys::CUmemoryPool, accessor)?;
    }
    table.mapped.retain(|(_, w)| w.strong_count() > 0);
    let regions: Vec<Arc<dyn PeerMapped>> =
        table.mapped.iter().filter(|(o, _)| *o == owner).filter_map(|(_, w)| w.upgrade()).collect();
    let mut peers = table.peers_of(owner);
    peers.push(accessor);
    let applied = regions.iter().try_for_each(|r| r.set_peers(&peers));
    if applied.is_ok() {
        table.granted.push((accessor, owner));
    }
    drop(table);
    // A region whose owner let go meanwhile is dropped here, outside the
    // lock.
    drop(regions);
    applied
}

/// Registers a dedicated native pool of device `owner` and gives it the
/// access granted so far.
///
/// # Errors
/// A driver error from `cuMemPoolSetAccess` (the pool is not registered
/// then).
pub(crate) fn register_pool(ctx: &CudaContext, pool: sys::CUmemoryPool) -> Result<()> {
    let owner = ctx.ordinal();
    let mut table = lock(&TABLE);
    for peer in table.peers_of(owner) {
        pool_set_access(ctx, pool, peer)?;
    }
    table.pools.push((owner, pool as usize));
    Ok(())
}

/// Forgets a dedicated pool, before it is destroyed.
pub(crate) fn unregister_pool(pool: sys::CUmemoryPool) {
    lock(&TABLE).pools.retain(|(_, p)| *p != pool as usize);
}

/// Registers a VMM region of device `owner` and gives it the access granted
/// so far (a fresh region maps nothing yet, so this only records the
/// peers for its future mappings).
///
/// # Errors
/// A driver error from `cuMemSetAccess`.
pub(crate) fn register_mapped<T: PeerMapped + 'static>(owner: usize, region: &Arc<T>) -> Result<()> {
    let mut table = lock(&TABLE);
    let peers = table.peers_of(owner);
    if !peers.is_empty() {
        region.set_peers(&peers)?;
    }
    table.mapped.retain(|(_, w)| w.strong_count() > 0);
    let weak: Weak<dyn PeerMapped> = Arc::downgrade(region) as Weak<dyn PeerMapped>;
    table.mapped.push((owner, weak));
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn cumem_map_peers_turns_the_map_time_grant_off() {
        assert!(super::map_peers(None));
        assert!(super::map_peers(Some("1")));
        for off in ["0", "false", "no", "off", " 0 "] {
            assert!(!super::map_peers(Some(off)), "{off}");
        }
    }
}
