//! cumem's C ABI: the seed's `MemoryManager` API in C form, PyTorch's
//! pluggable-allocator entry points, statistics, memory tags with sleep
//! and wake, and a thread-local last error. Built as `libcumem_c.so` and
//! `libcumem_c.a`; the header `include/cumem.h` is cbindgen's (checked by
//! `tests/header.rs`), with a C++ wrapper in `include/cumem.hpp`.
//!
//! Every entry point returns a [`CumemStatus`] (the PyTorch ones, whose
//! signatures PyTorch fixes, return NULL or count failures instead, and
//! the infallible `cumem_instance_id`, `cumem_last_error` and
//! `cumem_status_name` return their value) and never unwinds into C: a
//! panic inside cumem becomes `CUMEM_STATUS_PANIC`. Bad pointers, double
//! frees and out of memory are status codes that leave the pools as they
//! were; the message of the last failing call on a thread is
//! [`cumem_last_error`].
//!
//! The first call creates the process-wide manager from `CUMEM_CONF`
//! (or call [`cumem_init`] first with a configuration string). Without a
//! GPU everything runs on cumem's host fallback.

#![deny(unsafe_op_in_unsafe_fn)]

mod api;
mod ffi;
mod graph_pools;
mod instance;
mod ipc;
mod recorded;
mod stats;
mod status;
mod streams;
mod tags;
mod torch;
mod torch_native;

pub use api::*;
pub use graph_pools::*;
pub use instance::cumem_instance_id;
pub use ipc::*;
pub use stats::*;
pub use status::{cumem_last_error, cumem_status_name, CumemStatus};
pub use streams::*;
pub use tags::*;
pub use torch::*;
pub use torch_native::*;
