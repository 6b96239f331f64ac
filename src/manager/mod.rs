//! [`MemoryManager`]: configuration, dispatch, statistics, shutdown.

mod config;
mod config_text;
mod copies;
mod devices;
mod graphs;
mod heap;
mod logging;
mod sleep;
mod summary;
mod tables;
mod tracking;

#[doc(hidden)]
pub use crate::sync::{InitCell, InitError};
pub use config::{BackendChoice, Config, PeerAccess, ThreadCache};
pub use config_text::parse_size;
pub use graphs::{CaptureScope, CapturedGraph, GraphCapture};
pub use sleep::{SleepReport, WakeReport};
pub use summary::{human_bytes, LiveAllocation, ShutdownReport};
pub use tables::TableSizes;

use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::CudaContext;
use once_cell::sync::OnceCell;

use crate::cuda::{driver_status, DriverStatus, Stream};
use crate::device::{DeviceAllocator, DeviceAllocatorMode, DeviceStats};
use crate::error::{Error, PoolKind, Result};
use crate::log::EventLog;
use crate::pool::{Pool, PoolStats};
use crate::sync::{AtomicBool, Ordering};
use crate::upstream::{CudaPinnedMemory, Geometric, Host, Upstream};

/// A pool over a boxed upstream, as the manager keeps them.
pub(crate) type BoxedPool = Pool<Box<dyn Upstream>>;

/// What memory the manager runs on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    /// The CUDA driver, with this many devices.
    Cuda {
        /// Devices the driver reports.
        devices: usize,
    },
    /// The host fallback: ordinary host memory stands in for pinned and
    /// device memory, and streams run nothing.
    Host {
        /// Why there is no CUDA.
        reason: String,
    },
}

impl Backend {
    /// Whether this is the host fallback.
    pub fn is_host(&self) -> bool {
        matches!(self, Backend::Host { .. })
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Backend::Cuda { devices } => write!(f, "CUDA ({devices} device(s))"),
            Backend::Host { reason } => write!(f, "host fallback, no GPU in use ({reason})"),
        }
    }
}

/// The memory manager: pools of pinned and device memory for all threads.
///
/// Use the process-wide instance: [`MemoryManager::init`] at program start
/// to configure it, or [`MemoryManager::global`], which configures it from
/// `CUMEM_CONF` on first use. Every method may be called from any thread.
///
/// # Examples
/// ```
/// use cumem::MemoryManager;
/// let mm = MemoryManager::global()?;
/// let p = mm.allocate_pinned(4096)?;
/// assert_eq!(p.as_ptr() as usize % 256, 0);
/// mm.free_pinned(p.as_ptr())?;
/// let d = mm.allocate_device(1 << 20)?;
/// mm.free_device(d)?;
/// # Ok::<(), cumem::Error>(())
/// ```
pub struct MemoryManager {
    config: Config,
    backend: Backend,
    pinned: Pool<Box<dyn Upstream>>,
    pinned_ctx: Option<Arc<CudaContext>>,
    /// The managed-memory pool, made on first use (`crate::managed`).
    managed: OnceCell<Pool<Box<dyn Upstream>>>,
    devices: Vec<OnceCell<DeviceAllocator>>,
    /// Device pool sizes set before the device's allocator exists.
    device_pool_size: crate::sync::Mutex<usize>,
    shut_down: AtomicBool,
    sites: Option<tracking::SiteTracker>,
    /// The event log, when `Config::log_path` is set (see `crate::log`).
    pub(crate) log: Option<EventLog>,
    /// What sleeping memory tags left behind; held through a sleep or wake.
    sleep_book: crate::sync::Mutex<sleep::SleepBook>,
}

impl std::fmt::Debug for MemoryManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryManager").field("backend", &self.backend).field("config", &self.config).finish()
    }
}

#[cfg(not(loom))]
static MANAGER: InitCell<MemoryManager> = InitCell::new();

