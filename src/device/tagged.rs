//! The device allocator's side of memory tags (`tags.rs`): allocating and
//! freeing in a tag's pool, and what sleep and wake ask of the device.

use super::allocator::DeviceAllocator;
use super::tags::{current_tag, TagPool};
use crate::cuda::Stream;
use crate::error::{Error, Result};
use crate::sync::Arc;
use crate::tag::StreamTag;
use crate::upstream::BLOCK_ALIGN;

impl DeviceAllocator {
    /// Allocates in the pool of this thread's tag as the sync pool does
    /// (stream order included); the pool is made on first use here.
    ///
    /// # Errors
    /// [`Error::Tag`] (asleep, or no page remapping); the sync pool's errors.
    pub(super) fn allocate_tagged(&self, size: usize, stream: Option<&Stream>) -> Result<u64> {
        let Some(name) = current_tag() else {
            return Err(Error::InvalidState("a tagged allocation with no tag set".into()));
        };
        let tp = self.tags.pool(&name)?;
        let _entered = tp.enter()?;
        let want = stream.filter(|s| !s.is_host()).map_or(0, Stream::id);
        let a = match tp.pool.allocate_for(size, BLOCK_ALIGN, want) {
            Err(Error::OutOfMemory { .. }) if self.ctx.is_some() && !self.capture_under_way()? => {
                // Memory may sit in the sync pool, the native pools or
                // other tags: release it (after the streams' work), retry.
                self.release_cached()?;
                tp.pool.allocate_for(size, BLOCK_ALIGN, want)?
            }
            other => other?,
        };
        if let Some(ctx) = &self.ctx {
            if let Err(e) = self.streams.order_reuse(a.tag, stream, ctx, self.graphs.active() > 0) {
                // Keep the block out of the caller's reach, its tag intact.
                let _ = tp.pool.deallocate(a.addr, a.tag);
                return Err(e);
            }
        }
        Ok(a.addr as u64)
    }

    /// Frees `addr` into the tag pool that holds it (in any state: a
    /// block freed while its tag sleeps is not copied back); `None` when
    /// no pool holds it.
    ///
    /// # Errors
    /// The pool's bad-pointer errors ([`Error::DoubleFree`],
    /// [`Error::InteriorPointer`]); nothing changes then.
    pub(super) fn free_tagged(&self, addr: usize, tag: StreamTag) -> Result<Option<usize>> {
        let Some(tp) = self.tags.owner(addr) else { return Ok(None) };
        tp.pool.deallocate(addr, tag).map(|f| Some(f.size))
    }

    /// The pool of tag `name` on this device, if the tag was used here.
    pub(crate) fn tag_pool(&self, name: &str) -> Option<Arc<TagPool>> {
        self.tags.find(name)
    }

    /// Every tag pool of this device.
    pub(crate) fn tag_pools(&self) -> Vec<Arc<TagPool>> {
        self.tags.all()
    }

    /// Refuses to share a tagged block with another process: its pages
    /// may be given back while the importer maps them.
    ///
    /// # Errors
    /// [`Error::Tag`] when `addr` lies in a tag's pool.
    pub(super) fn refuse_tagged_export(&self, addr: usize) -> Result<()> {
        match self.tags.owner(addr) {
            Some(a) => Err(Error::Tag {
                tag: a.name.to_string(),
                why: format!(
                    "block {addr:#x} can't be exported to another process: a tag's memory can sleep, and an \
                     importer would keep mapping pages given back"
                ),
            }),
            None => Ok(()),
        }
    }

    /// Waits until all work on this device is complete (sleep and wake
    /// copy and unmap memory that queued work may still use).
    ///
    /// # Errors
    /// [`Error::Capture`] while the device has a capture; a driver error.
    pub(crate) fn synchronize_for_tags(&self) -> Result<()> {
        if self.capture_under_way()? {
            return Err(Error::Capture(
                "a memory tag can't sleep or wake while a graph capture is under way (it would synchronize \
                 capturing streams)"
                    .into(),
            ));
        }
        if let Some(ctx) = &self.ctx {
            ctx.synchronize().map_err(crate::cuda::driver_err("cuCtxSynchronize"))?;
        }
        Ok(())
    }
}
