//! Streams: cumem's handle on a CUDA stream (or a no-op queue on the host
//! fallback), and the counters of the frees queued on it.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaStream};

use super::driver_err;
use super::free_clock::FreeClock;
use super::graph_release::HostGraphRefs;
use crate::error::Result;
use crate::sync::{lock, AtomicBool, AtomicU64, AtomicUsize, Mutex, Ordering, StaticAtomicU64};
use crate::tag::StreamTag;

fn next_stream_id() -> u64 {
    // 0 is `StreamTag::NONE` and u64::MAX `StreamTag::MIXED`.
    static NEXT: StaticAtomicU64 = StaticAtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// A queue of work on one device: a CUDA stream, or on the host fallback a
/// queue that runs everything at once.
///
/// Cloning is cheap and the clones are the same stream. Convert a cudarc
/// stream once with [`Stream::from_cudarc`] and keep the result: each
/// conversion is a distinct identity for cumem's stream-ordered reuse
/// (still correct, but it adds waits).
///
/// # Examples
/// ```
/// use cumem::{DeviceBuffer, Stream};
/// let stream = Stream::new()?; // a host queue on the fallback
/// let buf = DeviceBuffer::<f32>::new_on(1024, &stream)?;
/// stream.synchronize()?;
/// drop(buf); // freed in stream order
/// # Ok::<(), cumem::Error>(())
/// ```
#[derive(Clone)]
pub struct Stream {
    inner: Arc<StreamInner>,
}

struct StreamInner {
    id: u64,
    cuda: Option<Arc<CudaStream>>,
    /// The ordinal of the stream's device (read once, so dispatch by stream
    /// costs no driver call); `None` for a host queue.
    device: Option<usize>,
    /// The sequence numbers of frees on this stream, and which are known
    /// complete (the host synchronised the stream after them).
    frees: FreeClock,
    /// The registry this stream was last registered in (its address), so a
    /// free on the stream usually skips the registry's lock.
    registered_in: AtomicUsize,
    /// A host queue's capture under way (0: none): host queues model graph
    /// capture so its rules hold, and are tested, without a GPU.
    host_capture: AtomicU64,
    /// The "graph" of a host queue's capture begun without telling cumem
    /// (graph_release.rs): what ties its memory's life to the graph.
    host_graph: Mutex<Option<crate::sync::Arc<HostGraphRefs>>>,
    /// Per stream this one waited for ([`Stream::wait_for_frees`]): the
    /// other stream's free counts read before its event was recorded. Work
    /// queued here since is ordered after every free counted there.
    waited: Mutex<Vec<(u64, Box<[u64]>)>>,
    /// Whether the CUDA handle is gone ([`Stream::forget_handle`]).
    gone: AtomicBool,
    /// Driver calls cumem makes on the stream for its own reasons now:
    /// [`Stream::forget_handle`] waits until none is left, so the handle
    /// never dies under a call (and calls never wait for each other).
    calls: AtomicUsize,
    /// Held by [`Stream::forget_handle`].
    forgetting: Mutex<()>,
}

impl StreamInner {
    fn new(cuda: Option<Arc<CudaStream>>) -> Arc<Self> {
        let device = cuda.as_ref().map(|s| s.context().ordinal());
        Arc::new(StreamInner {
            id: next_stream_id(),
            cuda,
            device,
            frees: FreeClock::new(),
            registered_in: AtomicUsize::new(0),
            host_capture: AtomicU64::new(0),
            host_graph: Mutex::new(None),
            waited: Mutex::new(Vec::new()),
            gone: AtomicBool::new(false),
            calls: AtomicUsize::new(0),
            forgetting: Mutex::new(()),
        })
    }
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream")
            .field("id", &self.inner.id)
            .field("cuda", &self.inner.cuda.is_some())
            .field("device", &self.inner.device)
            .finish()
    }
}

impl Stream {
    /// A new non-blocking stream on `ordinal` (`cuStreamCreate`); a host queue.
    ///
    /// # Errors
    /// A driver error, or [`Error::NoSuchDevice`](crate::Error::NoSuchDevice).
    pub fn new_on(ordinal: usize) -> Result<Stream> {
        match super::device_context(ordinal)? {
            Some(ctx) => Ok(Stream::from_cudarc(ctx.new_stream().map_err(driver_err("cuStreamCreate"))?)),
            None => Ok(Stream::host()),
        }
    }

