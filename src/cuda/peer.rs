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
//! `cudaDeviceEnablePeerAccess` (PyTorch does), never telling cumem, and
//! expect every pointer of the owner to be reachable from then on. For
//! `cuMemMap` memory that takes a `cuMemSetAccess` naming the accessor;
//! the driver can't say that a context enabled peer access, and naming a
//! peer is dear (about 1 ms a mapping against well under 1 ms for the
//! owner alone: docs/multi-gpu.md#peer-access-enabled-the-cuda-way). So a
//! mapping's one `cuMemSetAccess` names the owner, the peers granted with
//! [`enable_peer_access`] (or `peer_access` in `CUMEM_CONF`), and the
//! peers that can reach the owner (`cuDeviceCanAccessPeer`) whose primary
//! context is active (`cuDevicePrimaryCtxGetState`): a kernel runs, and
//! peer access is enabled, only from a device whose context exists. A
//! process using one GPU (as in DDP) names no peer and pays nothing.
//!
//! cumem follows peers that become active: before it maps (a region
//! reserved or grown, a piece mapped or remapped, an IPC import), with no
//! pool or region lock held, [`follow_active_peers`] looks for reachable
//! peers not yet seen active; one active now gets access to the live
//! regions of every device it can reach, and later mappings name it. Once
//! all peers are seen this costs one relaxed load. The follow grant makes
//! only the `cuMemSetAccess` calls: no context peer access (the program's
//! own `cudaDeviceEnablePeerAccess` would fail "already enabled"), no
//! native pools (context peer access does not reach them in CUDA either).
//!
//! What remains: memory mapped before a peer's context existed becomes
//! reachable from it at cumem's next mapping on any device, or at an
//! explicit grant. A program that reads such memory from the peer with no
//! cumem mapping in between must call [`enable_peer_access`]
//! (`cumem_enable_peer_access`; cumem_torch does it in PyTorch's
//! `enablePeerAccess` hook). IPC imports name the peers known when opened.
//!
//! `CUMEM_MAP_PEERS` (read once) picks the peers a mapping names besides
//! the owner and the explicit grants: `active` (the default, above),
//! `all` (every reachable peer, from the start: sound for any program,
//! dear on every mapping), `0` / `off` (explicit grants only).
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
use crate::sync::{lock, Mutex, StaticAtomicU64};

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
    /// `(accessor, owner)` pairs given to the owner's VMM regions because
    /// the accessor's context became active ([`follow_active_peers`]).
    followed: Vec<(usize, usize)>,
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

    /// The peers the owner's VMM regions name: granted or followed.
    fn mapped_peers_of(&self, owner: usize) -> Vec<usize> {
        let mut peers = self.peers_of(owner);
        for &(a, _) in self.followed.iter().filter(|(_, o)| *o == owner) {
            if !peers.contains(&a) {
                peers.push(a);
            }
        }
        peers
    }

    /// Gives `accessor` access to every live VMM region of `owner`, beside
    /// the peers they name already. The regions are moved to `keep`, to be
    /// dropped once the table's lock is let go (a region whose owner let go
    /// meanwhile unmaps in its drop).
    fn open_regions(&mut self, accessor: usize, owner: usize, keep: &mut Vec<Arc<dyn PeerMapped>>) -> Result<()> {
        self.mapped.retain(|(_, w)| w.strong_count() > 0);
        let from = keep.len();
        keep.extend(self.mapped.iter().filter(|(o, _)| *o == owner).filter_map(|(_, w)| w.upgrade()));
        let mut peers = self.mapped_peers_of(owner);
        peers.push(accessor);
        keep[from..].iter().try_for_each(|r| r.set_peers(&peers))
    }
}

static TABLE: Lazy<Mutex<Table>> = Lazy::new(|| Mutex::new(Table::default()));

/// The devices granted access to `owner`'s memory so far.
pub fn peers_of(owner: usize) -> Vec<usize> {
    lock(&TABLE).peers_of(owner)
}

/// Whether kernels on device `accessor` can be given access to device
/// `owner`'s memory (`cuDeviceCanAccessPeer`; always for its own).
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
    // SAFETY: `can` is a local; both device handles are of live contexts.
    unsafe { sys::cuDeviceCanAccessPeer(&mut can, a.cu_device(), b.cu_device()) }
        .result()
        .map_err(driver_err("cuDeviceCanAccessPeer"))?;
    Ok(can != 0)
}