#[cfg(not(loom))]
impl MemoryManager {
    /// Creates the process-wide manager from `config`.
    ///
    /// # Errors
    /// [`Error::AlreadyInitialized`] if it exists already (`init` was called,
    /// or something used [`global`](MemoryManager::global) first); errors of
    /// [`MemoryManager::new`].
    pub fn init(config: Config) -> Result<&'static MemoryManager> {
        MANAGER
            .init(|| MemoryManager::new(config).inspect(|mm| crate::cuda::set_default_ordinal(mm.config.device)))
            .map_err(|e| match e {
                InitError::AlreadySet => Error::AlreadyInitialized,
                InitError::Failed(e) => e,
            })
    }

    /// The process-wide manager if one was made, without making one.
    pub fn global_if_made() -> Option<&'static MemoryManager> {
        MANAGER.get()
    }

    /// The process-wide manager, configured from `CUMEM_CONF` on first use.
    ///
    /// # Errors
    /// A bad `CUMEM_CONF` ([`Error::Config`] naming the key or value), or
    /// an error of [`MemoryManager::new`]. Nothing is created then, and a
    /// later call tries again.
    pub fn global() -> Result<&'static MemoryManager> {
        MANAGER.get_or_init(|| {
            let mm = MemoryManager::new(Config::from_env()?)?;
            crate::cuda::set_default_ordinal(mm.config.device);
            Ok(mm)
        })
    }
}

#[cfg(loom)]
impl MemoryManager {
    /// Under loom there is no process-wide manager (loom objects can't live
    /// in statics); models build managers of their own.
    ///
    /// # Errors
    /// Always [`Error::InvalidState`].
    pub fn init(_config: Config) -> Result<&'static MemoryManager> {
        Err(Error::InvalidState("no process-wide manager under loom".into()))
    }

    /// See [`MemoryManager::init`] under loom.
    ///
    /// # Errors
    /// Always [`Error::InvalidState`].
    pub fn global() -> Result<&'static MemoryManager> {
        Err(Error::InvalidState("no process-wide manager under loom".into()))
    }

    /// Under loom there is never a process-wide manager.
    pub fn global_if_made() -> Option<&'static MemoryManager> {
        None
    }
}

impl MemoryManager {
    /// A manager of its own, outside the singleton (for tests and for
    /// programs that want separate pools). Prefer the singleton: pinned
    /// memory and device pools are process-wide resources.
    ///
    /// # Errors
    /// [`Error::NoSuchDevice`] for a bad device ordinal; a driver error if
    /// the device's context can't be had.
    pub fn new(config: Config) -> Result<MemoryManager> {
        // `CUMEM_FAULTS` arms fault injection once per process.
        static FAULTS_FROM_ENV: once_cell::sync::OnceCell<()> = once_cell::sync::OnceCell::new();
        FAULTS_FROM_ENV.get_or_try_init(|| crate::fault::arm_from_env().map(|_| ()))?;
        let (backend, ctx) = match (config.backend, driver_status()) {
            (BackendChoice::Host, _) => (Backend::Host { reason: "the configuration asks for it".into() }, None),
            (BackendChoice::Auto, DriverStatus::Unavailable(why)) => (Backend::Host { reason: why.clone() }, None),
            (BackendChoice::Auto, DriverStatus::Available { devices }) => {
                let ctx = crate::cuda::device_context(config.device)?;
                (Backend::Cuda { devices: *devices }, ctx)
            }
        };
        let device_count = match &backend {
            Backend::Cuda { devices } => *devices,
            Backend::Host { .. } => config.host_devices.max(1),
        };
        if config.device >= device_count {
            return Err(Error::NoSuchDevice { ordinal: config.device, count: device_count });
        }
        let pinned_config = config.pinned_pool_config();
        // Geometric growth: a large pinned pool in few upstream calls.
        let pinned_inner: Box<dyn Upstream> = match &ctx {
            Some(ctx) => Box::new(CudaPinnedMemory::new(ctx.clone())),
            None => Box::new(Host::new()),
        };
        let pinned_upstream: Box<dyn Upstream> = Box::new(Geometric::new(pinned_inner, pinned_config.max_size));
        Ok(MemoryManager {
            device_pool_size: crate::sync::Mutex::new(config.device_pool_size),
            pinned: Pool::new(pinned_upstream, pinned_config),
            pinned_ctx: ctx,
            managed: OnceCell::new(),
            devices: (0..device_count).map(|_| OnceCell::new()).collect(),

            backend,
            sites: config.track_allocations.then(tracking::SiteTracker::default),
            log: config.log_path.as_ref().map(EventLog::create).transpose()?,
            config,
            shut_down: AtomicBool::new(false),
            sleep_book: crate::sync::Mutex::new(sleep::SleepBook::default()),
        })
    }

