#![doc = include_str!("../README.md")]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod device;
mod error;
pub mod pool;
pub(crate) mod sync;
pub mod upstream;

pub use error::{Error, OomState, PoolKind, Result};
