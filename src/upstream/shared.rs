//! One upstream shared by several pools, each chunk handed out whole: the
//! worker shards of a device (`pool/shards.rs`) take their chunks from one
//! address space, so a chunk can change shard with no driver call and any
//! shard can give any chunk back.

use super::{Chunk, Upstream};
use crate::error::{Error, Result};
use std::sync::Arc;

/// Whole chunks of a shared upstream: never grown, shrunk or remapped in
/// place (a chunk that changes pools must stay what it was when handed
/// out), everything else as the shared upstream does it.
pub struct SharedChunks {
    inner: Arc<dyn Upstream>,
}

impl SharedChunks {
    /// Chunks of `inner`, which other pools may share.
    pub fn new(inner: Arc<dyn Upstream>) -> Self {
        SharedChunks { inner }
    }
}

impl std::fmt::Debug for SharedChunks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedChunks").field("inner", &self.inner.name()).finish()
    }
}

impl Upstream for SharedChunks {
    fn allocate_chunk(&self, size: usize) -> Result<Chunk> {
        self.inner.allocate_chunk(size)
    }
    fn deallocate_chunk(&self, chunk: Chunk) -> Result<()> {
        self.inner.deallocate_chunk(chunk)
    }
    fn inner(&self) -> Option<&dyn Upstream> {
        Some(&*self.inner)
    }
    // Whole chunks: what the shared upstream could do in place is refused.
    fn try_extend(&self, _: Chunk, _: usize) -> Result<bool> {
        Ok(false)
    }
    fn can_extend(&self) -> bool {
        false
    }
    fn try_shrink(&self, _: Chunk, _: usize) -> Result<bool> {
        Ok(false)
    }
    fn can_remap(&self) -> bool {
        false
    }
    fn reserve_chunk(&self, _: usize) -> Result<Chunk> {
        Err(Error::InvalidState("whole chunks are not reserved as address space alone".into()))
    }
    fn try_extend_reserved(&self, _: Chunk, _: usize) -> Result<bool> {
        Ok(false)
    }
    fn map_runs(&self, _: &[Chunk]) -> Result<u64> {
        Err(Error::InvalidState("whole chunks are not remapped".into()))
    }
    fn unmap_within(&self, _: &[Chunk], _: usize, _: bool, _: bool) -> Result<Vec<Chunk>> {
        Ok(Vec::new())
    }
    fn release_kept(&self) {}
}

#[cfg(test)]
mod tests {
    use super::SharedChunks;
    use crate::upstream::{HostExpandable, Upstream};
    use std::sync::Arc;

    #[test]
    fn chunks_of_one_space_are_whole_and_any_sharer_gives_them_back() {
        let space: Arc<dyn Upstream> = Arc::new(HostExpandable::new(64 << 20).unwrap());
        let (a, b) = (SharedChunks::new(space.clone()), SharedChunks::new(space));
        assert!(!a.can_extend() && !a.can_remap());
        let c = a.allocate_chunk(1 << 20).unwrap();
        assert!(!a.try_extend(c, 1 << 20).unwrap());
        let d = b.allocate_chunk(1 << 20).unwrap();
        assert!(c.end() <= d.addr || d.end() <= c.addr, "one address space, no overlap");
        // A chunk moved to the other sharer goes back through it.
        b.deallocate_chunk(c).unwrap();
        a.deallocate_chunk(d).unwrap();
        assert!(a.deallocate_chunk(c).is_err(), "given back once only");
    }
}