    /// A new stream on the default device (see [`Stream::new_on`]): the
    /// global manager's [`Config::device`](crate::Config::device) once it
    /// exists, else `CUMEM_CONF`'s `device` (0 when unset).
    ///
    /// # Errors
    /// As [`Stream::new_on`].
    pub fn new() -> Result<Stream> {
        Stream::new_on(super::default_ordinal())
    }

    /// A host queue: work "queued" on it has already happened.
    pub fn host() -> Stream {
        Stream { inner: StreamInner::new(None) }
    }

    /// Wraps a cudarc stream so cumem can order allocations on it.
    pub fn from_cudarc(stream: Arc<CudaStream>) -> Stream {
        Stream { inner: StreamInner::new(Some(stream)) }
    }

    /// The cudarc stream, or `None` on the host fallback.
    pub fn cudarc(&self) -> Option<&Arc<CudaStream>> {
        self.inner.cuda.as_ref()
    }

    /// The raw `CUstream` (null on the host fallback).
    pub fn cu_stream(&self) -> sys::CUstream {
        self.inner.cuda.as_ref().map_or(std::ptr::null_mut(), |s| s.cu_stream())
    }

    /// The context the stream belongs to, if it is a CUDA stream.
    pub fn context(&self) -> Option<&Arc<CudaContext>> {
        self.inner.cuda.as_ref().map(|s| s.context())
    }

    /// The ordinal of the device the stream belongs to (its context's
    /// device, read once when the `Stream` was made); `None` for a host
    /// queue. Every cumem call that takes a stream works on this device.
    pub fn device(&self) -> Option<usize> {
        self.inner.device
    }

    /// Whether this is a host queue.
    pub fn is_host(&self) -> bool {
        self.inner.cuda.is_none()
    }

    /// The stream's identity for cumem's stream-ordered reuse.
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// The stream registry this stream was last registered in (its
    /// address; 0: none), so a free on the stream usually skips the
    /// registry's lock.
    pub(crate) fn registration(&self) -> &AtomicUsize {
        &self.inner.registered_in
    }

    /// The capture a host queue takes part in (always `None` for CUDA
    /// streams: ask the driver, `capture::capture_of`).
    pub(crate) fn host_capture(&self) -> Option<u64> {
        match self.inner.host_capture.load(Ordering::Acquire) {
            0 => None,
            id => Some(id),
        }
    }

    /// Starts (`Some(id)`) or ends (`None`) a host queue's capture.
    pub(crate) fn set_host_capture(&self, id: Option<u64>) {
        self.inner.host_capture.store(id.unwrap_or(0), Ordering::Release);
    }

    /// The "graph" of a host capture under way that cumem was not told of.
    pub(crate) fn host_graph(&self) -> Option<crate::sync::Arc<HostGraphRefs>> {
        lock(&self.inner.host_graph).clone()
    }

    /// Replaces the host capture's "graph"; returns the one before.
    pub(crate) fn set_host_graph(
        &self,
        refs: Option<crate::sync::Arc<HostGraphRefs>>,
    ) -> Option<crate::sync::Arc<HostGraphRefs>> {
        std::mem::replace(&mut *lock(&self.inner.host_graph), refs)
    }

    /// Whether `self` and `other` are clones of one `Stream`.
    pub fn same_as(&self, other: &Stream) -> bool {
        self.inner.id == other.inner.id
    }

    /// How many handles (clones) of this stream exist.
    pub(crate) fn handles(&self) -> usize {
        Arc::strong_count(&self.inner)
    }

    /// A fresh tag for a block freed on this stream now.
    pub(crate) fn free_tag(&self) -> StreamTag {
        StreamTag { stream: self.inner.id, seq: self.inner.frees.tick() }
    }

    /// Whether the free tagged `tag` on this stream is known complete.
    pub(crate) fn completed(&self, tag: StreamTag) -> bool {
        self.inner.frees.completed(tag.seq)
    }

    /// Whether some free on this stream is not known complete yet (no
    /// host synchronisation or question saw its work done): its memory may
    /// still wait for the stream.
    pub fn has_pending_frees(&self) -> bool {
        !self.inner.frees.all_complete()
    }

    /// Whether every free on this stream so far is known complete.
    pub(crate) fn all_frees_complete(&self) -> bool {
        self.inner.frees.all_complete()
    }

