//! Device allocation: the three modes and the switch among them.
//!
//! # Implementation details
//!
//! Each device has one [`DeviceAllocator`]. Its sync pool is a
//! [`Pool`](crate::pool::Pool) over device memory; the two stream-ordered
//! modes go to the driver's pools. Allocations made by the stream-ordered
//! modes are recorded (address → mode) so that a free always reaches the
//! mode that made the allocation, whatever the mode is now, and so that bad
//! frees are caught before they reach the driver.
//!
//! Stream order in the sync pool: a block freed on stream S carries S's tag.
//! When it is handed out for work on stream T ≠ S, T first waits for the
//! work S had queued (an event recorded on S now, which covers everything
//! queued before the free); handed out with no stream, the host waits for S.

use std::sync::Arc;

use cudarc::driver::CudaContext;
use once_cell::sync::OnceCell;

use super::async_book::AsyncBook;
use super::captures::{GraphPoolFactory, Graphs};
use super::driver_pools::DriverPools;
use super::mode::DeviceAllocatorMode;
use super::native_pool::{NativePool, NativePoolOptions};
use super::pins::Pins;
use super::reuse::StreamRegistry;
use super::tags::{self, TagPoolFactory, TagPools};
use crate::cuda::{driver_err, Stream};
use crate::error::{Error, PoolKind, Result};
use crate::pool::{Allocation, LiveBlock, Pool};
use crate::sync::{lock, AtomicU8, AtomicUsize, Mutex, Ordering};
use crate::tag::StreamTag;
use crate::upstream::Upstream;
use crate::upstream::BLOCK_ALIGN;

/// How many blocks an allocation sets aside because their last use is
/// queued on a capturing stream before it gives up (`Error::Capture`).
const PARKED_MAX: usize = 8;

/// The allocator of one device (or of the host fallback's stand-in device).
pub struct DeviceAllocator {
    ordinal: usize,
    pub(super) ctx: Option<Arc<CudaContext>>,
    pub(super) pool: Pool<Box<dyn Upstream>>,
    supports_async: bool,
    requested: AtomicU8,
    effective: AtomicU8,
    /// The driver pools of the stream-ordered modes (`driver_pools.rs`).
    driver: DriverPools,
    internal_stream: OnceCell<Stream>,
    /// Stream-ordered allocations (address → size, mode), figures; one lock.
    pub(super) async_book: Mutex<AsyncBook>,
    /// How many stream-ordered allocations are live: frees skip the book's
    /// lock while it is 0 (the sync pool's frees, most of the time).
    pub(super) async_live: AtomicUsize,
    pub(super) streams: Arc<StreamRegistry>,
    /// Graph-private pools and the captures routed into them (captures.rs).
    pub(super) graphs: Graphs,
    /// Blocks exported to other processes, pinned (pins.rs, exports.rs).
    pub(super) exports: Pins,
    /// The pools of memory tags (tags.rs, tagged.rs).
    pub(super) tags: TagPools,
}

impl std::fmt::Debug for DeviceAllocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceAllocator")
            .field("ordinal", &self.ordinal)
            .field("cuda", &self.ctx.is_some())
            .field("requested", &self.requested_mode())
            .field("effective", &self.effective_mode())
            .finish()
    }
}

