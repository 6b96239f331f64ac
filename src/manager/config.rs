//! The manager's configuration: a builder, and `CUMEM_CONF` parsing.

use std::path::PathBuf;

use crate::device::DeviceAllocatorMode;
use crate::error::PoolKind;
use crate::error::{Error, Result};
use crate::pool::PoolConfig;

/// Which memory the manager runs on.
///
/// # Examples
/// ```
/// use cumem::{Backend, BackendChoice, Config, MemoryManager};
/// let mm = MemoryManager::new(Config::new().backend(BackendChoice::Host))?;
/// assert!(matches!(mm.backend(), Backend::Host { .. }));
/// # Ok::<(), cumem::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendChoice {
    /// CUDA when a driver and a device are present, else the host fallback.
    #[default]
    Auto,
    /// The host fallback even when a GPU is present.
    Host,
}

/// When the device pools' per-thread caches serve (`CUMEM_CONF` key
/// `device_thread_cache`: `false`, `contended` or `true`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ThreadCache {
    /// No caches: every allocation and free takes the pool's lock.
    Off,
    /// The default: caches start once allocations wait for the pool's lock
    /// again and again ([`WAITS_TO_SERVE`](crate::pool::WAITS_TO_SERVE)
    /// waits within [`WAIT_WINDOW_MS`](crate::pool::WAIT_WINDOW_MS)
    /// milliseconds), and serve from then on. A program whose threads
    /// take turns (one thread, or PyTorch's forward and backward threads)
    /// keeps one exact best fit with nothing parked per thread; threads
    /// that allocate at once get the caches' speed.
    #[default]
    WhenContended,
    /// Caches from the first allocation.
    On,
}

impl std::str::FromStr for ThreadCache {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "contended" | "when_contended" | "auto" => Ok(ThreadCache::WhenContended),
            "1" | "true" | "yes" | "on" => Ok(ThreadCache::On),
            "0" | "false" | "no" | "off" => Ok(ThreadCache::Off),
            other => Err(Error::Config(format!("device_thread_cache: '{other}' is not one of true, false, contended"))),
        }
    }
}

/// Which devices get peer access to which, when their allocators are
/// created (`CUMEM_CONF` key `peer_access`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum PeerAccess {
    /// None (the default): call
    /// [`MemoryManager::enable_peer_access`](crate::MemoryManager::enable_peer_access)
    /// where it is needed.
    #[default]
    None,
    /// Every device to every other device that has a peer path to it
    /// (`peer_access=all`); pairs without one are skipped.
    All,
    /// These `(accessor, owner)` pairs: kernels on the accessor read and
    /// write the owner's memory (`peer_access=1:0;0:1`).
    Pairs(Vec<(usize, usize)>),
}

impl std::str::FromStr for PeerAccess {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("all") {
            return Ok(PeerAccess::All);
        }
        if s.eq_ignore_ascii_case("none") || s.is_empty() {
            return Ok(PeerAccess::None);
        }
        let bad = |item: &str| {
            Error::Config(format!("peer_access: '{item}' is not accessor:owner (examples: all, none, 1:0, 1:0;0:1)"))
        };
        let mut pairs = Vec::new();
        for item in s.split(';').map(str::trim).filter(|i| !i.is_empty()) {
            let (a, b) = item.split_once(':').ok_or_else(|| bad(item))?;
            let a: usize = a.trim().parse().map_err(|_| bad(item))?;
            let b: usize = b.trim().parse().map_err(|_| bad(item))?;
            if a != b && !pairs.contains(&(a, b)) {
                pairs.push((a, b));
            }
        }
        Ok(PeerAccess::Pairs(pairs))
    }
}

