//! Cross-stream reuse: the streams blocks were freed on, and the waits
//! that order a block's reuse on another stream after its last use.

use std::collections::{BTreeSet, HashMap};

use cudarc::driver::CudaContext;

use crate::cuda::{capture_of, driver_err, EventPool, Stream};
use crate::error::Result;
use crate::sync::{lock, AtomicU64, Mutex, Ordering};
use crate::tag::{Fence, StreamTag};
use std::sync::Arc;

/// The streams blocks were freed on, by id, so that a block freed on one
/// stream and reused on another can be ordered after the first stream's
/// work. Holding the stream keeps it alive while blocks may refer to it.
#[derive(Default)]
pub(crate) struct StreamRegistry {
    streams: Mutex<Known>,
    /// Reuses that had to wait for another stream's work (an event wait,
    /// or the host waiting), and the nanoseconds those waits took to issue.
    waits: AtomicU64,
    wait_ns: AtomicU64,
    /// Waits left out: the user had waited for a later point of the freer.
    elided: AtomicU64,
    /// Events for the fences of page moves ([`fence_on`](Self::fence_on)).
    events: Arc<EventPool>,
}

/// The streams a registry knows.
#[derive(Default)]
struct Known {
    live: HashMap<u64, Stream>,
    /// Streams let go: nothing but the registry held them and every free
    /// on them was known complete, so a block tagged with one needs no
    /// wait (and no stream to wait on). At most [`RETIRED_KEPT`], the
    /// oldest (lowest id) forgotten first.
    retired: BTreeSet<u64>,
    /// Look for streams to let go when `live` reaches this many.
    prune_at: usize,
}

/// Streams kept before the first look for ones to let go.
const PRUNE_FIRST: usize = 32;

/// Ids of streams let go that a registry remembers. A block freed on a
/// stream forgotten beyond this is treated as freed on a stream the
/// registry never saw: correct, at the cost of one device-wide wait when
/// another stream reuses it (none of that while a capture is under way:
/// the reuse is refused). Blocks are reused long before thousands of
/// streams have come and gone, so the bound only caps memory.
pub(crate) const RETIRED_KEPT: usize = 1024;

impl Known {
    /// Moves the streams nobody else holds and whose frees are all
    /// complete to `retired`; returns them, to be dropped (a driver call)
    /// after the lock.
    fn prune(&mut self) -> Vec<Stream> {
        let done: Vec<u64> =
            self.live.iter().filter(|(_, s)| s.handles() == 1 && s.all_frees_complete()).map(|(&id, _)| id).collect();
        let gone = done.iter().filter_map(|id| self.live.remove(id)).collect();
        self.retired.extend(done);
        while self.retired.len() > RETIRED_KEPT {
            self.retired.pop_first();
        }
        self.prune_at = (self.live.len() * 2).max(PRUNE_FIRST);
        gone
    }
}

impl StreamRegistry {
    /// Remembers `stream` (before a block is freed on it, and before an
    /// allocation on it that may move memory: a fence for it needs its
    /// handle). Streams that threads made and dropped are let go here once
    /// their frees are known complete, so a program whose threads come and
    /// go with streams of their own keeps neither the streams nor the cost
    /// of scanning them.
    pub(crate) fn register(&self, stream: &Stream) {
        if stream.is_host() {
            return;
        }
        let me = self as *const StreamRegistry as usize;
        if stream.registration().load(Ordering::Acquire) == me {
            return;
        }
        let gone = {
            let mut known = lock(&self.streams);
            known.live.entry(stream.id()).or_insert_with(|| stream.clone());
            if known.live.len() >= known.prune_at.max(PRUNE_FIRST) {
                known.prune()
            } else {
                Vec::new()
            }
        };
        stream.registration().store(me, Ordering::Release);
        drop(gone);
    }

    /// Whether the work of the free tagged `tag` is known complete (for
    /// [`TagOracle`](crate::tag::TagOracle): one look-up under the
    /// registry's lock, no driver call).
    pub(crate) fn completed(&self, tag: StreamTag) -> bool {
        if tag == StreamTag::NONE {
            return true;
        }
        if tag == StreamTag::MIXED {
            return false;
        }
        let known = lock(&self.streams);
        known.retired.contains(&tag.stream) || known.live.get(&tag.stream).is_some_and(|s| s.completed(tag))
    }

    /// Whether a block tagged `tag` needs no ordering before `user` uses
    /// it: no stream's work uses it, or `user` freed it (its own queue
    /// orders the reuse). The first look of
    /// [`order_reuse`](Self::order_reuse), with no lock and no driver call.
    #[inline]
    pub(crate) fn reuse_is_ordered(tag: StreamTag, user: Option<&Stream>) -> bool {
        tag == StreamTag::NONE || user.is_some_and(|u| u.id() == tag.stream)
    }

