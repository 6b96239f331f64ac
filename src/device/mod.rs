//! CUDA specifics: finding the driver and devices, contexts, streams,
//! the CUDA upstreams, the three device allocator modes, the native memory
//! pools.
//!
//! Everything here goes through `cudarc`'s driver API, loaded dynamically:
//! building needs no CUDA toolkit, running needs only the NVIDIA driver.

mod allocator;
mod capture;
mod context;
mod cuda_upstream;
mod free_clock;
#[doc(hidden)]
pub use free_clock::{FreeClock, PENDING};
mod graph;
mod graph_object;
mod native_pool;
mod peer;
mod stream;
pub mod vmm;

pub use allocator::{AsyncStats, DeviceAllocator, DeviceAllocatorMode, DeviceStats};
pub use context::{device_context, driver_status, gpu_for_test, gpus_for_test, DriverStatus};
pub use cuda_upstream::{CudaDeviceMemory, CudaPinnedMemory};
pub use native_pool::{NativePool, NativePoolAttributes};
pub use peer::{can_access_peer, enable_peer_access, peers_of};
pub use stream::Stream;

pub(crate) use capture::RelaxedCaptureMode;
pub(crate) use context::driver_err;
pub(crate) use graph::{captures_under_way, GraphPoolFactory};
pub use graph::{GraphPool, GraphStats};
pub(crate) use graph_object::next_host_capture_id;
#[doc(hidden)]
pub use graph_object::{release_payload, run_release, HostGraph, HostGraphExec, ReleaseQueue};
pub(crate) use peer::{register_mapped, PeerMapped};

use std::sync::Arc;

use cudarc::driver::CudaContext;

use crate::error::Result;
use crate::upstream::Upstream;

/// The upstream of a device's sync pool: expandable segments on CUDA
/// virtual memory (one reserved range that grows by mapping) when asked for
/// and supported, else plain `cuMemAlloc` chunks.
pub(crate) fn device_upstream(ctx: Arc<CudaContext>, expandable: bool) -> Result<Box<dyn Upstream>> {
    if expandable && vmm::vmm_supported(&ctx)? {
        return Ok(Box::new(crate::upstream::CudaVmm::new(ctx.ordinal())?));
    }
    Ok(Box::new(CudaDeviceMemory::new(ctx)))
}