/// How the [`MemoryManager`](crate::MemoryManager) is set up. Build it with
/// the methods below, or parse it from a string like
/// `pinned_pool_size=256MiB,device_pool_size=1GiB,mode=sync_pool` (the
/// format of the `CUMEM_CONF` environment variable).
///
/// # Examples
/// ```
/// use cumem::{Config, DeviceAllocatorMode};
/// let c = Config::new().pinned_pool_size(64 << 20).mode(DeviceAllocatorMode::SyncPool);
/// assert_eq!(c, "pinned_pool_size=64MiB,mode=sync_pool".parse().unwrap());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Bytes of pinned memory the first pinned allocation reserves.
    pub pinned_pool_size: usize,
    /// Bytes of device memory the first device allocation reserves.
    pub device_pool_size: usize,
    /// The requested device allocator mode.
    pub mode: DeviceAllocatorMode,
    /// The device used when none is named.
    pub device: usize,
    /// The smallest chunk a pool asks its upstream for.
    pub min_chunk: usize,
    /// How far a remapping device pool's physical memory may rise above
    /// the page floor of its placement before it moves memory rather than
    /// map more, in millionths (`remap_slack=1%`, the default, is 10 000).
    /// See [`PoolConfig::remap_slack_ppm`].
    pub remap_slack_ppm: u32,
    /// The most pinned memory the pool may reserve.
    pub max_pinned_pool_size: Option<usize>,
    /// The most device memory the sync pool may reserve.
    pub max_device_pool_size: Option<usize>,
    /// Free bytes the native memory pools keep cached
    /// (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`).
    pub release_threshold: u64,
    /// Grow the device pool by mapping more memory after its end (CUDA
    /// virtual memory) so it stays one coalescable range.
    pub expandable: bool,
    /// Make the dedicated native pool (`cuda_async_pool` mode) exportable to
    /// other processes ([`crate::ipc`]; POSIX file descriptors). Off by
    /// default: the driver refuses allocations from an exportable pool
    /// inside a CUDA graph capture (`CUDA_ERROR_NOT_SUPPORTED`).
    pub exportable_native_pool: bool,
    /// CUDA or the host fallback.
    pub backend: BackendChoice,
    /// Per-thread caches of freed blocks in front of the pinned pool: fast,
    /// scalable frees and reallocations from many threads. Sizes up to
    /// 4 MiB are rounded to size classes (at most 6.25% more), parked blocks
    /// serve only their thread until flushed, and the pool's peak
    /// statistics become upper bounds. On by default.
    pub pinned_thread_cache: bool,
    /// The same in front of the device pools' sync pool (a block freed on
    /// a stream is cached with its stream's tag; hits need the exact
    /// size). By default they start only once threads contend for the
    /// pool ([`ThreadCache::WhenContended`]): device memory is the scarce
    /// resource, and memory parked per thread is memory other threads
    /// can't use.
    pub device_thread_cache: ThreadCache,
    /// The most bytes one thread's cache parks per pool before it flushes
    /// (256 MiB: on the 8-thread benchmark 97% of requests then hit the
    /// cache; at 64 MiB, 89%).
    pub thread_cache_bytes: usize,
    /// Record where each allocation is made (a backtrace per allocation),
    /// so the shutdown report can say where live memory came from.
    pub track_allocations: bool,
    /// Where to write an event log of every allocation and free, in RMM's
    /// CSV format (see [`EventLog`](crate::log::EventLog)); `None`: no log.
    pub log_path: Option<PathBuf>,
    /// The program promises to register every CUDA graph capture it makes
    /// with cumem ([`MemoryManager::begin_capture`](crate::MemoryManager::begin_capture)
    /// or [`capture_into`](crate::MemoryManager::capture_into))
    /// (`promise_registered_captures=true`). Off by default: then every
    /// device allocation and free on a stream asks the driver whether the
    /// stream captures (`cuStreamGetCaptureInfo`), and a capture cumem was
    /// not told of gets a graph-private pool of its own whose memory stays
    /// the graph's until the graph and its executables are destroyed. With
    /// the promise, the question is asked only while a registered capture
    /// is under way, and a capture begun without telling cumem shares its
    /// memory with work outside the graph (replays overwrite it).
    pub promise_registered_captures: bool,
    /// Peer access applied as each device's allocator is created.
    pub peer_access: PeerAccess,
    /// How many stand-in devices the host fallback offers (at least 1), so
    /// that code for several devices runs and is tested without a GPU.
    /// Ignored on CUDA, where the driver says how many there are.
    pub host_devices: usize,
    /// The device sync pools keep the block freed last uncoalesced until
    /// the next operation, so that an allocation of exactly its size
    /// right after, where best fit would place it anyway, takes it back
    /// with no index work ([`PoolConfig::hot_block`]; on by default).
    /// Placement is best fit's either way.
    pub hot_block: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            pinned_pool_size: 0,
            device_pool_size: 0,
            mode: DeviceAllocatorMode::SyncPool,
            device: 0,
            min_chunk: 2 << 20,
            remap_slack_ppm: crate::pool::DEFAULT_REMAP_SLACK_PPM,
            max_pinned_pool_size: None,
            max_device_pool_size: None,
            release_threshold: u64::MAX,
            expandable: true,
            exportable_native_pool: false,
            backend: BackendChoice::Auto,
            track_allocations: false,
            pinned_thread_cache: true,
            device_thread_cache: ThreadCache::WhenContended,
            thread_cache_bytes: 256 << 20,
            log_path: None,
            promise_registered_captures: false,
            peer_access: PeerAccess::None,
            host_devices: 1,
            hot_block: true,
        }
    }
}

