//! Typed buffers of device memory.

mod device_buffer;

pub use device_buffer::DeviceBuffer;