/// Which peers a mapping names besides the owner and the explicit grants
/// (`CUMEM_MAP_PEERS`; see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MapPeers {
    /// Every device that can reach the owner, from the start.
    All,
    /// The reachable devices whose primary context is active (the default).
    Active,
    /// None: explicit grants only.
    Off,
}

/// Reads `CUMEM_MAP_PEERS`: unset, empty, `active`, `1`, `on`, `true`,
/// `yes` → [`MapPeers::Active`]; `all` → [`MapPeers::All`]; `0`, `off`,
/// `false`, `no`, `none` → [`MapPeers::Off`]; anything else is an error
/// naming the choices.
fn parse_map_peers(var: Option<&str>) -> std::result::Result<MapPeers, String> {
    match var.map(|v| v.trim().to_ascii_lowercase()).as_deref() {
        None | Some("" | "active" | "1" | "on" | "true" | "yes") => Ok(MapPeers::Active),
        Some("all") => Ok(MapPeers::All),
        Some("0" | "off" | "false" | "no" | "none") => Ok(MapPeers::Off),
        Some(other) => Err(format!("CUMEM_MAP_PEERS={other} is not one of active, all, off")),
    }
}

/// The peer facts of this process, asked once: the mode, and which devices
/// reach which (`cuDeviceCanAccessPeer` via `cuDeviceGet`: no context).
struct Reach {
    mode: MapPeers,
    /// By owner: the other devices that can reach it.
    peers: Vec<Vec<usize>>,
    /// The devices (below 64) that can reach another: those to follow.
    followers: u64,
    /// The device handles, by ordinal.
    devices: Vec<Option<sys::CUdevice>>,
}

fn reach() -> &'static Reach {
    static REACH: OnceCell<Reach> = OnceCell::new();
    REACH.get_or_init(|| {
        let mode = parse_map_peers(std::env::var("CUMEM_MAP_PEERS").ok().as_deref()).unwrap_or_else(|e| {
            eprintln!("cumem: {e}; using active");
            MapPeers::Active
        });
        let count = match super::driver_status() {
            super::DriverStatus::Available { devices } => *devices,
            super::DriverStatus::Unavailable(_) => 0,
        };
        let devices: Vec<Option<sys::CUdevice>> =
            (0..count).map(|i| i32::try_from(i).ok().and_then(|i| result::device::get(i).ok())).collect();
        let peers: Vec<Vec<usize>> = (0..count)
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
            .collect();
        let followers = peers.iter().flatten().filter(|&&a| a < 64).fold(0u64, |m, &a| m | 1 << a);
        Reach { mode, peers, followers, devices }
    })
}

/// The devices, besides `owner`, whose kernels can reach `owner`'s memory
/// (`cuDeviceCanAccessPeer`), asked once per process; empty on one device,
/// on the host fallback and when the driver can't answer.
fn reachable_peers(owner: usize) -> &'static [usize] {
    reach().peers.get(owner).map_or(&[], Vec::as_slice)
}

/// The peers a fresh VMM region of `owner` starts with, before the table's
/// grants: every reachable one under `CUMEM_MAP_PEERS=all`, else none.
pub(crate) fn initial_peers(owner: usize) -> Vec<usize> {
    match reach().mode {
        MapPeers::All => reachable_peers(owner).to_vec(),
        MapPeers::Active | MapPeers::Off => Vec::new(),
    }
}

/// The devices every new mapping of `owner`'s memory names besides the
/// owner: those granted with [`enable_peer_access`], those followed
/// because their context became active (`CUMEM_MAP_PEERS=active`, the
/// default), or every reachable one (`CUMEM_MAP_PEERS=all`). A process
/// that uses one GPU gets an empty list.
pub fn mapped_peers(owner: usize) -> Vec<usize> {
    let mut peers = lock(&TABLE).mapped_peers_of(owner);
    for p in initial_peers(owner) {
        if !peers.contains(&p) {
            peers.push(p);
        }
    }
    peers
}

