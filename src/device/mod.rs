//! The device allocator: the three modes and the switch among them,
//! cross-stream reuse, graph-private pools, the native memory pools.
//!
//! Built on the CUDA primitives of [`crate::cuda`] and the pools of
//! [`crate::pool`]; the manager holds one [`DeviceAllocator`] per device.
//! `DeviceSetup` (`builder.rs`) assembles an allocator from plain
//! configuration values. The CUDA and upstream names re-exported at the
//! end keep older paths (`cumem::device::Stream`) working; cumem's own
//! code names their owners, [`crate::cuda`] and [`crate::upstream`].

mod allocator;
mod async_book;
mod builder;
mod captures;
mod driver_pools;
mod exports;
mod figures;
mod graph_pool;
mod mode;
mod native_pool;
mod pins;
mod reuse;
mod stats;
mod stream_ordered;
mod tagged;
mod tags;

pub use allocator::DeviceAllocator;
pub(crate) use builder::DeviceSetup;
pub use captures::GraphStats;
pub use graph_pool::GraphPool;
pub use mode::DeviceAllocatorMode;
pub use native_pool::{NativePool, NativePoolAttributes, NativePoolOptions};
pub use stats::{AsyncStats, DeviceStats, ModeMemory};
pub(crate) use tags::TagPoolRef;
pub use tags::{
    check_tag_name, current_tag, set_thread_tag, Entered, TagPool, TagScope, TagState, TagUsage, MAX_TAG_LEN,
};

// Older paths, for programs (cumem's own code imports from the owners).
pub use crate::cuda::{
    can_access_peer, device_context, driver_status, enable_peer_access, gpu_for_test, gpus_for_test, mapped_peers,
    peers_of, vmm, DriverStatus, Stream,
};
#[doc(hidden)]
pub use crate::cuda::{release_payload, run_release, FreeClock, HostGraph, HostGraphExec, ReleaseQueue, PENDING};
pub use crate::upstream::{CudaDeviceMemory, CudaPinnedMemory};