impl Config {
    /// The defaults: pools that start empty and grow in 2 MiB steps or
    /// more, the sync pool mode on device 0, expandable segments, no limits.
    pub fn new() -> Self {
        Self::default()
    }

    /// Reads `CUMEM_CONF`; the defaults when it is unset.
    ///
    /// # Errors
    /// [`Error::Config`] naming the bad key or value.
    pub fn from_env() -> Result<Self> {
        match std::env::var("CUMEM_CONF") {
            Ok(s) => s.parse().map_err(|e| match e {
                Error::Config(m) => Error::Config(format!("CUMEM_CONF: {m}")),
                other => other,
            }),
            Err(std::env::VarError::NotPresent) => Ok(Config::default()),
            Err(std::env::VarError::NotUnicode(_)) => Err(Error::Config("CUMEM_CONF is not valid UTF-8".into())),
        }
    }

    /// The pinned pool's settings under this configuration.
    pub fn pinned_pool_config(&self) -> PoolConfig {
        let mut pc = PoolConfig::new(PoolKind::Pinned);
        pc.initial_size = self.pinned_pool_size;
        pc.min_chunk = self.min_chunk;
        pc.max_size = self.max_pinned_pool_size;
        pc.thread_cache = self.pinned_thread_cache;
        pc.thread_cache_bytes = self.thread_cache_bytes;
        pc
    }

    /// A device sync pool's settings under this configuration.
    pub fn device_pool_config(&self) -> PoolConfig {
        let mut pc = PoolConfig::new(PoolKind::Device);
        pc.initial_size = self.device_pool_size;
        pc.min_chunk = self.min_chunk;
        pc.remap_slack_ppm = self.remap_slack_ppm;
        pc.max_size = self.max_device_pool_size;
        pc.expandable = self.expandable;
        pc.thread_cache = self.device_thread_cache != ThreadCache::Off;
        pc.cache_when_contended = self.device_thread_cache == ThreadCache::WhenContended;
        pc.thread_cache_bytes = self.thread_cache_bytes;
        // Caches from the start serve one thread's exact sizes (no
        // rounding while it runs alone); caches started by contention
        // round to size classes, so that threads allocating varied sizes
        // at once find their blocks.
        pc.cache_exact = self.device_thread_cache == ThreadCache::On;
        pc.hot_block = self.hot_block;
        pc
    }

    /// A graph-private pool's settings: those of the device pool, without
    /// thread caches or an initial reservation, never giving chunks back
    /// on its own (its graphs may replay).
    pub fn graph_pool_config(&self) -> PoolConfig {
        let mut pc = self.device_pool_config();
        pc.initial_size = 0;
        pc.thread_cache = false;
        pc.keep_chunks = true;
        pc
    }

    /// Sets [`Config::promise_registered_captures`].
    pub fn promise_registered_captures(mut self, promise: bool) -> Self {
        self.promise_registered_captures = promise;
        self
    }