    /// Waits until the stream's queued work is done (`cuStreamSynchronize`).
    ///
    /// # Errors
    /// A driver error from the stream's work.
    pub fn synchronize(&self) -> Result<()> {
        self.unless_gone(|| self.synchronize_now()).map(|_| ())
    }

    fn synchronize_now(&self) -> Result<()> {
        let Some(s) = &self.inner.cuda else { return Ok(()) };
        // Every free counted in `seen` was queued before this call, so once
        // the stream is idle they are all complete.
        let seen = self.inner.frees.seen();
        s.synchronize().map_err(driver_err("cuStreamSynchronize"))?;
        self.inner.frees.mark_complete(&seen);
        Ok(())
    }

    /// Runs `f` (a driver call on the stream) unless the program said the
    /// stream's handle is gone ([`forget_handle`](Self::forget_handle));
    /// `None` then. The handle can't go while `f` runs.
    pub(crate) fn unless_gone<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<Option<R>> {
        // Announced before the flag is read; `forget_handle` sets the flag
        // before it reads the count (both sequentially consistent), so
        // either this call sees the flag or the forget sees this call.
        struct Call<'a>(&'a AtomicUsize);
        impl Drop for Call<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::Release);
            }
        }
        self.inner.calls.fetch_add(1, Ordering::SeqCst);
        // Counted down however `f` ends (a panic too: forget must not hang).
        let _call = Call(&self.inner.calls);
        if self.inner.gone.load(Ordering::SeqCst) {
            return Ok(None);
        }
        f().map(Some)
    }

    /// Whether the program said the stream's handle is gone.
    pub fn is_forgotten(&self) -> bool {
        self.inner.gone.load(Ordering::Acquire)
    }

    /// Says the stream's CUDA handle is about to be destroyed (call it
    /// before `cuStreamDestroy` / `cudaStreamDestroy` of a stream cumem
    /// ordered frees on): waits once for the work queued on it
    /// (`cuStreamSynchronize`), so every free on it is complete, and from
    /// then on cumem never asks, waits on or synchronises the handle again
    /// (a destroyed handle is undefined behaviour for the driver). It
    /// returns once cumem's own calls on the stream that began before it
    /// (a question, a wait) are done. A second call does nothing.
    ///
    /// # Errors
    /// [`Error::Capture`](crate::Error::Capture) while the stream captures
    /// a graph (waiting would break the capture; nothing changes), or the
    /// driver's error from the wait (the stream is then not forgotten).
    pub fn forget_handle(&self) -> Result<()> {
        let _one_at_a_time = lock(&self.inner.forgetting);
        if self.is_forgotten() {
            return Ok(());
        }
        if self.inner.cuda.is_some() && super::capture_of(self)?.is_some() {
            return Err(crate::error::Error::Capture(
                "a stream that captures a graph can't be forgotten (end the capture first)".into(),
            ));
        }
        self.synchronize_now()?;
        self.inner.gone.store(true, Ordering::SeqCst);
        // Calls that began before the flag was set finish first.
        let mut attempt = 0;
        while self.inner.calls.load(Ordering::Acquire) != 0 {
            crate::sync::backoff(attempt);
            attempt += 1;
        }
        Ok(())
    }

    /// Asks, without waiting, whether all work queued on the stream is
    /// done (`cuStreamQuery`); when it is, every free counted before the
    /// question is known complete from then on (as after
    /// [`synchronize`](Self::synchronize)). Never call it on a stream that
    /// may be capturing a graph (the question is illegal there).
    ///
    /// # Errors
    /// A driver error from the stream's work.
    pub(crate) fn poll_idle(&self) -> Result<bool> {
        // A forgotten stream's frees were all complete when it was forgotten.
        Ok(self.unless_gone(|| self.poll_idle_now())?.unwrap_or(true))
    }

    fn poll_idle_now(&self) -> Result<bool> {
        let Some(s) = &self.inner.cuda else { return Ok(true) };
        let seen = self.inner.frees.seen();
        crate::fault::check_driver(crate::fault::Point::StreamQuery).map_err(driver_err("cuStreamQuery"))?;
        // SAFETY: the stream is alive (held by `self`); the call only asks.
        match unsafe { cudarc::driver::sys::cuStreamQuery(s.cu_stream()) } {
            cudarc::driver::sys::cudaError_enum::CUDA_SUCCESS => {
                self.inner.frees.mark_complete(&seen);
                Ok(true)
            }
            cudarc::driver::sys::cudaError_enum::CUDA_ERROR_NOT_READY => Ok(false),
            e => Err(driver_err("cuStreamQuery")(cudarc::driver::DriverError(e))),
        }
    }

    /// Orders all work queued on `self` after the work queued on `other`
    /// so far (`cuEventRecord` on `other`, `cuStreamWaitEvent` on `self`).
    ///
    /// # Errors
    /// A driver error.
    pub fn wait_for(&self, other: &Stream) -> Result<()> {
        match (&self.inner.cuda, &other.inner.cuda) {
            // A forgotten stream's work was complete when it was forgotten:
            // nothing to wait for (and its handle may be gone).
            (Some(me), Some(them)) => other
                .unless_gone(|| {
                    crate::fault::check_driver(crate::fault::Point::EventRecord)
                        .and_then(|()| me.join(them))
                        .map_err(driver_err("cuStreamWaitEvent"))
                })
                .map(|_| ()),
            _ => Ok(()),
        }
    }
}

