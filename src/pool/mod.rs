//! Best-fit pools: the algorithm ([`BestFit`]), a thread-safe [`Pool`] on top.
//!
//! # Implementation details
//!
//! [`BestFit`] is the allocator proper: exact best fit, splitting and
//! coalescing over chunks, all on `&mut self`, no locks, no CUDA.
//! [`Pool`] wraps it in one lock together with an [`Upstream`] and a growth
//! policy. The lock is never held across an upstream call: on a miss the
//! pool books the growth under the lock, drops it, asks the upstream, and
//! takes the lock again to add the chunk (so a slow `cuMemAlloc` never
//! stalls other threads' hits). Because of that the lock is a spin lock
//! (`spin.rs`: its unlock is a plain store), held for one best-fit step.
//!
//! In front of the lock sit optional per-thread caches of freed blocks
//! (`cache.rs`, [`PoolConfig::thread_cache`]): most allocations and frees
//! of blocks up to [`MAX_CACHED_BLOCK`] never take the pool's lock.

mod allocate;
mod best_fit;
mod cache;
mod classes;
mod config;
mod free_index;
mod growth;
mod mapper;
mod page_map;
mod pool_snapshot;
mod queries;
mod remap;
mod sleep;
mod spin;
mod stats;

// Names of lower layers that a program of pools needs, kept here for
// programs (cumem's own code imports them from their owners).
pub use crate::tag::{Fence, FenceMaker, StreamTag, TagOracle};
pub use crate::upstream::BLOCK_ALIGN;
pub use best_fit::{round_size, Allocation, BestFit, FreeError, Freed};
pub use cache::{release_thread_caches, BIN_MAX, LOOK_EVERY, MAX_CACHED_BLOCK, WAITS_TO_SERVE, WAIT_WINDOW_MS};
pub use config::{PoolConfig, DEFAULT_REMAP_SLACK_PPM, MAX_ALIGN};
pub use pool_snapshot::{BlockState, PoolSnapshot, SnapshotBlock};
pub use remap::RANK_LIMIT;
pub use stats::PoolStats;

use crate::error::{Error, Result};
use crate::sync::{Arc, Mutex};
use crate::upstream::Upstream;
use cache::{CacheFree, ThreadCaches};
use spin::{SpinGuard, SpinLock};

/// Why a setting is refused once allocating began ([`Error::ConfigTooLate`]).
pub(crate) const FIRST_ALLOCATION: &str =
    "it must be set before the first allocation from that pool (set it in the Config, or right after init())";

/// A live block still held when a pool shut down.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveBlock {
    /// Its address.
    pub addr: usize,
    /// Its size (rounded).
    pub size: usize,
    /// The size asked for.
    pub requested: usize,
}

#[derive(Debug, Default)]
struct Inner {
    fit: BestFit,
    /// Bytes being obtained from the upstream right now (counted against
    /// `max_size` before they arrive).
    pending_growth: usize,
    shut_down: bool,
    used: bool,
    /// Overrides `PoolConfig::initial_size` (set before first use).
    initial_size: Option<usize>,
    /// Which pages have memory mapped (page remapping; `page_map.rs`).
    pages: page_map::Pages,
}

/// A thread-safe best-fit pool over an upstream.
///
/// # Examples
/// ```
/// use cumem::pool::{Pool, PoolConfig, StreamTag};
/// use cumem::upstream::Host;
/// use cumem::PoolKind;
///
/// let pool = Pool::new(Host::new(), PoolConfig::new(PoolKind::Standalone));
/// let a = pool.allocate(1000, 256)?;
/// assert_eq!(a.size, 1024);
/// assert_eq!(a.addr % 256, 0);
/// pool.deallocate(a.addr, StreamTag::NONE)?;
/// # Ok::<(), cumem::Error>(())
/// ```
pub struct Pool<U: Upstream> {
    inner: Arc<SpinLock<Inner>>,
    cache: Option<Arc<ThreadCaches>>,
    upstream: Arc<U>,
    config: PoolConfig,
    /// Page remapping is on (`remap.rs`).
    remap: bool,
    /// The unit of page remapping: the upstream's granularity, or
    /// `min_chunk` when that is a larger power of two.
    remap_page: usize,
    /// Held across a remap's upstream calls (never with the pool lock
    /// held while waiting for it): one remap at a time.
    remap_lock: Arc<Mutex<()>>,
    /// The pool's job for the background mapper (page remapping only).
    mapper: Option<Arc<mapper::Job<U>>>,
}

impl<U: Upstream> std::fmt::Debug for Pool<U> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("upstream", &self.upstream.name())
            .field("config", &self.config)
            .field("stats", &self.stats())
            .finish()
    }
}