    /// The configuration the manager was created with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// What the manager runs on.
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    fn check_running(&self, what: &'static str) -> Result<()> {
        if self.shut_down.load(Ordering::Acquire) {
            Err(Error::ShutDown(what))
        } else {
            Ok(())
        }
    }

    // ---- pinned host memory ----

    /// Allocates `size` bytes of pinned (page-locked) host memory, 256-byte
    /// aligned, from the pinned pool.
    ///
    /// # Errors
    /// [`Error::InvalidSize`] for 0 or absurd sizes, [`Error::ShutDown`],
    /// [`Error::OutOfMemory`].
    pub fn allocate_pinned(&self, size: usize) -> Result<NonNull<u8>> {
        self.allocate_pinned_aligned(size, crate::upstream::BLOCK_ALIGN)
    }

    /// Allocates pinned memory with an alignment of `align` (a power of two
    /// up to [`MAX_ALIGN`](crate::pool::MAX_ALIGN)).
    ///
    /// # Errors
    /// As [`allocate_pinned`](Self::allocate_pinned), plus
    /// [`Error::InvalidAlignment`].
    pub fn allocate_pinned_aligned(&self, size: usize, align: usize) -> Result<NonNull<u8>> {
        let a = self.allocate_pinned_block(size, align)?;
        Ok(NonNull::new(a.addr as *mut u8).expect("pools never hand out address 0"))
    }

    /// Allocates pinned memory, returning the whole block (for `PinnedAlloc`).
    pub(crate) fn allocate_pinned_block(&self, size: usize, align: usize) -> Result<crate::pool::Allocation> {
        self.check_running("pinned allocation")?;
        let r = self.pinned.allocate(size, align);
        self.note_allocation(PoolKind::Pinned, &r.as_ref().map(|a| a.addr as u64), size, 0);
        r
    }

    /// After every allocation attempt: the event log, allocation sites (if on).
    pub(super) fn note_allocation<E>(&self, kind: PoolKind, r: &std::result::Result<u64, E>, size: usize, stream: u64) {
        EventLog::note_allocation(&self.log, r, size, stream);
        if let (Some(t), Ok(addr)) = (&self.sites, r) {
            t.record(kind, *addr as usize);
        }
    }

    /// Bookkeeping after every free attempt (`r` holds the freed size).
    pub(super) fn note_free<E>(&self, kind: PoolKind, r: &std::result::Result<usize, E>, ptr: u64, stream: u64) {
        EventLog::note_free(&self.log, r, ptr, stream);
        if let (Some(t), Ok(_)) = (&self.sites, r) {
            t.forget(kind, ptr as usize);
        }
    }

    /// Returns pinned memory to the pool. The memory must no longer be
    /// used, by the host or by queued copies.
    ///
    /// # Errors
    /// [`Error::DoubleFree`], [`Error::InteriorPointer`],
    /// [`Error::UnknownPointer`] (also for device pointers); no change then.
    pub fn free_pinned(&self, ptr: *mut u8) -> Result<()> {
        let r = self.pinned.deallocate(ptr as usize, crate::tag::StreamTag::NONE).map(|f| f.requested);
        self.note_free(PoolKind::Pinned, &r, ptr as u64, 0);
        r.map(|_| ())
    }

    /// The pinned pool.
    pub fn pinned_pool(&self) -> &Pool<Box<dyn Upstream>> {
        &self.pinned
    }

    /// The managed pool's cell and the default device's context, for
    /// `crate::managed`, which creates the pool on first use.
    pub(crate) fn managed_cell(&self) -> (&OnceCell<BoxedPool>, Option<&Arc<CudaContext>>) {
        (&self.managed, self.pinned_ctx.as_ref())
    }

    /// Sets the bytes the first pinned allocation reserves.
    ///
    /// # Errors
    /// [`Error::ConfigTooLate`] after the first pinned allocation.
    pub fn set_pinned_pool_size(&self, bytes: usize) -> Result<()> {
        self.pinned
            .set_initial_size(bytes)
            .map_err(|_| Error::ConfigTooLate { what: "the pinned pool size", why: crate::pool::FIRST_ALLOCATION })
    }

