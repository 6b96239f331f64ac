//! How a device allocator is assembled: its sync pool and its chunks'
//! source, the factories of graph pools and memory tags' pools, the modes.
//!
//! The manager hands plain configuration values down ([`DeviceSetup`]);
//! everything composed from them (upstreams, pools, the pool factories)
//! is made here, in the device layer.

use std::sync::Arc;

use cudarc::driver::CudaContext;

use super::allocator::DeviceAllocator;
use super::captures::GraphPoolFactory;
use super::mode::DeviceAllocatorMode;
use super::native_pool::NativePoolOptions;
use super::tags::TagPoolFactory;
use crate::error::Result;
use crate::pool::{Pool, PoolConfig};
use crate::upstream::{Host, HostExpandable, Upstream};

/// Address space reserved up front for a device pool on the host fallback
/// with expandable segments (committed as the pool grows).
const HOST_DEVICE_RESERVATION: usize = 64 << 30;

/// A device allocator as plain values (the manager's configuration, resolved).
#[derive(Debug, Clone)]
pub(crate) struct DeviceSetup {
    /// The sync pool's settings (its initial size included).
    pub(crate) pool: PoolConfig,
    /// The settings of graph-private pools.
    pub(crate) graph_pool: PoolConfig,
    /// Pools grow by expandable segments (VMM; on the host fallback, a
    /// reservation committed as they grow).
    pub(crate) expandable: bool,
    /// The mode requested first.
    pub(crate) mode: DeviceAllocatorMode,
    /// The dedicated native pool's options.
    pub(crate) native: NativePoolOptions,
    /// Only registered captures are routed into private pools.
    pub(crate) promise_registered_captures: bool,
}

impl DeviceSetup {
    /// The allocator of device `ordinal` (`ctx`: `None` on the host fallback).
    ///
    /// # Errors
    /// Errors making the sync pool's upstream (a driver error, or no
    /// address space on the host fallback).
    pub(crate) fn build(self, ordinal: usize, ctx: Option<Arc<CudaContext>>) -> Result<DeviceAllocator> {
        let expandable = self.expandable;
        let upstream = device_upstream(ctx.as_ref(), expandable)?;
        // Memory tags' pools: the sync pool's settings over address space
        // of their own that can always remap pages (sleep unmaps them all),
        // with no thread cache.
        let mut tag_pc = self.pool.clone();
        tag_pc.initial_size = 0;
        tag_pc.expandable = true;
        tag_pc.keep_chunks = false;
        tag_pc.thread_cache = false;
        let tag_ctx = ctx.clone();
        let tag_pools: TagPoolFactory =
            Box::new(move || Ok(Pool::new(device_upstream(tag_ctx.as_ref(), true)?, tag_pc.clone())));
        let pool = Pool::new(upstream, self.pool);
        // The private pools of captures cumem is not told of, made like
        // those of `MemoryManager::graph_pool_on`.
        let (graph_ctx, graph_pc) = (ctx.clone(), self.graph_pool);
        let graph_pools: GraphPoolFactory =
            Box::new(move || Ok(Pool::new(graph_upstream(graph_ctx.as_ref(), expandable)?, graph_pc.clone())));
        Ok(DeviceAllocator::new(
            ordinal,
            ctx,
            pool,
            self.mode,
            self.native,
            self.promise_registered_captures,
            Some(graph_pools),
            Some(tag_pools),
        ))
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
            mode: DeviceAllocatorMode::SyncPool,
            native: NativePoolOptions { release_threshold: u64::MAX, exportable: false },
            promise_registered_captures: false,
        }
    }
}

/// Where a device pool takes its chunks (the host fallback's: no context).
fn device_upstream(ctx: Option<&Arc<CudaContext>>, expandable: bool) -> Result<Box<dyn Upstream>> {
    Ok(match ctx {
        Some(ctx) => crate::upstream::device_upstream(ctx.clone(), expandable)?,
        // Host expandable segments: address space reserved, committed as used.
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