    /// Sets [`Config::pinned_pool_size`].
    pub fn pinned_pool_size(mut self, bytes: usize) -> Self {
        self.pinned_pool_size = bytes;
        self
    }
    /// Sets [`Config::device_pool_size`].
    pub fn device_pool_size(mut self, bytes: usize) -> Self {
        self.device_pool_size = bytes;
        self
    }
    /// Sets [`Config::mode`].
    pub fn mode(mut self, mode: DeviceAllocatorMode) -> Self {
        self.mode = mode;
        self
    }
    /// Sets [`Config::device`].
    pub fn device(mut self, ordinal: usize) -> Self {
        self.device = ordinal;
        self
    }
    /// Sets [`Config::min_chunk`].
    pub fn min_chunk(mut self, bytes: usize) -> Self {
        self.min_chunk = bytes;
        self
    }
    /// Sets [`Config::remap_slack_ppm`].
    pub fn remap_slack_ppm(mut self, ppm: u32) -> Self {
        self.remap_slack_ppm = ppm;
        self
    }
    /// Sets [`Config::max_pinned_pool_size`].
    pub fn max_pinned_pool_size(mut self, bytes: usize) -> Self {
        self.max_pinned_pool_size = Some(bytes);
        self
    }
    /// Sets [`Config::max_device_pool_size`].
    pub fn max_device_pool_size(mut self, bytes: usize) -> Self {
        self.max_device_pool_size = Some(bytes);
        self
    }
    /// Sets [`Config::release_threshold`].
    pub fn release_threshold(mut self, bytes: u64) -> Self {
        self.release_threshold = bytes;
        self
    }
    /// Sets [`Config::exportable_native_pool`].
    pub fn exportable_native_pool(mut self, on: bool) -> Self {
        self.exportable_native_pool = on;
        self
    }
    /// Sets [`Config::expandable`].
    pub fn expandable(mut self, on: bool) -> Self {
        self.expandable = on;
        self
    }
    /// Sets both [`Config::pinned_thread_cache`] and
    /// [`Config::device_thread_cache`].
    pub fn thread_cache(mut self, on: bool) -> Self {
        self.pinned_thread_cache = on;
        self.device_thread_cache = if on { ThreadCache::On } else { ThreadCache::Off };
        self
    }
    /// Sets [`Config::pinned_thread_cache`].
    pub fn pinned_thread_cache(mut self, on: bool) -> Self {
        self.pinned_thread_cache = on;
        self
    }
    /// Sets [`Config::thread_cache_bytes`].
    pub fn thread_cache_bytes(mut self, bytes: usize) -> Self {
        self.thread_cache_bytes = bytes;
        self
    }
    /// Sets [`Config::device_thread_cache`]: caches from the first
    /// allocation, or none (the default starts them once threads contend:
    /// [`device_thread_cache_when`](Config::device_thread_cache_when)).
    pub fn device_thread_cache(mut self, on: bool) -> Self {
        self.device_thread_cache = if on { ThreadCache::On } else { ThreadCache::Off };
        self
    }

    /// Sets [`Config::device_thread_cache`].
    pub fn device_thread_cache_when(mut self, when: ThreadCache) -> Self {
        self.device_thread_cache = when;
        self
    }
    /// Sets [`Config::hot_block`].
    pub fn hot_block(mut self, on: bool) -> Self {
        self.hot_block = on;
        self
    }

    /// Sets [`Config::track_allocations`].
    pub fn track_allocations(mut self, on: bool) -> Self {
        self.track_allocations = on;
        self
    }
    /// Sets [`Config::backend`].
    pub fn backend(mut self, backend: BackendChoice) -> Self {
        self.backend = backend;
        self
    }
    /// Sets [`Config::peer_access`].
    pub fn peer_access(mut self, peers: PeerAccess) -> Self {
        self.peer_access = peers;
        self
    }
    /// Sets [`Config::host_devices`].
    pub fn host_devices(mut self, count: usize) -> Self {
        self.host_devices = count;
        self
    }
    /// Sets [`Config::log_path`]: log every allocation and free to `path`.
    pub fn log(mut self, path: impl Into<PathBuf>) -> Self {
        self.log_path = Some(path.into());
        self
    }
}