    /// Makes a block last freed under `tag` safe for work on `user` (or, with
    /// `None`, for the host and any stream): nothing to do when the free's
    /// work is known complete or `user` is the freeing stream; otherwise
    /// `user` waits for the freeing stream's work (an event), or the host
    /// waits when there is no `user`.
    ///
    /// A source stream that captures is never synchronised or waited on
    /// from outside its capture: that would break the capture, so the reuse
    /// is refused with [`Error::Capture`](crate::error::Error::Capture)
    /// instead. Each source stream is asked before it is waited on
    /// (`cuStreamIsCapturing`), whatever the configuration promised: a
    /// capture cumem was not told of (PyTorch's, under
    /// `promise_registered_captures`) must not be broken either, and the
    /// question is cheap beside the wait it guards. `captures` (a capture
    /// cumem knows of is under way on the device) refuses the one wait no
    /// stream can be asked about: the whole device's, for a stream cumem
    /// never saw.
    pub(crate) fn order_reuse(
        &self,
        tag: StreamTag,
        user: Option<&Stream>,
        ctx: &CudaContext,
        captures: bool,
    ) -> Result<()> {
        if Self::reuse_is_ordered(tag, user) {
            return Ok(());
        }
        let sources: Vec<Stream> = {
            let known = lock(&self.streams);
            if tag == StreamTag::MIXED {
                known.live.values().filter(|s| !s.all_frees_complete()).cloned().collect()
            } else if known.retired.contains(&tag.stream) {
                return Ok(());
            } else {
                match known.live.get(&tag.stream) {
                    Some(s) if s.completed(tag) => return Ok(()),
                    Some(s) => vec![s.clone()],
                    None => Vec::new(),
                }
            }
        };
        if sources.is_empty() && tag != StreamTag::MIXED {
            if captures {
                return Err(crate::error::Error::Capture(
                    "a block freed on a stream cumem never saw can't be reused while a capture is under way".into(),
                ));
            }
            // A stream this registry never saw: wait for the whole device.
            return ctx.synchronize().map_err(driver_err("cuCtxSynchronize"));
        }
        let start = std::time::Instant::now();
        let mut waited = false;
        for src in sources.iter().filter(|s| user.is_none_or(|u| u.id() != s.id())) {
            // A stream that waited for a later point of the source: no wait.
            if user.is_some_and(|u| !u.is_host() && u.waited_for(src, tag)) {
                self.elided.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            // A forgotten source (its handle may be gone) is never asked.
            if let Some(capture) = src.unless_gone(|| capture_of(src))?.flatten() {
                // Between two streams of one capture an event edge is legal
                // (a graph-private pool's reuse); from outside it is not.
                let inside = match user {
                    Some(u) if !u.is_host() => capture_of(u)? == Some(capture),
                    _ => false,
                };
                if !inside {
                    return Err(crate::error::Error::Capture(
                        "the block's last use is queued on a stream that now captures a graph; synchronize \
                         streams before beginning a capture"
                            .into(),
                    ));
                }
            }
            // A source that is idle now needs no wait, and once asked,
            // all its frees so far are known complete: for this block and
            // every other tagged with it up to now, so later merges keep
            // their own stream's tag instead of becoming MIXED. One
            // question (`cuStreamQuery`) before each wait, which it saves
            // where it finds the stream idle: threads that come and go
            // with streams of their own and never synchronise them leave
            // many blocks whose streams are idle, dropped or not.
            if !captures && src.poll_idle()? {
                continue;
            }
            waited = true;
            match user {
                Some(u) if !u.is_host() => u.wait_for_frees(src)?,
                _ => src.synchronize()?,
            }
        }
        if waited {
            self.waits.fetch_add(1, Ordering::Relaxed);
            self.wait_ns.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
        Ok(())
    }

    /// A fence at the end of the work queued so far on the registered
    /// stream `on`, with the work queued on stream `then` from now on
    /// ordered after it (see [`FenceMaker`](crate::tag::FenceMaker)):
    /// `None` for a stream the registry does not hold.
    /// `on` = [`StreamTag::MIXED`]'s stream: a fence on every registered
    /// stream with frees not known complete (memory of blocks freed on
    /// several streams; a block's free registers its stream).
    pub(crate) fn fence_on(&self, on: u64, then: u64) -> Option<Arc<dyn Fence>> {
        let known = lock(&self.streams);
        let then = known.live.get(&then).cloned()?;
        if on == StreamTag::MIXED.stream {
            let pending: Vec<Stream> = known.live.values().filter(|s| !s.all_frees_complete()).cloned().collect();
            drop(known);
            return crate::cuda::fence_on_all(&pending, &then, &self.events);
        }
        let on = known.live.get(&on).cloned()?;
        drop(known);
        crate::cuda::fence_on(&on, &then, &self.events)
    }

    /// Reuses that waited for another stream so far, and ns spent issuing them.
    pub(crate) fn waits(&self) -> (u64, u64) {
        (self.waits.load(Ordering::Relaxed), self.wait_ns.load(Ordering::Relaxed))
    }

    /// Waits left out: the user had waited for a later point of the freer.
    pub(crate) fn waits_elided(&self) -> u64 {
        self.elided.load(Ordering::Relaxed)
    }

    /// Streams held, and ids of streams let go that are remembered.
    pub(crate) fn sizes(&self) -> (usize, usize) {
        let known = lock(&self.streams);
        (known.live.len(), known.retired.len())
    }

    /// The streams registered.
    pub(crate) fn streams(&self) -> Vec<Stream> {
        lock(&self.streams).live.values().cloned().collect()
    }

    /// Forgets every stream (their blocks' tags are cleared or settled).
    pub(crate) fn clear(&self) {
        let me = self as *const StreamRegistry as usize;
        let streams = std::mem::take(&mut lock(&self.streams).live);
        for s in streams.values() {
            // The next free on the stream registers it here again.
            let _ = s.registration().compare_exchange(me, 0, Ordering::AcqRel, Ordering::Acquire);
        }
    }

    /// Waits for every registered stream with frees not known complete
    /// (before memory goes back to the driver). A stream whose frees are
    /// all known complete is not touched: nothing freed waits for it, and
    /// its handle may be gone (a raw stream a C program destroyed).
    pub(crate) fn synchronize_all(&self) -> Result<()> {
        let streams: Vec<Stream> =
            lock(&self.streams).live.values().filter(|s| !s.all_frees_complete()).cloned().collect();
        for s in streams {
            s.synchronize()?;
        }
        Ok(())
    }
}

#[cfg(all(test, not(loom)))]
mod tests;
