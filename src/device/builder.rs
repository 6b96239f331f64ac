//! How a device allocator is assembled: its sync pool's shards and where
//! each takes its chunks, the factory of graph-private pools, the modes.
//!
//! The manager hands plain configuration values down ([`DeviceSetup`]);
//! everything composed from them (upstreams, shards, the graph pool
//! factory) is made here, in the device layer.

use std::sync::Arc;

use cudarc::driver::CudaContext;
use once_cell::sync::OnceCell;

use super::allocator::DeviceAllocator;
use super::captures::GraphPoolFactory;
use super::mode::DeviceAllocatorMode;
use super::native_pool::NativePoolOptions;
use super::tags::TagPoolFactory;
use crate::error::Result;
use crate::pool::{Pool, PoolConfig, Shards, UpstreamFactory};
use crate::upstream::{CudaVmm, Geometric, Host, HostExpandable, SharedChunks, Taken, Upstream};

/// Address space reserved up front for a device pool on the host fallback
/// with expandable segments (committed as the pool grows).
const HOST_DEVICE_RESERVATION: usize = 64 << 30;

/// What a device allocator is made of, as plain values (the manager's
/// configuration, resolved).
#[derive(Debug, Clone)]
pub(crate) struct DeviceSetup {
    /// The sync pool's settings (its initial size included).
    pub(crate) pool: PoolConfig,
    /// The settings of graph-private pools.
    pub(crate) graph_pool: PoolConfig,
    /// Pools grow by expandable segments (VMM; on the host fallback, a
    /// reservation committed as they grow).
    pub(crate) expandable: bool,
    /// The worker shards take whole chunks of one address space shared by
    /// them all.
    pub(crate) shared_shards: bool,
    /// How many shards the sync pool has.
    pub(crate) shards: usize,
    /// The mode requested first.
    pub(crate) mode: DeviceAllocatorMode,
    /// The dedicated native pool's options.
    pub(crate) native: NativePoolOptions,
    /// Only registered captures are routed into private pools.
    pub(crate) promise_registered_captures: bool,
}

impl DeviceSetup {
    /// The allocator of device `ordinal` (`ctx` is `None` on the host
    /// fallback).
    ///
    /// # Errors
    /// Errors making the first shard's upstream (a driver error, or no
    /// address space on the host fallback).
    pub(crate) fn build(self, ordinal: usize, ctx: Option<Arc<CudaContext>>) -> Result<DeviceAllocator> {
        let expandable = self.expandable;
        let upstream = device_upstream(ctx.as_ref(), expandable)?;
        // Memory tags' pools: the sync pool's settings over address space
        // of their own that can always remap pages (sleep unmaps them all),
        // with no thread cache, background mapper or learned placement.
        let mut tag_pc = self.pool.clone();
        tag_pc.initial_size = 0;
        tag_pc.expandable = true;
        tag_pc.keep_chunks = false;
        tag_pc.thread_cache = false;
        tag_pc.background_mapper = false;
        tag_pc.learn_placement = false;
        tag_pc.idle_shards_give = false;
        tag_pc.fresh_thread_budget = false;
        tag_pc.hand_over_ranges = false;
        let tag_ctx = ctx.clone();
        let tag_pools: TagPoolFactory =
            Box::new(move || Ok(Pool::new(device_upstream(tag_ctx.as_ref(), true)?, tag_pc.clone())));
        let shards = if self.shared_shards {
            // The worker shards take whole chunks of one address space
            // shared by them all (made on the first one's first use): a
            // free chunk moves between them with no driver call, and any of
            // them can give it back. Each grows geometrically on its own
            // size (a device chunk maps in about a tenth of a millisecond,
            // so growing on the set's total would only overshoot: one shard
            // growing by a quarter of sixteen shards' memory).
            let (space_ctx, space, limit) = (ctx.clone(), Arc::new(OnceCell::new()), self.pool.max_size);
            let make_worker: UpstreamFactory = Box::new(move || {
                let space: &Arc<dyn Upstream> =
                    space.get_or_try_init(|| device_upstream(space_ctx.as_ref(), expandable).map(Arc::from))?;
                let whole = Box::new(SharedChunks::new(space.clone()));
                Ok(Box::new(Geometric::new(whole, Taken::new(), limit)) as Box<dyn Upstream>)
            });
            Shards::with_workers(upstream, make_worker, self.pool, self.shards)
        } else if let Some(space) = self.space(ctx.as_ref())? {
            // Every shard remaps pages in one address space, each through
            // a view of its own: a mapped free range passes from one shard
            // to another with no driver call (pool/handover.rs).
            let first = space.view();
            let make: UpstreamFactory = Box::new(move || Ok(space.view()));
            Shards::sharing_space(first, make, self.pool, self.shards)
        } else {
            // Each further shard takes its chunks the same way as the first
            // (on CUDA, a reservation of its own, registered for peer
            // access like the first).
            let shard_ctx = ctx.clone();
            let make: UpstreamFactory = Box::new(move || device_upstream(shard_ctx.as_ref(), expandable));
            Shards::new(upstream, Some(make), self.pool, self.shards)
        };
        // The private pools of captures cumem is not told of, made like
        // those of `MemoryManager::graph_pool_on`.
        let (graph_ctx, graph_pc) = (ctx.clone(), self.graph_pool);
        let graph_pools: GraphPoolFactory =
            Box::new(move || Ok(Pool::new(graph_upstream(graph_ctx.as_ref(), expandable)?, graph_pc.clone())));
        Ok(DeviceAllocator::new(
            ordinal,
            ctx,
            shards,
            self.mode,
            self.native,
            self.promise_registered_captures,
            Some(graph_pools),
            Some(tag_pools),
        ))
    }
}