    // ---- device memory ----

    /// Allocates `size` bytes of device memory on the default device,
    /// usable at once by the host (copies) and by any stream.
    ///
    /// In the stream-ordered modes this waits for the allocation to
    /// complete; pass a stream ([`allocate_device_on`](Self::allocate_device_on))
    /// to avoid that.
    ///
    /// # Errors
    /// [`Error::InvalidSize`], [`Error::ShutDown`], [`Error::OutOfMemory`],
    /// driver errors.
    pub fn allocate_device(&self, size: usize) -> Result<u64> {
        self.check_running("device allocation")?;
        let ordinal = self.config.device;
        let r = self.device(ordinal)?.allocate(size, None);
        self.device_allocated(r, ordinal, size, 0)
    }

    /// Allocates `size` bytes of device memory for work on `stream`: safe to
    /// use by work queued on `stream` from now on. The memory is on the
    /// stream's device ([`Stream::device`]; the default device for a host
    /// queue).
    ///
    /// # Errors
    /// As [`allocate_device`](Self::allocate_device).
    pub fn allocate_device_on(&self, size: usize, stream: &Stream) -> Result<u64> {
        self.check_running("device allocation")?;
        let ordinal = self.ordinal_of(stream);
        let r = self.device(ordinal)?.allocate(size, Some(stream));
        self.device_allocated(r, ordinal, size, stream.cu_stream() as u64)
    }

    /// Frees device memory at once. The caller guarantees that no work
    /// queued on any stream still uses it (for example after synchronising
    /// the stream that used it); use [`free_device_on`](Self::free_device_on)
    /// to free in stream order instead. The memory goes back to the device
    /// that made it, whichever that is.
    ///
    /// # Errors
    /// [`Error::DoubleFree`], [`Error::InteriorPointer`],
    /// [`Error::UnknownPointer`] (also for pinned pointers); no change then.
    pub fn free_device(&self, ptr: u64) -> Result<()> {
        let ordinal = self.config.device;
        let r = self.device(ordinal)?.free(ptr, None);
        self.device_freed(r, ptr, None, ordinal)
    }

    /// Frees device memory in stream order: work queued on `stream` before
    /// this call may still use it; other streams reuse it only after that
    /// work is done. The memory goes back to the device that made it, which
    /// need not be the stream's (the stream's device is asked first).
    ///
    /// # Errors
    /// As [`free_device`](Self::free_device).
    pub fn free_device_on(&self, ptr: u64, stream: &Stream) -> Result<()> {
        let ordinal = self.ordinal_of(stream);
        let r = self.device(ordinal)?.free(ptr, Some(stream));
        self.device_freed(r, ptr, Some(stream), ordinal)
    }

    /// Sets the bytes the first device allocation of the sync pool reserves.
    ///
    /// # Errors
    /// [`Error::ConfigTooLate`] after the first device allocation.
    pub fn set_device_pool_size(&self, bytes: usize) -> Result<()> {
        let mut size = crate::sync::lock(&self.device_pool_size);
        if self.initialised_devices().any(|d| d.pool().used()) {
            return Err(Error::ConfigTooLate { what: "the device pool size", why: crate::pool::FIRST_ALLOCATION });
        }
        for d in self.initialised_devices() {
            d.pool().set_initial_size(bytes)?;
        }
        *size = bytes;
        Ok(())
    }

    /// Requests a device allocator mode for every device; returns the mode
    /// in effect on the default device. Allocations made before stay valid
    /// and are freed by the mode that made them.
    ///
    /// # Errors
    /// An error creating the default device's allocator.
    pub fn set_device_allocator_mode(&self, mode: DeviceAllocatorMode) -> Result<DeviceAllocatorMode> {
        let effective = self.default_device()?.set_mode(mode);
        for (i, cell) in self.devices.iter().enumerate() {
            if i != self.config.device {
                if let Some(d) = cell.get() {
                    d.set_mode(mode);
                }
            }
        }
        Ok(effective)
    }

