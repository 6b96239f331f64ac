//! A driver pool made on first use, for the stream-ordered modes.

use std::sync::Arc;

use cudarc::driver::CudaContext;
use once_cell::sync::OnceCell;

use crate::cuda::RelaxedCaptureMode;
use crate::device::native_pool::NativePool;
use crate::error::{Error, Result};

/// The device's context and the pool, made on first use by the mode's
/// own maker (the default pool configured, or a pool of cumem's own).
pub(super) struct LazyPool {
    ctx: Option<Arc<CudaContext>>,
    pool: OnceCell<NativePool>,
}

impl LazyPool {
    pub(super) fn new(ctx: Option<Arc<CudaContext>>) -> Self {
        LazyPool { ctx, pool: OnceCell::new() }
    }

    /// The context (an error on the host fallback: these modes need a GPU).
    pub(super) fn ctx(&self) -> Result<&Arc<CudaContext>> {
        self.ctx.as_ref().ok_or(Error::NeedsGpu("stream-ordered allocation"))
    }

    /// The pool, made by `make` on first use. Making it is legal even
    /// while this thread captures a graph (relaxed capture mode).
    pub(super) fn get(&self, make: impl FnOnce(Arc<CudaContext>) -> Result<NativePool>) -> Result<&NativePool> {
        let ctx = self.ctx()?;
        self.pool.get_or_try_init(|| {
            let _relaxed = RelaxedCaptureMode::enter();
            make(ctx.clone())
        })
    }

    /// The pool if it was made.
    pub(super) fn made(&self) -> Option<&NativePool> {
        self.pool.get()
    }
}
