//! When a shard has no free block for a request: chunks and loans from
//! the other shards of the set before any upstream call, one grower at a
//! time (see the `shards` module docs).

use super::Shards;
use crate::error::Result;
use crate::pool::{validate, Allocation, Pool};
use crate::sync::{lock, Ordering};
use crate::tag::StreamTag;
use crate::upstream::{Upstream, BLOCK_ALIGN};

impl Shards {
    /// The calling thread's shard `i` (`home`) has no free block for the
    /// request. Before any upstream call: a wholly free chunk of another
    /// shard moves to `home`; failing that, another shard lends a block of
    /// its free memory with no stream work pending on it (it stays that
    /// shard's, and its free goes back there past every thread cache);
    /// failing that, every thread cache is flushed and both are tried once
    /// more. Only then does `home` grow, one shard of the set at a time:
    /// a shard that had to wait for another's growth looks at the new
    /// memory (its own and a loan) before it grows too.
    #[cold]
    pub(super) fn allocate_elsewhere(
        &self,
        i: usize,
        home: &Pool<Box<dyn Upstream>>,
        size: usize,
        align: usize,
        stream: u64,
    ) -> Result<Allocation> {
        if !home.upstream().can_extend() {
            let need = validate(size, align)? + align.saturating_sub(BLOCK_ALIGN);
            // SAFETY: `&self` borrows the set that owns the pools.
            if let Some((c, tag)) = unsafe { self.shared.take_free_chunk(i, need, stream) } {
                match home.adopt_chunk(c, tag) {
                    Ok(()) => {
                        if let Some(a) = home.allocate_within(size, align, stream)? {
                            return Ok(a);
                        }
                    }
                    // Any shard's upstream can give a whole chunk back.
                    Err(_) => home.upstream().deallocate_chunk(c)?,
                }
            }
        }
        if let Some(a) = self.borrow(i, size, align, stream) {
            return Ok(a);
        }
        // Memory parked in the threads' caches is free too: before an
        // upstream call (a pinned chunk of up to 1 GiB takes a third of a
        // second to pin), flush every shard's caches and look once more.
        debug_assert!(!home.remaps(), "a remapping pool grows by mapping pages, never here");
        if self.pools().map(|(_, p)| p.drain_thread_caches()).sum::<usize>() > 0 {
            if let Some(a) = home.allocate_within(size, align, stream)? {
                return Ok(a);
            }
            if let Some(a) = self.borrow(i, size, align, stream) {
                return Ok(a);
            }
        }
        // One grower at a time: threads that need memory together (a
        // burst on every shard) would each pin a chunk, and the driver
        // serialises those calls (a third of a second per GiB). The
        // others wait here, then take from the chunk the first one made.
        // No pool lock is held while waiting or growing.
        let _one = lock(&self.growing);
        if let Some(a) = home.allocate_within(size, align, stream)? {
            return Ok(a);
        }
        if let Some(a) = self.borrow(i, size, align, stream) {
            return Ok(a);
        }
        home.allocate_for(size, align, stream)
    }

    /// A block of another shard's free memory than shard `i`'s that work
    /// on `stream` can use with no wait and that comes back on the same
    /// stream: freed on `stream` itself, or idle for a request on no
    /// stream (see [`allocate_elsewhere`](Self::allocate_elsewhere)).
    fn borrow(&self, i: usize, size: usize, align: usize, stream: u64) -> Option<Allocation> {
        let n = self.shards.len();
        // A remapping shard (shard 0 of a device) lends nothing: its free
        // space may be holes, and mapping them is its own growth.
        // The shard that lent last is asked first: it had free memory.
        let last = self.last_lender[i].load(Ordering::Relaxed);
        let order = std::iter::once(last).chain((1..n).map(|k| (i + k) % n).filter(|&j| j != last));
        let others = order.filter(|&j| j != i).filter_map(|j| Some((j, self.shards.get(j)?.get()?)));
        for (j, p) in others.filter(|(_, p)| !p.remaps()) {
            match p.allocate_uncached_within(size, align) {
                // Freed on the request's own stream: its tag orders the
                // reuse, as for a block of the shard's own.
                Ok(Some(a)) if stream != 0 && a.tag.stream == stream => {
                    self.lent_by(i, j);
                    return Some(a);
                }
                // Idle memory, for a request on no stream (the host's: the
                // pinned pool). A request on another stream is not lent
                // even idle memory: the block comes back tagged with that
                // stream and merges with the lender's pending free space
                // into blocks whose reuse waits for every stream (measured
                // on the device with a stream per thread: thousands of
                // waits, seconds in all, from a hundred loans).
                Ok(Some(a)) if stream == 0 && p.tag_settled(a.tag) => {
                    self.lent_by(i, j);
                    return Some(Allocation { tag: StreamTag::NONE, ..a });
                }
                // A block with work pending on another stream: its reuse
                // here would wait for that stream (measured on the device:
                // waits on every lent block, slower than growing). It goes
                // back as it was.
                Ok(Some(a)) => {
                    let _ = p.deallocate(a.addr, a.tag);
                }
                _ => {}
            }
        }
        None
    }

    /// Shard `j` lent to shard `i`'s thread: counted, and asked first
    /// next time.
    fn lent_by(&self, i: usize, j: usize) {
        self.shared.count_lent();
        self.last_lender[i].store(j, Ordering::Relaxed);
    }
}