    /// The mode asked for (by the configuration or
    /// [`set_device_allocator_mode`](Self::set_device_allocator_mode)).
    pub fn requested_device_allocator_mode(&self) -> DeviceAllocatorMode {
        self.default_device().map_or(self.config.mode, |d| d.requested_mode())
    }

    /// The default device's mode in use (`SyncPool` if the one asked can't be).
    pub fn effective_device_allocator_mode(&self) -> DeviceAllocatorMode {
        self.default_device().map_or(DeviceAllocatorMode::SyncPool, |d| d.effective_mode())
    }

    /// Whether the default device supports stream-ordered allocation
    /// (`CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED`).
    pub fn supports_async_device_allocator(&self) -> bool {
        self.default_device().is_ok_and(|d| d.supports_async())
    }

    // ---- statistics ----

    /// The pinned pool's statistics.
    pub fn pinned_stats(&self) -> PoolStats {
        self.pinned.stats()
    }

    /// Device `ordinal`'s statistics.
    ///
    /// # Errors
    /// [`Error::NoSuchDevice`].
    pub fn device_stats(&self, ordinal: usize) -> Result<DeviceStats> {
        Ok(self.device(ordinal)?.stats())
    }

    /// Sets every peak statistic to its current value.
    pub fn reset_peak_stats(&self) {
        self.pinned.reset_peaks();
        for d in self.devices.iter().filter_map(|c| c.get()) {
            d.reset_peaks();
        }
    }

    /// Returns all cached free memory (pinned and device) to the driver.
    /// Returns the bytes released from cumem's own pools.
    ///
    /// # Errors
    /// The first driver error.
    pub fn release_cached(&self) -> Result<usize> {
        let mut released = self.pinned.release_cached()?;
        if let Some(m) = self.managed.get() {
            released += m.release_cached()?;
        }
        for d in self.devices.iter().filter_map(|c| c.get()) {
            released += d.release_cached()?;
        }
        Ok(released)
    }

    /// A readable table of every pool's state (`torch.cuda.memory_summary()`).
    pub fn memory_summary(&self) -> String {
        summary::render(self)
    }

    /// Stops serving allocations, returns all free memory to the driver
    /// (the pinned pool and every initialised device), and reports what is
    /// still live, by device. Live memory stays valid; it is returned to
    /// the driver when freed. Calling it twice is harmless.
    ///
    /// # Errors
    /// A driver error while releasing memory (what could be released, was).
    pub fn shutdown(&self) -> Result<ShutdownReport> {
        self.shut_down.store(true, Ordering::Release);
        self.drop_offloaded();
        let mut report = ShutdownReport::default();
        let before = self.pinned.stats().reserved;
        for b in self.pinned.shutdown()? {
            let site = self.sites.as_ref().and_then(|t| t.site(PoolKind::Pinned, b.addr));
            report.push(PoolKind::Pinned, None, b, site);
        }
        report.released_bytes += before - self.pinned.stats().reserved;
        if let Some(m) = self.managed.get() {
            let before = m.stats().reserved;
            for b in m.shutdown()? {
                report.push(PoolKind::Managed, None, b, None);
            }
            report.released_bytes += before - m.stats().reserved;
        }
        // Every initialised device, even after one fails: the first error
        // (naming its device) is returned once all were tried.
        let mut first_error = None;
        for d in self.devices.iter().filter_map(|c| c.get()) {
            let before = d.pool().stats().reserved;
            match d.shutdown() {
                Ok(live) => {
                    for b in live {
                        let site = self.sites.as_ref().and_then(|t| t.site(PoolKind::Device, b.addr));
                        report.push(PoolKind::Device, Some(d.ordinal()), b, site);
                    }
                }
                Err(e) => {
                    first_error.get_or_insert(e.on_device(d.ordinal()));
                }
            }
            report.released_bytes += before.saturating_sub(d.pool().stats().reserved);
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        self.flush_event_log()?;
        Ok(report)
    }

    /// Whether [`shutdown`](Self::shutdown) was called.
    pub fn is_shut_down(&self) -> bool {
        self.shut_down.load(Ordering::Acquire)
    }

    pub(crate) fn initialised_devices(&self) -> impl Iterator<Item = &DeviceAllocator> {
        self.devices.iter().filter_map(|c| c.get())
    }
}
