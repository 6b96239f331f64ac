//! The GPU tests and the tests of the process-wide manager: real device
//! memory, kernels from NVRTC, streams, graphs, IPC, several GPUs, and the
//! pinned and managed collections. Each GPU test skips with a printed
//! reason without a GPU and fails instead under `CUMEM_REQUIRE_GPU=1`. One
//! module per former test binary: run one of them with
//! `cargo test --test gpu -- gpu_graphs::` (scripts/gpu-suite.sh runs each
//! module in a process of its own, as when they were binaries).
//! `tests/device_heap.rs` and `tests/pinned_refusals.rs` stay binaries of
//! their own: they configure the process before anything else runs.

mod common;

mod basics;
mod cudarc_interop;
mod gpu_dropped_streams;
mod gpu_graphs;
mod gpu_ipc;
mod gpu_remap;
mod gpu_threads;
mod gpu_training_threads;
mod gpu_unmapped_pages;
mod managed_alloc;
mod multi_gpu;
mod pinned_alloc;
// CI runs it with `--features allocator-api2-04 --test gpu -- pinned_alloc_04::`.
#[cfg(feature = "allocator-api2-04")]
mod pinned_alloc_04;
mod sleep;
mod staged_copy;
