//! A two-phase planning arena: declare the host and device memory a
//! computation needs, assign it all at once from one pinned block and one
//! device block, then freeze the plan.
//!
//! ```text
//!  phase one: want_host / want_device (_for steps)   -> typed handles, pending
//!  phase two: satisfy()   every pending request gets a 256-aligned offset,
//!                         all of them or none
//!             commit()    satisfy, then frozen: no more requests
//!  use:       host_slice(_mut), device_ptr, copies, upload/download
//!  reset:     release_all()  requests forgotten, handles stale, blocks kept
//!
//!  device block  0        256      ...                          capacity
//!                |weights |act0 / act2 (steps 0..=1, 2..=3)| act1 |  free  |
//! ```
//!
//! # Sharing memory by lifetime
//!
//! A request may name the steps that use it (`want_device_for::<f32>(n,
//! 3..=4)`); steps are the caller's own numbering, layers of a network for
//! example. Requests whose steps don't overlap may share bytes. Requests
//! without steps live for the whole plan. [`ArenaPlan::satisfy`] places
//! requests greedy by size over intervals, as TFLite's arena planner does:
//! the largest first, each at the lowest 256-aligned offset that overlaps
//! no placed request whose steps overlap its own. [`PlanReport`] gives the
//! bytes planned against the sum of the request sizes. A request's contents
//! last through its own steps only: outside them another request may
//! overwrite them.
//!
//! # Why this is sound
//!
//! - Handles are names, checked on every use: a handle carries its plan's
//!   id, the plan's generation when it was made, its request's index and
//!   length. Another plan's handle, a handle from before
//!   [`ArenaPlan::release_all`] (which bumps the generation), or one not yet
//!   assigned is refused with [`Error::InvalidHandle`](crate::Error), never
//!   resolved to memory it no longer owns. Handles can't be forged: only
//!   `want_*` makes them, with their type.
//! - Host memory is reached through borrows of the plan:
//!   [`ArenaPlan::host_slice_mut`] borrows the whole plan mutably. Two
//!   requests may share bytes, so per-request borrows would not do; one
//!   borrow of the plan makes aliasing `&mut` slices impossible, and copies
//!   that write memory (`copy_to_device`, `download`) take `&mut self`
//!   too.
//! - Values are `bytemuck::Pod`: any bit pattern is a valid value, there is
//!   no padding and no interior mutability. That is what reinterpreting
//!   bytes needs, and the arena does it all the time: requests of different
//!   types share bytes, memory keeps its contents across `release_all`, and
//!   device copies write raw bytes. Types aligned to more than 256 are
//!   refused (offsets are multiples of 256 in 256-aligned blocks).
//! - No byte is read before it is written: the first time `satisfy` hands
//!   out bytes of a block, it zeroes them (`memset`; `cuMemsetD8` on the
//!   device), keeping a high-water mark so each byte is zeroed once. Bytes
//!   handed out again keep what was last written there.
//! - Device memory never becomes a Rust reference: kernels get
//!   [`ArenaPlan::device_ptr`], data moves through synchronous copies
//!   (`cuMemcpyHtoD`/`cuMemcpyDtoH`; memcpy on the host fallback).
//! - Before memory is reassigned ([`ArenaPlan::release_all`]) or returned
//!   to the manager (drop), the plan waits for the device's queued work
//!   (`cuCtxSynchronize`), so a kernel still running can't see its memory
//!   change hands. Between those points, ordering kernels against copies
//!   that reuse shared bytes is the caller's job, as with any device
//!   memory.

mod handle;
mod plan;
mod planner;

pub use handle::{DeviceHandle, HostHandle};
pub use plan::ArenaPlan;
pub use planner::{BlockReport, PlanReport};
