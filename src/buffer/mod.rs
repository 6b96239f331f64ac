//! Typed buffers of device memory: [`DeviceBuffer`], and
//! [`GrowableBuffer`], device memory that grows without copying (CUDA
//! virtual memory management, or the host fallback).

mod device_buffer;
mod growable;

pub use crate::upstream::{GrowPath, VmBackend};
pub use device_buffer::DeviceBuffer;
pub use growable::{GrowStats, GrowableBuffer};
