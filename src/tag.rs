//! Stream tags: which queued work may still use a free block.

/// Which queued work may still use a free block: the stream it was freed
/// on, and the free's sequence number on that stream (work queued before
/// the free with that number).
///
/// `NONE` means no work is pending (freed synchronously, or never used);
/// `MIXED` means the block merged blocks freed on several streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamTag {
    /// The stream's id (0: none, `u64::MAX`: several).
    pub stream: u64,
    /// The free's sequence number on that stream. Its top 16 bits name
    /// the shard (thread) that counted it; `u64::MAX`: some free on the
    /// stream, never known complete.
    pub seq: u64,
}

impl StreamTag {
    /// No pending work.
    pub const NONE: StreamTag = StreamTag { stream: 0, seq: 0 };
    /// Work on several streams may be pending.
    pub const MIXED: StreamTag = StreamTag { stream: u64::MAX, seq: 0 };

    /// The tag of a block made of two blocks with these tags: the later
    /// free on one stream covers the earlier; two streams make `MIXED`.
    pub fn merge(self, other: StreamTag) -> StreamTag {
        if other == StreamTag::NONE {
            self
        } else if self == StreamTag::NONE {
            other
        } else if self.stream == other.stream && self != StreamTag::MIXED {
            // A sequence number's top 16 bits name the shard (thread) that
            // counted it; numbers of different shards don't compare, so
            // the merge is "pending on this stream" (u64::MAX).
            let seq = if self.seq >> 48 == other.seq >> 48 { self.seq.max(other.seq) } else { u64::MAX };
            StreamTag { stream: self.stream, seq }
        } else {
            StreamTag::MIXED
        }
    }
}

/// Whether the queued work a tag names is known complete (a host
/// synchronisation saw it). A pool asks it when it merges free blocks freed
/// on different streams: a finished stream's tag is dropped from the merge
/// instead of making the block [`StreamTag::MIXED`]. It must make no driver
/// call and not block for long: it runs under the pool's lock.
pub type TagOracle = std::sync::Arc<dyn Fn(StreamTag) -> bool + Send + Sync>;

/// A point in one stream's queued work (on a device: a CUDA event recorded
/// on the stream). A page move that lends memory which work queued before
/// the point may still use keeps the memory's old mapping until the point
/// has passed (`pool/remap.rs`).
pub trait Fence: Send + Sync {
    /// Whether the work queued before the fence is done. Never waits (it
    /// may ask the driver); `false` when the question fails.
    fn passed(&self) -> bool;

    /// Waits until the work queued before the fence is done.
    ///
    /// # Errors
    /// A driver error from the wait (the work's state is then unknown).
    fn wait(&self) -> crate::error::Result<()>;
}

/// `(on, then)`: makes a [`Fence`] at the end of the work queued so far on
/// the stream with id `on` ([`crate::Stream::id`]) and, when `then` is
/// another stream, orders the work queued on `then` from now on after it
/// (the stream waits for the fence on the device, not the host); `None`
/// where it can't (a stream it doesn't know, one that captures a graph, a
/// driver error). `on` = [`StreamTag::MIXED`]'s stream asks for a fence
/// on every stream with work that may be queued (memory of blocks freed
/// on several streams). A device allocator gives its pools one; a pool
/// uses it for page moves of memory whose work may be queued, for a
/// request on `then`. It runs with no pool lock held.
pub type FenceMaker = std::sync::Arc<dyn Fn(u64, u64) -> Option<std::sync::Arc<dyn Fence>> + Send + Sync>;

/// [`StreamTag::merge`], asking `done` first when the merge would lose
/// order (two streams, or one stream's numbers from different threads):
/// a tag whose work is known complete counts as [`StreamTag::NONE`].
pub(crate) fn merge_asking(a: StreamTag, b: StreamTag, done: Option<impl Fn(StreamTag) -> bool>) -> StreamTag {
    let m = a.merge(b);
    match done {
        Some(done) if m == StreamTag::MIXED || (m.seq == u64::MAX && m != a && m != b) => {
            let a = if done(a) { StreamTag::NONE } else { a };
            let b = if done(b) { StreamTag::NONE } else { b };
            a.merge(b)
        }
        _ => m,
    }
}

#[cfg(test)]
mod tests;
