//! CUDA specifics: finding the driver and devices, contexts, streams,
//! events, the CUDA upstreams, the native memory pool, virtual memory.
//!
//! Everything here goes through `cudarc`'s driver API, loaded dynamically:
//! building needs no CUDA toolkit, running needs only the NVIDIA driver.

mod context;

pub use context::{device_context, driver_status, gpu_for_test, DriverStatus};
pub(crate) use context::driver_err;