/// The followers (a mask of devices) seen active and given access to the
/// regions of every device they reach. Only ever gains bits. A cache:
/// what it stands for is published by the table's and the regions' locks
/// (a thread that reads a bit set after a grant took and let go those
/// locks later, so it sees the grant), never by this atomic's ordering.
static SEEN_ACTIVE: StaticAtomicU64 = StaticAtomicU64::new(0);

/// Of the devices in `followers` not in `seen`, those `active` says are
/// active now (asked once each; nothing asked when all are seen).
fn newly_active(followers: u64, seen: u64, mut active: impl FnMut(usize) -> bool) -> u64 {
    let mut pending = followers & !seen;
    let mut found = 0;
    while pending != 0 {
        let d = pending.trailing_zeros() as usize;
        pending &= pending - 1;
        if active(d) {
            found |= 1 << d;
        }
    }
    found
}

/// Whether `device`'s primary context is active (`cuDevicePrimaryCtxGetState`;
/// creates nothing).
fn primary_active(device: Option<sys::CUdevice>) -> bool {
    let Some(dev) = device else { return false };
    let (mut flags, mut active) = (0u32, 0i32);
    // SAFETY: both are valid out-pointers; the handle comes from `cuDeviceGet`.
    let rc = unsafe { sys::cuDevicePrimaryCtxGetState(dev, &mut flags, &mut active) };
    rc.result().is_ok() && active != 0
}

/// Follows peers that became active (`CUMEM_MAP_PEERS=active`, the
/// default): each device that can reach another, not seen active before
/// and whose primary context is active now, is given access to the live
/// VMM regions of every device it can reach (`cuMemSetAccess`), and their
/// later mappings name it. Called before cumem maps, with no pool lock and
/// no region lock held (it takes the table's lock, then each region's).
/// One relaxed load when every follower has been seen.
///
/// # Errors
/// A driver error from `cuMemSetAccess` (the next mapping asks again).
pub(crate) fn follow_active_peers() -> Result<()> {
    let reach = reach();
    if reach.mode != MapPeers::Active || reach.followers == 0 {
        return Ok(());
    }
    let seen = SEEN_ACTIVE.load(std::sync::atomic::Ordering::Relaxed);
    if reach.followers & !seen == 0 {
        return Ok(());
    }
    let found = newly_active(reach.followers, seen, |d| primary_active(reach.devices[d]));
    if found == 0 {
        return Ok(());
    }
    let mut keep = Vec::new();
    let mut table = lock(&TABLE);
    let mut applied = Ok(());
    for accessor in (0..64).filter(|d| found & 1 << d != 0) {
        let owners = reach.peers.iter().enumerate().filter(|(_, p)| p.contains(&accessor)).map(|(o, _)| o);
        for owner in owners {
            if table.followed.contains(&(accessor, owner)) || table.granted.contains(&(accessor, owner)) {
                continue;
            }
            applied = table.open_regions(accessor, owner, &mut keep);
            if applied.is_err() {
                break;
            }
            table.followed.push((accessor, owner));
        }
        if applied.is_err() {
            break;
        }
        SEEN_ACTIVE.fetch_or(1 << accessor, std::sync::atomic::Ordering::Relaxed);
    }
    drop(table);
    drop(keep);
    applied
}

fn access_desc(device: usize) -> sys::CUmemAccessDesc {
    sys::CUmemAccessDesc {
        location: sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: device as i32 },
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

/// Gives `accessor` read-write access to `pool` (`cuMemPoolSetAccess`).
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
/// Access is one-way: swap the roles for the other direction.
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
    let mut regions = Vec::new();
    let applied = table.open_regions(accessor, owner, &mut regions);
    if applied.is_ok() {
        table.granted.push((accessor, owner));
    }
    drop(table);
    // A region whose owner let go meanwhile drops here, outside the lock.
    drop(regions);
    applied
}

/// Registers a dedicated native pool of `owner`, with the access so far.
///
/// # Errors
/// A driver error from `cuMemPoolSetAccess` (the pool is not registered).
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
    let peers = table.mapped_peers_of(owner);
    if !peers.is_empty() {
        region.set_peers(&peers)?;
    }
    table.mapped.retain(|(_, w)| w.strong_count() > 0);
    let weak: Weak<dyn PeerMapped> = Arc::downgrade(region) as Weak<dyn PeerMapped>;
    table.mapped.push((owner, weak));
    Ok(())
}

#[cfg(test)]
mod tests;