impl DeviceAllocator {
    /// An allocator for device `ordinal` (`ctx` is `None` on the host
    /// fallback) whose sync pool draws on `pool`. Every call on a stream
    /// asks whether the stream captures a graph, and a capture cumem was not
    /// told of gets a private pool made by `make_graph_pool`, unless
    /// `promise_registered_captures` is set (then only registered captures
    /// are routed). Tagged allocations go to `make_tag_pool`'s pools.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        ordinal: usize,
        ctx: Option<Arc<CudaContext>>,
        pool: Pool<Box<dyn Upstream>>,
        mode: DeviceAllocatorMode,
        native_options: NativePoolOptions,
        promise_registered_captures: bool,
        make_graph_pool: Option<GraphPoolFactory>,
        make_tag_pool: Option<TagPoolFactory>,
    ) -> Self {
        let supports_async = ctx.as_ref().is_some_and(|c| c.has_async_alloc());
        let a = DeviceAllocator {
            ordinal,
            driver: DriverPools::new(ctx.clone(), native_options),
            ctx,
            pool,
            supports_async,
            requested: AtomicU8::new(0),
            effective: AtomicU8::new(0),
            internal_stream: OnceCell::new(),
            async_book: Mutex::new(AsyncBook::default()),
            async_live: AtomicUsize::new(0),
            streams: Arc::new(StreamRegistry::default()),
            graphs: Graphs::new(!promise_registered_captures, make_graph_pool),
            exports: Pins::default(),
            tags: TagPools::new(make_tag_pool),
        };
        // A block merged from blocks freed on a stream whose work is known
        // complete and one freed on another stream keeps only the latter's
        // tag (instead of a MIXED tag that waits for every stream).
        let streams = a.streams.clone();
        a.pool.set_tag_oracle(Arc::new(move |t| streams.completed(t)));
        // Page moves of memory whose work is queued on one stream wait for a
        // fence there on the device, not for the device (`cuda/fence.rs`).
        let streams = a.streams.clone();
        a.pool.set_fence_maker(Arc::new(move |on, then| streams.fence_on(on, then)));
        a.set_mode(mode);
        a
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The CUDA context, `None` on the host fallback.
    pub fn context(&self) -> Option<&Arc<CudaContext>> {
        self.ctx.as_ref()
    }

    /// The sync pool: one pool for every thread (with per-thread caches
    /// where [`Config::device_thread_cache`](crate::Config::device_thread_cache)
    /// is on).
    pub fn pool(&self) -> &Pool<Box<dyn Upstream>> {
        &self.pool
    }

    /// The stream registry's size: streams held, and ids of streams let
    /// go that are remembered ([`TableSizes`](crate::manager::TableSizes)).
    pub fn stream_table_sizes(&self) -> (usize, usize) {
        self.streams.sizes()
    }

    /// Whether the device supports stream-ordered allocation
    /// (`CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED`).
    pub fn supports_async(&self) -> bool {
        self.supports_async
    }

    /// Requests `mode`; returns the mode in effect, which is `SyncPool` when
    /// the device can't do stream-ordered allocation. Live allocations stay
    /// valid and are freed by the mode that made them.
    pub fn set_mode(&self, mode: DeviceAllocatorMode) -> DeviceAllocatorMode {
        let effective = if mode != DeviceAllocatorMode::SyncPool && !self.supports_async {
            DeviceAllocatorMode::SyncPool
        } else {
            mode
        };
        self.requested.store(mode.to_u8(), Ordering::Relaxed);
        self.effective.store(effective.to_u8(), Ordering::Release);
        effective
    }

    /// The mode asked for.
    pub fn requested_mode(&self) -> DeviceAllocatorMode {
        DeviceAllocatorMode::from_u8(self.requested.load(Ordering::Relaxed))
    }

    /// The mode in use.
    pub fn effective_mode(&self) -> DeviceAllocatorMode {
        DeviceAllocatorMode::from_u8(self.effective.load(Ordering::Acquire))
    }

    /// The driver pools of the stream-ordered modes.
    pub(super) fn driver_pools(&self) -> &DriverPools {
        &self.driver
    }

    pub(super) fn require_ctx(&self) -> Result<&Arc<CudaContext>> {
        self.ctx.as_ref().ok_or(Error::NeedsGpu("stream-ordered allocation"))
    }

    /// The device's own stream (made on first use) for cumem's internal
    /// work; it never captures and is never the legacy stream.
    ///
    /// # Errors
    /// [`Error::NeedsGpu`] on the host fallback; a driver error.
    pub(crate) fn internal_stream(&self) -> Result<&Stream> {
        let ctx = self.require_ctx()?;
        self.internal_stream
            .get_or_try_init(|| ctx.new_stream().map(Stream::from_cudarc).map_err(driver_err("cuStreamCreate")))
    }

    /// The stream a stream-ordered call runs on: `stream` when it is a
    /// CUDA stream of this device, else the device's internal stream
    /// (which callers order against another device's stream with events).
    pub(super) fn ordering_stream<'a>(&'a self, stream: Option<&'a Stream>) -> Result<&'a Stream> {
        match stream {
            Some(s) if !s.is_host() && s.device() == Some(self.ordinal) => Ok(s),
            _ => self.internal_stream(),
        }
    }

    /// The dedicated native pool, created on first use.
    ///
    /// # Errors
    /// [`Error::NeedsGpu`] on the host fallback; a driver error.
    pub fn native_pool(&self) -> Result<&NativePool> {
        self.driver
            .get(DeviceAllocatorMode::CudaAsyncPool)?
            .ok_or(Error::InvalidState("the cuda_async_pool mode has no native pool".into()))
    }

    /// The driver pool of `mode`, made now if it does not exist yet
    /// (`None` for the sync pool, which has none): a replay or a benchmark
    /// makes it before it starts timing.
    ///
    /// # Errors
    /// [`Error::NeedsGpu`] on the host fallback for a stream-ordered mode;
    /// a driver error.
    pub fn mode_pool(&self, mode: DeviceAllocatorMode) -> Result<Option<&NativePool>> {
        self.driver.get(mode)
    }

    /// Allocates `size` bytes for work on `stream` (`None`: usable at once).
    ///
    /// # Errors
    /// Invalid sizes, [`Error::OutOfMemory`], driver errors.
    // Inlined into the manager's entry points, with the sync pool's path
    // and the pool's placement: the common case then returns its address
    // in a register instead of a result written to memory and copied
    // back, which stalled the caller's loads (see docs/results.md).
    #[inline(always)]
    pub fn allocate(&self, size: usize, stream: Option<&Stream>) -> Result<u64> {
        if let Some(s) = stream.filter(|_| self.graphs.watching()) {
            if let Some((capture, p)) = self.capture_for(s)? {
                // A capture's allocations come from its graph-private pool
                // (the sync pool mode) or become graph memory nodes.
                return match self.effective_mode() {
                    DeviceAllocatorMode::SyncPool => self.allocate_private(&p.pool, &p.streams, size, s),
                    mode => self.allocate_stream_ordered(size, stream, mode, capture),
                };
            }
        }
        self.settle_graph_releases();
        if tags::tagged() {
            return self.allocate_tagged(size, stream);
        }
        match self.effective_mode() {
            // The default mode, called directly: the pool's path inlines here.
            DeviceAllocatorMode::SyncPool => self.allocate_sync_pool(size, stream),
            mode => self.allocate_stream_ordered(size, stream, mode, 0),
        }
    }

    /// Allocates for work on capturing stream `s` from a graph-private pool
    /// (`pool` with the registry of the streams that freed into it).
    fn allocate_private(
        &self,
        pool: &Pool<Box<dyn Upstream>>,
        streams: &StreamRegistry,
        size: usize,
        s: &Stream,
    ) -> Result<u64> {
        let a = pool.allocate_for(size, BLOCK_ALIGN, s.id())?;
        if let Some(ctx) = &self.ctx {
            // Only streams of this capture freed into the pool since it
            // began: an event edge between them is legal inside the capture.
            if let Err(e) = streams.order_reuse(a.tag, Some(s), ctx, false) {
                let _ = pool.deallocate(a.addr, a.tag);
                return Err(e);
            }
        }
        Ok(a.addr as u64)
    }

    /// Allocates from the device's sync pool, ordering the block's reuse
    /// on `stream` after the work of the stream that freed it.
    #[inline(always)]
    fn allocate_sync_pool(&self, size: usize, stream: Option<&Stream>) -> Result<u64> {
        let want = stream.filter(|s| !s.is_host()).map_or(0, Stream::id);
        let a = match self.pool.allocate_quick(size, BLOCK_ALIGN, want) {
            Some(a) => a,
            None => self.allocate_sync_pool_slow(size, want, stream)?,
        };
        match &self.ctx {
            Some(ctx) if !StreamRegistry::reuse_is_ordered(a.tag, stream) => {
                self.order_reuse_or_park(a, size, want, stream, ctx)
            }
            _ => Ok(a.addr as u64),
        }
    }

    /// [`allocate_sync_pool`](Self::allocate_sync_pool) past the pool's
    /// common case: growth, and out of memory, the release of what the
    /// device caches elsewhere and one more try.
    ///
    /// The requesting stream is registered first (one atomic load once it
    /// is): a page move here takes memory freed on other streams behind a
    /// fence that this stream waits for, which needs its handle, so a
    /// stream that has never freed doesn't make the move wait for the
    /// whole device.
    #[inline(never)]
    fn allocate_sync_pool_slow(&self, size: usize, want: u64, stream: Option<&Stream>) -> Result<Allocation> {
        if let Some(s) = stream.filter(|s| !s.is_host()) {
            self.streams.register(s);
        }
        match self.pool.allocate_past_quick(size, BLOCK_ALIGN, want) {
            Err(Error::OutOfMemory { .. })
                if self.ctx.is_some() && !self.capture_under_way()? && self.holds_cached_memory() =>
            {
                // The pool already released its own free chunks; memory may
                // also sit in the native pools, or in chunks whose blocks
                // were waiting on streams. Release all of it (after the
                // streams' work), then try once more.
                self.release_cached()?;
                self.pool.allocate_for(size, BLOCK_ALIGN, want)
            }
            other => other,
        }
    }

    /// Orders the reuse of block `a` after the work of the stream that
    /// freed it. A block whose last use is queued on a stream that
    /// captures now can't be waited for: it is parked (kept allocated) and
    /// another taken, a few times, then the parked ones go back.
    #[inline(never)]
    fn order_reuse_or_park(
        &self,
        a: Allocation,
        size: usize,
        want: u64,
        stream: Option<&Stream>,
        ctx: &CudaContext,
    ) -> Result<u64> {
        let mut a = a;
        let mut parked = Vec::new();
        let result = loop {
            match self.streams.order_reuse(a.tag, stream, ctx, self.graphs.active() > 0) {
                Ok(()) => break Ok(a.addr as u64),
                Err(Error::Capture(_)) if parked.len() < PARKED_MAX => {
                    parked.push(a);
                    match self.pool.allocate_for(size, BLOCK_ALIGN, want) {
                        Ok(next) => a = next,
                        Err(e) => break Err(e),
                    }
                }
                Err(e) => {
                    // Could not order the reuse: keep the block out of reach
                    // of this caller and give it back with its tag intact.
                    let _ = self.pool.deallocate(a.addr, a.tag);
                    break Err(e);
                }
            }
        };
        for p in parked {
            let _ = self.pool.deallocate(p.addr, p.tag);
        }
        result
    }

    /// Frees `ptr` after the work queued on `stream` (`None`: the caller
    /// guarantees no queued work uses it any more).
    ///
    /// # Errors
    /// Bad pointers get [`Error::DoubleFree`], [`Error::InteriorPointer`] or
    /// [`Error::UnknownPointer`] and change nothing.
    pub fn free(&self, ptr: u64, stream: Option<&Stream>) -> Result<usize> {
        let addr = ptr as usize;
        // An exported block stays allocated until its exports are released.
        if let Some(size) = self.defer_exported_free(addr, stream)? {
            return Ok(size);
        }
        if self.async_live.load(Ordering::Acquire) > 0 {
            if let Some(r) = self.free_if_stream_ordered(ptr, stream) {
                return r;
            }
        }
        if self.graphs.routes_frees() {
            if let Some(size) = self.free_routed(addr, stream)? {
                return Ok(size);
            }
        }
        self.settle_graph_releases();
        let tag = match stream {
            Some(s) if !s.is_host() => {
                self.streams.register(s);
                s.free_tag()
            }
            _ => StreamTag::NONE,
        };
        match self.pool.deallocate(addr, tag) {
            Ok(freed) => Ok(freed.size),
            Err(e) => self.free_outside_pool(addr, stream, tag, e),
        }
    }

    /// [`free`](Self::free) of a pointer the device pool refused with
    /// `e`: a tagged pool's or a graph-private pool's block, else `e`.
    #[cold]
    #[inline(never)]
    fn free_outside_pool(&self, addr: usize, stream: Option<&Stream>, tag: StreamTag, e: Error) -> Result<usize> {
        if !matches!(e, Error::UnknownPointer { .. }) {
            return Err(e);
        }
        if let Some(size) = self.free_tagged(addr, tag)? {
            return Ok(size);
        }
        if self.graphs.has_pools() {
            return self.free_into_private(addr, stream)?.ok_or(e);
        }
        Err(e)
    }

    fn holds_cached_memory(&self) -> bool {
        let native = self.driver.all_made().any(|p| p.attributes().is_ok_and(|a| a.reserved_current > a.used_current));
        native || self.pool.stats().free() > 0
    }

    /// Returns cached memory to the driver: the sync pool's free chunks and
    /// the native pools' free memory (`cuMemPoolTrimTo(0)`).
    ///
    /// # Errors
    /// The first driver error.
    pub fn release_cached(&self) -> Result<usize> {
        if self.capture_under_way()? {
            return Err(Error::Capture(
                "cached memory can't be released while a graph capture is under way (it would synchronize \
                 capturing streams)"
                    .into(),
            ));
        }
        self.settle_graph_releases();
        self.release_retired()?;
        if self.ctx.is_some() {
            // Work queued on streams may still use free blocks.
            self.streams.synchronize_all()?;
            if let Some(s) = self.internal_stream.get() {
                s.synchronize()?;
            }
        }
        let mut released = self.pool.release_cached()?;
        for a in self.tags.all() {
            released += a.pool.release_cached()?;
        }
        for p in self.driver.all_made() {
            p.trim_to(0)?;
        }
        Ok(released)
    }

    /// Releases what is free, lists what is live (blocks, stream-ordered).
    pub(crate) fn shutdown(&self) -> Result<Vec<LiveBlock>> {
        if self.capture_under_way()? {
            return Err(Error::Capture("shutdown() while a graph capture is under way".into()));
        }
        self.settle_graph_releases();
        self.release_retired()?;
        if self.ctx.is_some() {
            self.streams.synchronize_all()?;
        }
        let mut live = self.pool.shutdown()?;
        for a in self.tags.all() {
            live.extend(a.pool.shutdown()?);
        }
        for p in self.driver.all_made() {
            p.trim_to(0)?;
        }
        live.extend(lock(&self.async_book).live.iter().map(|(&addr, b)| LiveBlock {
            addr,
            size: b.size,
            requested: b.size,
        }));
        Ok(live)
    }

    /// The pool kind errors name.
    pub fn kind(&self) -> PoolKind {
        PoolKind::Device
    }
}
