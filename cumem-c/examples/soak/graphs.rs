//! Graphs captured in every capture mode, replayed, checked, destroyed.

use std::sync::atomic::Ordering;

use cudarc::driver::sys;
use cumem::Stream;

use crate::work::{add_copy, check, err, fill, read, Res};
use crate::{Rng, Soak};

use sys::CUstreamCaptureMode::*;

/// How a capture begins: cumem's guard (`begin_capture`: thread-local
/// mode; `None`), or cudarc's capture in a mode, routed into the graph
/// pool (`capture_into`).
const HOWS: [Option<sys::CUstreamCaptureMode>; 4] = [
    None,
    Some(CU_STREAM_CAPTURE_MODE_GLOBAL),
    Some(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
    Some(CU_STREAM_CAPTURE_MODE_RELAXED),
];

/// A captured step (a temporary block filled, copied plus one to an output
/// allocated outside the capture, freed) replayed a few times, the output
/// cleared and checked after each replay.
pub fn capture(s: &Soak, rng: &mut Rng) -> Res {
    let how = HOWS[rng.range(0, HOWS.len())];
    let global = how == Some(CU_STREAM_CAPTURE_MODE_GLOBAL);
    // A global capture forbids unsafe calls in other threads: it runs alone.
    let (_w, _r) = if global {
        (Some(s.exclusive.write().unwrap_or_else(|e| e.into_inner())), None)
    } else {
        (None, Some(s.exclusive.read().unwrap_or_else(|e| e.into_inner())))
    };
    let _gate = s.capture_gate.read().unwrap_or_else(|e| e.into_inner());
    let mm = s.mm;
    let stream = Stream::new().map_err(err("Stream::new"))?;
    let cs = stream.cudarc().unwrap().clone();
    let n = rng.range(64, s.max_values / 2);
    let seed = rng.next() as u32;
    let out = mm.allocate_device_on(n * 4, &stream).map_err(err("allocate_device_on"))?;
    let pool = mm.graph_pool().map_err(err("graph_pool"))?;
    stream.synchronize().map_err(err("synchronize"))?;
    let body = |stream: &Stream| -> Res {
        let tmp = mm.allocate_device_on(n * 4, stream).map_err(err("allocate_device_on in a capture"))?;
        fill(s, &cs, tmp, seed, n)?;
        add_copy(&s.add_copy, &cs, out, tmp, 1, n)?;
        mm.free_device_on(tmp, stream).map_err(err("free_device_on in a capture"))
    };
    let replays = rng.range(1, 4);
    let replay = |launch: &dyn Fn() -> Res| -> Res {
        for _ in 0..replays {
            // SAFETY: `out` holds `n` u32; the memset is queued on the stream.
            unsafe { sys::cuMemsetD32Async(out, 0, n, stream.cu_stream()) }
                .result()
                .map_err(err("cuMemsetD32Async"))?;
            launch()?;
            check(s, "a graph's output", &read(s, &stream, out, n)?, seed, 1);
        }
        Ok(())
    };
    let r = match how {
        None => {
            let g = mm.begin_capture(&stream, &pool).map_err(err("begin_capture"))?;
            let b = body(&stream);
            let graph = g.end().map_err(err("end capture"));
            b?;
            let graph = graph?;
            s.graphs.fetch_add(1, Ordering::Relaxed);
            replay(&|| graph.launch(&stream).map_err(err("graph launch")))
        }
        Some(mode) => {
            cs.begin_capture(mode).map_err(err("cuStreamBeginCapture"))?;
            let scope = match mm.capture_into(&stream, &pool) {
                Ok(scope) => scope,
                Err(e) => {
                    let _ = cs.end_capture(sys::CUgraphInstantiate_flags(0));
                    return Err(format!("capture_into: {e}"));
                }
            };
            let b = body(&stream);
            let graph = cs.end_capture(sys::CUgraphInstantiate_flags(0));
            drop(scope);
            b?;
            let graph = graph.map_err(err("cuStreamEndCapture"))?.ok_or("an empty graph")?;
            s.graphs.fetch_add(1, Ordering::Relaxed);
            replay(&|| graph.launch().map_err(err("graph launch")))
        }
    };
    let freed = mm.free_device_on(out, &stream).map_err(err("free_device_on"));
    r.map_err(|e| format!("{}: {e}", how.map_or_else(|| "begin_capture".into(), |m| format!("{m:?}"))))?;
    freed
}