/// Checks a request and returns its size rounded to [`BLOCK_ALIGN`].
///
/// # Errors
/// [`Error::InvalidSize`] for 0 or a size that overflows when rounded;
/// [`Error::InvalidAlignment`] for an alignment that is not a power of two
/// or exceeds [`MAX_ALIGN`].
pub fn validate(size: usize, align: usize) -> Result<usize> {
    if size == 0 {
        return Err(Error::InvalidSize { size, reason: "zero-byte allocations have no address" });
    }
    if !align.is_power_of_two() || align > MAX_ALIGN {
        return Err(Error::InvalidAlignment { align, max: MAX_ALIGN });
    }
    // Half the address space is more than any machine has; refusing it here
    // keeps every later sum from overflowing.
    if size > isize::MAX as usize / 2 {
        return Err(Error::InvalidSize { size, reason: "larger than any memory this machine can have" });
    }
    match round_size(size) {
        Some(rounded) => Ok(rounded),
        None => Err(Error::InvalidSize { size, reason: "overflows when rounded to 256 bytes" }),
    }
}

/// Whether a pool over `upstream` with `config` remaps pages (`remap.rs`):
/// expandable, over an upstream that can remap, and not `keep_chunks`.
pub(crate) fn would_remap(upstream: &dyn Upstream, config: &PoolConfig) -> bool {
    config.expandable && !config.keep_chunks && upstream.can_remap()
}

impl<U: Upstream> Pool<U> {
    /// A pool that takes its chunks from `upstream`.
    pub fn new(upstream: U, config: PoolConfig) -> Self {
        let remap = would_remap(&upstream, &config);
        let gran = upstream.granularity().max(BLOCK_ALIGN);
        let page = if config.min_chunk.is_power_of_two() { gran.max(config.min_chunk) } else { gran };
        let mut fit = BestFit::new();
        if remap {
            fit.count_pages(page);
        }
        fit.set_hot_block(config.hot_block);
        let inner = Arc::new(SpinLock::new(Inner { fit, pages: page_map::Pages::new(page), ..Inner::default() }));
        let on = config.thread_cache && config.thread_cache_bytes > 0;
        let cache = on.then(|| {
            ThreadCaches::new(inner.clone(), config.thread_cache_bytes, config.cache_exact, config.cache_when_contended)
        });
        let upstream = Arc::new(upstream);
        let remap_lock = Arc::new(Mutex::new(()));
        let mapper = remap.then(|| {
            let job = mapper::Job::new(inner.clone(), upstream.clone(), remap_lock.clone(), config.remap_slack_ppm);
            Arc::new(job)
        });
        Pool { inner, cache, upstream, config, remap, remap_page: page, remap_lock, mapper }
    }

    /// Sets what the pool asks when blocks freed on different streams
    /// merge (see [`TagOracle`]): without it such a
    /// block is [`StreamTag::MIXED`] and its reuse on a stream waits for
    /// every stream with work pending.
    pub fn set_tag_oracle(&self, oracle: crate::tag::TagOracle) {
        self.inner.lock().fit.set_tag_oracle(oracle);
    }

    /// Sets what a page move asks for a fence on the requesting stream
    /// ([`FenceMaker`]): with it, memory whose work is queued on that
    /// stream alone moves with no wait for the device (its old mapping
    /// stays until the fence has passed); without it, such a move waits
    /// for the device first. No effect on a pool that does not remap.
    /// Only the first call has an effect.
    pub fn set_fence_maker(&self, fences: FenceMaker) {
        if let Some(job) = &self.mapper {
            let _ = job.fences.set(fences);
        }
    }

    /// The thread caches, while they serve (`cache.rs`: from the start, or
    /// once the pool's lock is contended).
    #[inline(always)]
    fn serving_cache(&self) -> Option<&Arc<ThreadCaches>> {
        self.cache.as_ref().filter(|c| c.serving())
    }

    /// Whether the pool remaps pages (`remap.rs`): expandable, over an
    /// upstream that can remap, and not `keep_chunks`.
    pub fn remaps(&self) -> bool {
        self.remap
    }

    /// The upstream.
    pub fn upstream(&self) -> &U {
        &self.upstream
    }

    /// Runs one step of the background mapper's work for this pool on the
    /// calling thread (`pool/mapper.rs`: an old mapping of moved memory
    /// unmapped); `true` when more is wanted.
    /// For models and tests: the mapper thread runs these steps itself.
    #[doc(hidden)]
    pub fn mapper_step(&self) -> bool {
        self.mapper.as_ref().is_some_and(|job| job.run_step() == mapper::Progress::More)
    }

