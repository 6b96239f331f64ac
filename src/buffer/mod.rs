//! Typed buffers of device memory: [`DeviceBuffer`], and
//! [`GrowableBuffer`], device memory that grows without copying (CUDA
//! virtual memory management, or the host fallback). Both implement
//! cudarc's `DeviceSlice`, `DevicePtr`, `DevicePtrMut` and `PushKernelArg`
//! (`&` and `&mut`), and [`TrackedPinnedVec`] its `HostSlice`, so cudarc's
//! copies and launches take them directly.

mod device_buffer;
mod growable;
mod interop;
mod tagged;
mod tracked_pinned;

pub use crate::upstream::{GrowPath, VmBackend};
pub use device_buffer::DeviceBuffer;
pub use growable::{GrowStats, GrowableBuffer};
pub use tagged::MemoryTag;
pub use tracked_pinned::TrackedPinnedVec;
