//! Asking whether a stream captures a CUDA graph, and making the driver
//! calls cumem needs during someone's capture legal.
//!
//! # Implementation details
//!
//! While a stream captures, work queued on it is recorded into a graph
//! instead of running, and some calls become illegal: synchronising or
//! querying the capturing stream or an event recorded in it, and (in the
//! default *global* capture mode) "potentially unsafe" calls from any
//! thread, among them `cuMemAlloc`/`cuMemFree` and friends. An illegal call
//! fails and also invalidates the capture, so cumem must never make one.
//!
//! Two tools here:
//! - [`capture_of`]: the capture a stream belongs to, from
//!   `cuStreamGetCaptureInfo` (or `cuStreamIsCapturing` on drivers older
//!   than CUDA 12.3, which lack the former's current entry point). Host
//!   queues take part through a capture id of their own, so the graph
//!   rules are tested on machines without a GPU.
//! - [`RelaxedCaptureMode`]: switches the calling thread to the relaxed
//!   capture mode (`cuThreadExchangeStreamCaptureMode`) during a growth or
//!   release call, so mapping memory while another thread captures is
//!   legal (the driver's mapping calls don't touch any stream).

use cudarc::driver::sys;
use once_cell::sync::OnceCell;

use super::graph_release::HostGraphRefs;
use super::stream::Stream;
use crate::error::{Error, Result};
use crate::sync::{Arc, Ordering, StaticAtomicU64};

/// Registered captures under way in the process, on any device (a count,
/// ordering no other memory): while it is non-zero, page remapping waits
/// for no device (that would synchronise capturing streams).
static CAPTURES_UNDER_WAY: StaticAtomicU64 = StaticAtomicU64::new(0);

/// Whether a capture registered with cumem is under way on any device.
pub(crate) fn captures_under_way() -> bool {
    CAPTURES_UNDER_WAY.load(Ordering::Relaxed) > 0
}

/// Counts a registered capture that begins (`true`) or ends (`false`).
pub(crate) fn count_capture(begins: bool) {
    if begins {
        CAPTURES_UNDER_WAY.fetch_add(1, Ordering::Relaxed);
    } else {
        CAPTURES_UNDER_WAY.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Whether the driver has `cuStreamGetCaptureInfo_v3` (CUDA 12.3 on).
fn has_capture_info() -> bool {
    static HAS: OnceCell<bool> = OnceCell::new();
    *HAS.get_or_init(|| {
        // SAFETY: only looks a symbol up in the loaded driver; calls nothing.
        unsafe { sys::culib().get::<unsafe extern "C" fn()>(b"cuStreamGetCaptureInfo_v3") }.is_ok()
    })
}

/// Makes `ctx` the calling thread's current context when it is not
/// already (the legacy stream's questions go to the current context).
///
/// One `cuCtxGetCurrent` (a read of the driver's thread state) when it is
/// current, the common case: unlike `CudaContext::bind_to_thread` it
/// writes no state shared by every thread (cudarc's error slot, swapped on
/// each bind, is one cache line that all threads allocating on the legacy
/// stream would write). The answer is asked every time, never remembered:
/// the program may change the thread's context between two calls.
fn make_current(ctx: &cudarc::driver::CudaContext) -> Result<()> {
    let mut current: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: `current` is a local; the call reads this thread's context.
    unsafe { sys::cuCtxGetCurrent(&mut current) }.result().map_err(super::driver_err("cuCtxGetCurrent"))?;
    if current != ctx.cu_ctx() {
        ctx.bind_to_thread().map_err(super::driver_err("cuCtxSetCurrent"))?;
    }
    Ok(())
}

/// The id of the capture `stream` takes part in (`None`: it does not).
///
/// On drivers without `cuStreamGetCaptureInfo_v3` the id is the stream's
/// own (a capture is then recognised only on the stream it began on).
///
/// # Errors
/// [`Error::Capture`] when something illegal invalidated it; a driver error.
pub(crate) fn capture_of(stream: &Stream) -> Result<Option<u64>> {
    Ok(capture_info(stream)?.map(|(id, _)| id))
}

/// The id of the capture `stream` takes part in and the graph it records
/// into, or `None` when it does not capture. One driver call
/// (`cuStreamIsCapturing`) when it does not, a second
/// (`cuStreamGetCaptureInfo`) when it does; the context is made current
/// first only for a context's null stream, which needs it (one
/// `cuCtxGetCurrent` when it is current already: [`make_current`]).
///
/// # Errors
/// As [`capture_of`].
pub(crate) fn capture_info(stream: &Stream) -> Result<Option<(u64, CaptureGraph)>> {
    let Some(cuda) = stream.cudarc() else {
        return Ok(stream
            .host_capture()
            .map(|id| (id, stream.host_graph().map_or(CaptureGraph::Unknown, CaptureGraph::Host))));
    };
    if cuda.cu_stream().is_null() {
        make_current(cuda.context())?;
    }
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // The cheaper question first (about a fifth less on an H100): most
    // streams asked do not capture.
    // SAFETY: the stream is alive (held by `stream`); `status` is a local.
    unsafe { sys::cuStreamIsCapturing(cuda.cu_stream(), &mut status) }
        .result()
        .map_err(super::driver_err("cuStreamIsCapturing"))?;
    if status == sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
        return Ok(None);
    }
    let mut id: u64 = 0;
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    if has_capture_info() {
        // SAFETY: the stream is alive (held by `stream`); the out-pointers
        // are valid locals; the other optional outputs are null, which the
        // call allows.
        unsafe {
            sys::cuStreamGetCaptureInfo_v3(
                cuda.cu_stream(),
                &mut status,
                &mut id,
                &mut graph,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(super::driver_err("cuStreamGetCaptureInfo"))?;
    } else {
        id = stream.id();
    }
    match status {
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => Ok(None),
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE if graph.is_null() => {
            Ok(Some((id, CaptureGraph::Unknown)))
        }
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => Ok(Some((id, CaptureGraph::Cuda(graph)))),
        _ => Err(Error::Capture("the stream's capture was invalidated by an illegal call".into())),
    }
}

/// The calling thread in the relaxed capture mode until dropped
/// (`cuThreadExchangeStreamCaptureMode`): the driver calls made meanwhile
/// are legal even while other threads capture in the global mode. For
/// calls that touch no stream (mapping, allocating and releasing memory).
pub(crate) struct RelaxedCaptureMode {
    previous: Option<sys::CUstreamCaptureMode>,
}

impl RelaxedCaptureMode {
    /// Enters the relaxed mode (does nothing without a driver).
    pub(crate) fn enter() -> RelaxedCaptureMode {
        if !super::driver_status().is_available() {
            return RelaxedCaptureMode { previous: None };
        }
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: `mode` is an in/out local; only this thread's mode swaps.
        let ok = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) }.result().is_ok();
        RelaxedCaptureMode { previous: ok.then_some(mode) }
    }
}

impl Drop for RelaxedCaptureMode {
    fn drop(&mut self) {
        if let Some(mut mode) = self.previous.take() {
            // SAFETY: restores the mode saved by `enter` on this thread.
            let _ = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
        }
    }
}

/// The graph a capture records into, to tie a pool's life to.
#[derive(Clone)]
pub(crate) enum CaptureGraph {
    /// A CUDA graph under capture (`cuStreamGetCaptureInfo`).
    Cuda(sys::CUgraph),
    /// A host queue's capture cumem was not told of.
    Host(Arc<HostGraphRefs>),
    /// A capture whose graph the driver does not tell (drivers older than
    /// CUDA 12.3) or a registered host capture: nothing to tie to.
    Unknown,
}
