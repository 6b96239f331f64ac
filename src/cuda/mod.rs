//! CUDA driver primitives: finding the driver and devices, contexts,
//! streams, graph captures, virtual memory management, peer access.
//!
//! This layer knows nothing of pools: the upstreams build on it, and the
//! device allocator on those. Everything here goes through `cudarc`'s
//! driver API, loaded dynamically: building needs no CUDA toolkit, running
//! needs only the NVIDIA driver.

mod capture;
mod context;
mod fence;
mod free_clock;
mod graph_object;
mod graph_release;
pub(crate) mod ipc;
mod peer;
mod stream;
pub mod vmm;

#[doc(hidden)]
pub use free_clock::{FreeClock, PENDING};

pub use context::{
    default_ordinal, device_context, driver_err, driver_status, gpu_for_test, gpus_for_test, DriverStatus,
};
pub use peer::{can_access_peer, enable_peer_access, mapped_peers, peers_of};
pub use stream::Stream;

pub(crate) use capture::{
    capture_info, capture_of, captures_under_way, count_capture, CaptureGraph, RelaxedCaptureMode,
};
#[cfg(not(loom))]
pub(crate) use context::set_default_ordinal;
pub(crate) use fence::{fence_on, fence_on_all, EventPool};
pub(crate) use graph_object::tie_to_graph;
pub(crate) use graph_release::next_host_capture_id;
#[doc(hidden)]
pub use graph_release::{release_payload, run_release, HostGraph, HostGraphExec, ReleaseQueue};
pub(crate) use peer::{
    follow_active_peers, initial_peers, register_mapped, register_pool, unregister_pool, PeerMapped,
};