/// One address space shared by a device's remapping shards.
enum Space {
    Cuda(CudaVmm),
    Host(HostExpandable),
}

impl Space {
    /// A shard's upstream: a view of the space.
    fn view(&self) -> Box<dyn Upstream> {
        match self {
            Space::Cuda(s) => Box::new(s.view()),
            Space::Host(s) => Box::new(s.view()),
        }
    }
}

impl DeviceSetup {
    /// The address space the sync pool's shards share, when they remap
    /// pages, hand ranges over ([`PoolConfig::hand_over_ranges`]) and are
    /// more than one (else each shard's upstream is its own, as before).
    fn space(&self, ctx: Option<&Arc<CudaContext>>) -> Result<Option<Space>> {
        if self.shards < 2 || !self.expandable || !self.pool.hand_over_ranges || self.pool.keep_chunks {
            return Ok(None);
        }
        Ok(match ctx {
            Some(ctx) => crate::upstream::device_space(ctx.clone(), true, self.shards)?.map(Space::Cuda),
            None => Some(Space::Host(HostExpandable::new(HOST_DEVICE_RESERVATION * self.shards.clamp(1, 4))?)),
        })
    }
}

#[cfg(test)]
impl DeviceSetup {
    /// The default settings on the host fallback, for unit tests.
    pub(crate) fn host_for_tests() -> DeviceSetup {
        let mut pool = PoolConfig::new(crate::error::PoolKind::Device);
        pool.cache_exact = true;
        let mut graph_pool = pool.clone();
        graph_pool.thread_cache = false;
        graph_pool.keep_chunks = true;
        DeviceSetup {
            pool,
            graph_pool,
            expandable: true,
            shared_shards: false,
            shards: 1,
            mode: DeviceAllocatorMode::SyncPool,
            native: NativePoolOptions { release_threshold: u64::MAX, exportable: false },
            promise_registered_captures: false,
        }
    }
}

/// Where a device pool of the context's device (the host fallback's
/// without one) takes its chunks.
fn device_upstream(ctx: Option<&Arc<CudaContext>>, expandable: bool) -> Result<Box<dyn Upstream>> {
    Ok(match ctx {
        Some(ctx) => crate::upstream::device_upstream(ctx.clone(), expandable)?,
        // The host twin of expandable segments: address space reserved up
        // front, committed as the pool grows.
        None if expandable => Box::new(HostExpandable::new(HOST_DEVICE_RESERVATION)?),
        None => Box::new(Host::new()),
    })
}

/// Where a graph-private pool takes its chunks: as a device pool's, but
/// giving them back waits for no device (the pool waits for its graphs'
/// destructors and its streams first).
fn graph_upstream(ctx: Option<&Arc<CudaContext>>, expandable: bool) -> Result<Box<dyn Upstream>> {
    match ctx {
        Some(ctx) => crate::upstream::graph_upstream(ctx.clone(), expandable),
        None => device_upstream(None, expandable),
    }
}
