//! CUDA graphs through the manager: graph-private pools, a capture guard
//! that owns the graph it makes, and the raw form for programs that begin
//! and end captures with cudarc themselves. The rules are in
//! `device/captures.rs`.

use cudarc::driver::{sys, CudaGraph};

use super::MemoryManager;
use crate::cuda::{driver_err, next_host_capture_id, RelaxedCaptureMode, Stream};
use crate::device::{DeviceAllocator, GraphPool};
use crate::error::{Error, Result};

impl MemoryManager {
    /// A new graph-private pool on the default device. See [`GraphPool`].
    ///
    /// # Errors
    /// [`Error::ShutDown`]; errors making the device's allocator or the pool.
    pub fn graph_pool(&self) -> Result<GraphPool<'_>> {
        self.graph_pool_on(self.config.device)
    }

    /// A new graph-private pool on device `ordinal`.
    ///
    /// # Errors
    /// As [`graph_pool`](Self::graph_pool), and [`Error::NoSuchDevice`].
    pub fn graph_pool_on(&self, ordinal: usize) -> Result<GraphPool<'_>> {
        self.check_running("a graph pool")?;
        self.device(ordinal)?.graph_pool()
    }

    /// Begins capturing the work queued on `stream` into a CUDA graph whose
    /// memory comes from `pool` (`cuStreamBeginCapture`, thread-local
    /// mode). Until [`GraphCapture::end`], every allocation on `stream` (and
    /// on streams that join its capture) is served from `pool`, and blocks
    /// freed on them are kept for the graph: nothing the graph uses is
    /// handed to work outside it while the graph can replay.
    ///
    /// The stream is synchronised first, so the capture starts with no
    /// queued work that pool blocks could wait on.
    ///
    /// On the host fallback the graph is empty, but the memory rules are the
    /// same (they are tested there).
    ///
    /// # Errors
    /// [`Error::Capture`] when `stream` belongs to another device than the
    /// pool or the pool has a capture under way; a driver error.
    ///
    /// # Examples
    /// ```
    /// use cumem::{Config, MemoryManager, Stream};
    /// let mm = MemoryManager::new(Config::new())?;
    /// let stream = Stream::new()?;
    /// let pool = mm.graph_pool()?;
    /// let capture = mm.begin_capture(&stream, &pool)?;
    /// let tmp = mm.allocate_device_on(1 << 20, &stream)?; // from the graph's pool
    /// // ... queue kernels that use `tmp` on `stream` ...
    /// mm.free_device_on(tmp, &stream)?; // stays the graph's
    /// let graph = capture.end()?;
    /// graph.launch(&stream)?;
    /// stream.synchronize()?;
    /// # Ok::<(), cumem::Error>(())
    /// ```
    pub fn begin_capture<'a>(&'a self, stream: &Stream, pool: &GraphPool<'a>) -> Result<GraphCapture<'a>> {
        self.check_running("graph capture")?;
        check_device(stream, pool)?;
        if pool.is_capturing() {
            return Err(Error::Capture(format!("graph pool {} already has a capture under way", pool.id())));
        }
        {
            // Legal even while this thread captures another stream.
            let _relaxed = RelaxedCaptureMode::enter();
            stream.synchronize()?;
        }
        match stream.cudarc() {
            Some(s) => s
                .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(driver_err("cuStreamBeginCapture"))?,
            None => stream.set_host_capture(Some(next_host_capture_id())),
        }
        match CaptureScope::register(stream, pool) {
            Ok(scope) => Ok(GraphCapture { scope: Some(scope), stream: stream.clone() }),
            Err(e) => {
                // Leave the stream as it was: end and discard the capture.
                let _ = end_capture(stream);
                Err(e)
            }
        }
    }

    /// The raw form: routes the capture the caller already began on
    /// `stream` (with cudarc's `CudaStream::begin_capture`) into `pool`.
    /// Call it right after beginning the capture, before the first
    /// allocation in it, and drop (or [`end`](CaptureScope::end)) the
    /// returned scope right after ending the capture; keep `pool` (or a
    /// clone) alive as long as the graph may replay.
    ///
    /// Synchronise `stream` before beginning the capture: a block of the
    /// device pool whose last use is queued on a capturing stream can't be
    /// reused by anyone until the capture ends ([`Error::Capture`]).
    ///
    /// # Errors
    /// [`Error::Capture`] when `stream` does not capture, belongs to another
    /// device, or the pool has a capture under way; a driver error.
    pub fn capture_into<'a>(&'a self, stream: &Stream, pool: &GraphPool<'a>) -> Result<CaptureScope<'a>> {
        self.check_running("graph capture")?;
        check_device(stream, pool)?;
        CaptureScope::register(stream, pool)
    }
}

fn check_device(stream: &Stream, pool: &GraphPool<'_>) -> Result<()> {
    match stream.context().map(|c| c.ordinal()) {
        Some(ordinal) if ordinal != pool.device() => Err(Error::Capture(format!(
            "the stream belongs to device {ordinal} and the graph pool to device {}",
            pool.device()
        ))),
        _ => Ok(()),
    }
}