/// Waits a stream remembers (per other stream) for leaving out later ones.
const WAITED_KEPT: usize = 16;

impl Stream {
    /// [`wait_for`](Self::wait_for), remembering which of `other`'s frees
    /// the wait covers: they were counted before the event was recorded,
    /// so work queued here afterwards runs after them.
    ///
    /// # Errors
    /// A driver error.
    pub(crate) fn wait_for_frees(&self, other: &Stream) -> Result<()> {
        let seen = other.inner.frees.seen();
        self.wait_for(other)?;
        let mut waited = lock(&self.inner.waited);
        match waited.iter_mut().find(|(id, _)| *id == other.id()) {
            Some((_, counts)) => {
                for (c, n) in counts.iter_mut().zip(&seen) {
                    *c = (*c).max(*n);
                }
            }
            None => {
                // Forgetting a wait only costs a later wait: keep the
                // newest few (threads that come and go leave streams).
                if waited.len() >= WAITED_KEPT {
                    waited.remove(0);
                }
                waited.push((other.id(), seen.into_boxed_slice()))
            }
        }
        Ok(())
    }

    /// Whether this stream already waited for `other` after the free
    /// tagged `tag` (a tag of `other`, or [`StreamTag::MIXED`]: every free
    /// on `other` so far): work queued here needs no new wait for it.
    pub(crate) fn waited_for(&self, other: &Stream, tag: StreamTag) -> bool {
        let waited = lock(&self.inner.waited);
        let Some((_, counts)) = waited.iter().find(|(id, _)| *id == other.id()) else { return false };
        if tag.stream == other.id() {
            FreeClock::counted_in(counts, tag.seq)
        } else {
            other.inner.frees.all_counted_in(counts)
        }
    }
}

impl From<Arc<CudaStream>> for Stream {
    fn from(s: Arc<CudaStream>) -> Self {
        Stream::from_cudarc(s)
    }
}

#[cfg(all(test, not(loom)))]
mod wait_tests {
    use super::Stream;
    use crate::tag::StreamTag;

    #[test]
    fn a_wait_covers_the_frees_counted_before_it_and_no_later_one() {
        let (src, user, other) = (Stream::host(), Stream::host(), Stream::host());
        let early = src.free_tag();
        assert!(!user.waited_for(&src, early), "no wait yet");
        user.wait_for_frees(&src).unwrap();
        assert!(user.waited_for(&src, early));
        assert!(user.waited_for(&src, StreamTag::MIXED), "every free so far is covered");
        assert!(!other.waited_for(&src, early), "another stream did not wait");
        let late = src.free_tag();
        assert!(!user.waited_for(&src, late), "freed after the wait");
        assert!(!user.waited_for(&src, StreamTag::MIXED));
        // A free on another thread counts on its own shard.
        let src2 = src.clone();
        let remote = std::thread::spawn(move || src2.free_tag()).join().unwrap();
        user.wait_for_frees(&src).unwrap();
        assert!(user.waited_for(&src, late) && user.waited_for(&src, remote));
        assert!(!user.waited_for(&src, StreamTag { stream: src.id(), seq: crate::cuda::PENDING }));
    }
}