    /// Closes the mapper's job; waits until its thread let go (shutdown, drop).
    fn stop_mapper(&self) {
        if let Some(job) = &self.mapper {
            job.close();
            mapper::wait_released(job);
            // What the mapper did not get to, after its work.
            self.upstream.unmap_stale(usize::MAX, true);
        }
    }

    /// The configuration.
    pub fn config(&self) -> &PoolConfig {
        &self.config
    }

    /// Whether any allocation was made yet.
    pub fn used(&self) -> bool {
        self.inner.lock().used
    }

    /// Sets the bytes the first allocation reserves.
    ///
    /// # Errors
    /// [`Error::ConfigTooLate`] once the pool has allocated.
    pub fn set_initial_size(&self, bytes: usize) -> Result<()> {
        let mut inner = self.inner.lock();
        if inner.used {
            return Err(Error::ConfigTooLate { what: "the pool size", why: FIRST_ALLOCATION });
        }
        inner.initial_size = Some(bytes);
        Ok(())
    }

    /// Frees the block at `addr`. `tag` names the stream whose queued work
    /// may still use the block (`StreamTag::NONE` if none).
    ///
    /// # Errors
    /// [`Error::DoubleFree`], [`Error::InteriorPointer`] or
    /// [`Error::UnknownPointer`]; the pool is unchanged then.
    #[inline(always)]
    pub fn deallocate(&self, addr: usize, tag: StreamTag) -> Result<Freed> {
        // Lent blocks go back to a thread cache (cache.rs) when they can.
        let lent = match self.serving_cache().map(|c| ThreadCaches::deallocate(c, addr, tag)) {
            Some(CacheFree::Cached(freed)) => return Ok(freed),
            Some(CacheFree::DoubleFree) => return Err(self.free_error(addr, FreeError::DoubleFree)),
            Some(CacheFree::Return(freed)) => Some(freed),
            Some(CacheFree::NotLent) | None => None,
        };
        let mut inner = self.inner.lock();
        let freed = match inner.fit.free(addr, tag) {
            Ok(freed) => lent.unwrap_or(freed),
            Err(e) => {
                drop(inner);
                return Err(self.free_error(addr, e));
            }
        };
        if !inner.shut_down {
            return Ok(freed);
        }
        self.after_shutdown_free(inner, addr, freed)
    }

    /// A free after shutdown, under the pool lock `inner`: nothing is cached
    /// any more, so a chunk goes back once its last block is free.
    #[inline(never)]
    fn after_shutdown_free(&self, mut inner: SpinGuard<'_, Inner>, addr: usize, freed: Freed) -> Result<Freed> {
        if let Some((chunk, _)) = inner.fit.take_free_chunk_at(addr) {
            inner.fit.stats_mut().upstream_frees += 1;
            if self.remap {
                inner.pages.forget(chunk.addr, chunk.size);
            }
            drop(inner);
            self.upstream.deallocate_chunk(chunk)?;
        }
        Ok(freed)
    }

    fn free_error(&self, addr: usize, e: FreeError) -> Error {
        let pool = self.config.kind;
        match e {
            FreeError::DoubleFree => Error::DoubleFree { pool, addr },
            FreeError::Interior { block, size } => Error::InteriorPointer { pool, addr, block, size },
            FreeError::Unknown => Error::UnknownPointer { pool, addr },
        }
    }

    /// Stops serving allocations, returns all free memory to the upstream
    /// and lists the blocks still live (valid; each chunk goes back once
    /// its last block is freed). Twice is harmless.
    ///
    /// # Errors
    /// An upstream error while returning free chunks.
    pub fn shutdown(&self) -> Result<Vec<LiveBlock>> {
        self.inner.lock().shut_down = true;
        self.stop_mapper();
        if let Some(cache) = &self.cache {
            cache.drain_all(true);
        }
        self.release_cached()?;
        let inner = self.inner.lock();
        Ok(inner
            .fit
            .live_blocks()
            .into_iter()
            .map(|(addr, size, requested)| LiveBlock { addr, size, requested })
            .collect())
    }

    /// Whether [`shutdown`](Pool::shutdown) was called.
    pub fn is_shut_down(&self) -> bool {
        self.inner.lock().shut_down
    }
}

impl<U: Upstream> Drop for Pool<U> {
    fn drop(&mut self) {
        // Free chunks go back; chunks with live blocks are leaked on
        // purpose: something may still point into them.
        if let Some(cache) = &self.cache {
            cache.detach();
        }
        self.stop_mapper();
        if let Err(e) = self.release_cached() {
            eprintln!("cumem: releasing a pool's chunks failed: {e}");
        }
    }
}