/// Ends `stream`'s capture: the driver's graph (`None`: host fallback, empty).
fn end_capture(stream: &Stream) -> Result<Option<CudaGraph>> {
    match stream.cudarc() {
        Some(s) => {
            // Legal even while this thread captures another stream.
            let _relaxed = RelaxedCaptureMode::enter();
            s.end_capture(sys::CUgraphInstantiate_flags(0)).map_err(driver_err("cuStreamEndCapture"))
        }
        None => {
            stream.set_host_capture(None);
            Ok(None)
        }
    }
}

/// A capture routed into a graph pool; the routing ends when it is
/// dropped or [`end`](Self::end)ed. From
/// [`MemoryManager::capture_into`].
#[derive(Debug)]
pub struct CaptureScope<'a> {
    device: &'a DeviceAllocator,
    pool: GraphPool<'a>,
    capture: u64,
}

impl<'a> CaptureScope<'a> {
    fn register(stream: &Stream, pool: &GraphPool<'a>) -> Result<Self> {
        let device = pool.allocator();
        let capture = device.register_capture(stream, pool)?;
        Ok(CaptureScope { device, pool: pool.clone(), capture })
    }

    /// The driver's id of the capture.
    pub fn capture_id(&self) -> u64 {
        self.capture
    }

    /// Ends the routing (after the capture ended).
    pub fn end(self) {}
}

impl Drop for CaptureScope<'_> {
    fn drop(&mut self) {
        self.device.unregister_capture(self.capture);
    }
}

/// A capture under way, from [`MemoryManager::begin_capture`]. End it with
/// [`end`](Self::end) to get the graph; dropped without that, it ends the
/// capture and discards what was recorded.
#[derive(Debug)]
pub struct GraphCapture<'a> {
    scope: Option<CaptureScope<'a>>,
    stream: Stream,
}

impl<'a> GraphCapture<'a> {
    /// Ends the capture (`cuStreamEndCapture`) and instantiates the graph
    /// (`cuGraphInstantiate`).
    ///
    /// # Errors
    /// A driver error: the capture was invalidated (an illegal call on the
    /// stream during the capture) or can't be instantiated. The memory the
    /// capture took stays with the pool.
    pub fn end(mut self) -> Result<CapturedGraph<'a>> {
        let scope = self.scope.take().expect("a capture is ended once");
        let graph = end_capture(&self.stream);
        let pool = scope.pool.clone();
        drop(scope);
        Ok(CapturedGraph { graph: graph?, pool })
    }
}

impl Drop for GraphCapture<'_> {
    fn drop(&mut self) {
        if let Some(scope) = self.scope.take() {
            if let Err(e) = end_capture(&self.stream) {
                eprintln!("cumem: ending an abandoned capture failed: {e}");
            }
            drop(scope);
        }
    }
}

/// A CUDA graph captured with [`MemoryManager::begin_capture`], with the
/// memory its work uses: the memory stays the graph's (its
/// [`GraphPool`]'s) until this and every other handle of the pool are
/// dropped and the driver has destroyed every graph captured into it,
/// after their launches; the next cumem call on the device then gives the
/// memory back.
pub struct CapturedGraph<'a> {
    graph: Option<CudaGraph>,
    pool: GraphPool<'a>,
}

impl Drop for CapturedGraph<'_> {
    fn drop(&mut self) {
        // Destroying the executable is legal even while this thread
        // captures another stream. Its pool goes when the driver has
        // destroyed it, after its launches.
        let _relaxed = RelaxedCaptureMode::enter();
        drop(self.graph.take());
    }
}

impl std::fmt::Debug for CapturedGraph<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CapturedGraph").field("pool", &self.pool).field("empty", &self.graph.is_none()).finish()
    }
}

impl<'a> CapturedGraph<'a> {
    /// Queues one replay of the graph on `stream` (`cuGraphLaunch`). Graphs
    /// that share a pool reuse each other's memory: queue their replays so
    /// they never overlap (on one stream, or ordered by events).
    ///
    /// # Errors
    /// A driver error; [`Error::Capture`] for a stream of another device.
    pub fn launch(&self, stream: &Stream) -> Result<()> {
        let (Some(g), Some(s)) = (&self.graph, stream.cudarc()) else { return Ok(()) };
        check_device(stream, &self.pool)?;
        s.context().bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
        // SAFETY: the executable graph is alive (owned by `g`) and the
        // stream belongs to the same context; the memory the graph's work
        // uses stays reserved for it while `self` lives.
        unsafe { sys::cuGraphLaunch(g.cu_graph_exec(), s.cu_stream()) }.result().map_err(driver_err("cuGraphLaunch"))
    }

    /// The graph's pool (its figures, or to capture more graphs into it).
    pub fn pool(&self) -> &GraphPool<'a> {
        &self.pool
    }

    /// The cudarc graph (`None` on the host fallback or for an empty capture).
    pub fn cudarc(&self) -> Option<&CudaGraph> {
        self.graph.as_ref()
    }
}

#[cfg(test)]
mod tests;
