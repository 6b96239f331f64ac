#![doc = include_str!("../README.md")]
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(missing_docs)]

pub mod alloc;
pub mod arena;
pub mod buffer;
mod conf;
mod copy;
pub mod cuda;
pub mod device;
mod error;
pub mod fault;
pub mod ipc;
pub mod log;
pub mod managed;
pub mod manager;
pub mod pool;
pub mod snapshot;
pub(crate) mod sync;
mod tag;
pub mod upstream;

pub use alloc::{PinnedAlloc, PinnedBox, PinnedVec};
pub use arena::{ArenaPlan, DeviceHandle, HostHandle, PlanReport};
pub use buffer::{DeviceBuffer, GrowPath, GrowStats, GrowableBuffer, MemoryTag, TrackedPinnedVec, VmBackend};
pub use cuda::Stream;
pub use device::{DeviceAllocatorMode, GraphPool, GraphStats, TagScope, TagState, TagUsage};
pub use error::{Error, OomState, PoolKind, Result};
pub use managed::{ManagedAlloc, ManagedBox, ManagedVec};
pub use manager::{
    Backend, BackendChoice, CaptureScope, CapturedGraph, Config, GraphCapture, MemoryManager, PeerAccess,
    ShutdownReport, SleepReport, TableSizes, ThreadCache, WakeReport,
};
pub use snapshot::{MemorySnapshot, PoolPicture};

/// The Rust examples of `docs/guide.md`, compiled and run by `cargo test`
/// as doctests (the README's run as the crate docs' own).
#[doc = include_str!("../docs/guide.md")]
#[cfg(doctest)]
pub struct GuideDoctests;
