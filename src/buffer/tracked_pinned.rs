//! [`TrackedPinnedVec`]: a [`PinnedVec`] that cudarc's asynchronous
//! copies can use soundly (cudarc's `HostSlice` trait).

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaStream, HostSlice, SyncOnDrop};
use once_cell::sync::OnceCell;

use crate::alloc::PinnedVec;
use crate::cuda::driver_err;
use crate::error::Result;

/// A [`PinnedVec`] with an event that follows cudarc's copies into and out
/// of it, so that `stream.memcpy_htod(&v, &mut buf)` and
/// `stream.memcpy_dtoh(&buf, &mut v)` run truly asynchronously from pinned
/// memory while the host can't touch the data before they finish.
///
/// A plain `&[T]` from a `PinnedVec` is accepted by cudarc too, but nothing
/// then stops the host from changing or freeing the memory while the DMA
/// still runs. Here every host access ([`as_slice`](Self::as_slice),
/// [`as_mut_slice`](Self::as_mut_slice), [`into_inner`](Self::into_inner),
/// drop) first waits for the copies (`cuEventSynchronize`).
///
/// When the context does not manage stream synchronisation (one stream
/// only, or event tracking off), cudarc records no events; the copy then
/// waits for its stream before returning, which is always sound.
///
/// # Examples
/// ```
/// use cumem::{PinnedAlloc, PinnedVec, TrackedPinnedVec};
/// let mut v: PinnedVec<u32> = PinnedVec::new_in(PinnedAlloc);
/// v.extend([1, 2, 3]);
/// let tracked = TrackedPinnedVec::new(v);
/// // ... stream.memcpy_htod(&tracked, &mut device_buffer)? with a CUDA stream
/// assert_eq!(tracked.as_slice()?, &[1, 2, 3]);
/// # Ok::<(), cumem::Error>(())
/// ```
pub struct TrackedPinnedVec<T> {
    vec: PinnedVec<T>,
    /// The last copy through cudarc, recorded after it was queued.
    event: OnceCell<CudaEvent>,
}

impl<T> std::fmt::Debug for TrackedPinnedVec<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrackedPinnedVec").field("len", &self.vec.len()).finish()
    }
}

impl<T> TrackedPinnedVec<T> {
    /// Wraps `vec`.
    pub fn new(vec: PinnedVec<T>) -> Self {
        TrackedPinnedVec { vec, event: OnceCell::new() }
    }

    /// The number of values.
    pub fn len(&self) -> usize {
        self.vec.len()
    }

    /// Whether there are no values.
    pub fn is_empty(&self) -> bool {
        self.vec.is_empty()
    }

    /// Waits for the copies cudarc queued with it (`cuEventSynchronize`).
    ///
    /// # Errors
    /// A driver error (from the copies' stream).
    pub fn wait(&self) -> Result<()> {
        match self.event.get() {
            Some(e) => e.synchronize().map_err(driver_err("cuEventSynchronize")),
            None => Ok(()),
        }
    }

    /// The values, once the queued copies are done.
    ///
    /// # Errors
    /// As [`wait`](Self::wait).
    pub fn as_slice(&self) -> Result<&[T]> {
        self.wait()?;
        Ok(&self.vec)
    }

    /// The values, mutably, once the queued copies are done.
    ///
    /// # Errors
    /// As [`wait`](Self::wait).
    pub fn as_mut_slice(&mut self) -> Result<&mut [T]> {
        self.wait()?;
        Ok(&mut self.vec)
    }

    /// The vector, once the queued copies are done.
    ///
    /// # Errors
    /// As [`wait`](Self::wait); the vector is kept (waited for again on drop).
    pub fn into_inner(mut self) -> Result<PinnedVec<T>> {
        self.wait()?;
        self.event.take();
        let empty = PinnedVec::new_in(crate::alloc::PinnedAlloc);
        Ok(std::mem::replace(&mut self.vec, empty))
    }

    /// The event to track a copy on `stream`, if cudarc will record it:
    /// `None` means the copy must wait for its stream instead.
    fn event_for(&self, stream: &CudaStream) -> Option<&CudaEvent> {
        let ctx: &Arc<_> = stream.context();
        if !ctx.is_managing_stream_synchronization() {
            return None;
        }
        let event = self.event.get_or_try_init(|| ctx.new_event(None)).ok()?;
        // An event records only streams of its own context.
        (event.context() == ctx).then_some(event)
    }
}

impl<T> Drop for TrackedPinnedVec<T> {
    fn drop(&mut self) {
        if let Err(e) = self.wait() {
            eprintln!("cumem: waiting for copies of a TrackedPinnedVec: {e}");
        }
    }
}

impl<T> HostSlice<T> for TrackedPinnedVec<T> {
    fn len(&self) -> usize {
        self.vec.len()
    }

    unsafe fn stream_synced_slice<'a>(&'a self, stream: &'a CudaStream) -> (&'a [T], SyncOnDrop<'a>) {
        match self.event_for(stream) {
            Some(event) => {
                // Earlier copies into the vector come first.
                stream.context().record_err(stream.wait(event));
                (&self.vec, SyncOnDrop::Record(Some((event, stream))))
            }
            None => (&self.vec, SyncOnDrop::sync_stream(stream)),
        }
    }

    unsafe fn stream_synced_mut_slice<'a>(&'a mut self, stream: &'a CudaStream) -> (&'a mut [T], SyncOnDrop<'a>) {
        // Borrow the event and the vector apart.
        let TrackedPinnedVec { vec, event } = self;
        let ctx = stream.context();
        let ev = match ctx.is_managing_stream_synchronization() {
            true => event.get_or_try_init(|| ctx.new_event(None)).ok().filter(|e| e.context() == ctx),
            false => None,
        };
        match ev {
            Some(ev) => {
                ctx.record_err(stream.wait(ev));
                (vec.as_mut_slice(), SyncOnDrop::Record(Some((ev, stream))))
            }
            None => (vec.as_mut_slice(), SyncOnDrop::sync_stream(stream)),
        }
    }
}
