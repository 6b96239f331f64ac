//! Captures made with cudarc's API at the edges: two at once on two
//! threads, a capture that fails, a block pending on a stream that begins
//! a capture, a stream that joins a capture, a shared pool released while
//! a capture cumem is not told of goes on.

use super::*;

/// A graph made on one thread and replayed on another.
struct SendGraph(cudarc::driver::CudaGraph);

// SAFETY: the driver's graph and executable handles may be used from any
// thread; the wrapper is moved once, after the capture ended, and used by
// one thread at a time.
unsafe impl Send for SendGraph {}

#[test]
fn two_cudarc_captures_at_once_on_two_threads() {
    let Some(ctx) = gpu_for_test("two_cudarc_captures_at_once_on_two_threads") else { return };
    let _serial = serial();
    let k = Arc::new(kernels(&ctx));
    let mm = Arc::new(MemoryManager::new(config()).unwrap());
    let go = Arc::new(Barrier::new(2));
    let workers: Vec<_> = (0..2u32)
        .map(|i| {
            let (mm, k, go, ctx) = (mm.clone(), k.clone(), go.clone(), ctx.clone());
            std::thread::spawn(move || {
                let s = Stream::from_cudarc(ctx.new_stream().unwrap());
                let out = mm.allocate_device(N * 4).unwrap();
                let cs = s.cudarc().unwrap().clone();
                cs.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
                go.wait();
                let mut scratch = Vec::new();
                for round in 0..8u32 {
                    let tmp = mm.allocate_device_on(N * 4, &s).unwrap();
                    fill(&k, &s, tmp, 1000 * (i + 1) + round, N);
                    add_copy(&k, &s, out, tmp, 1, N);
                    mm.free_device_on(tmp, &s).unwrap();
                    scratch.push(tmp);
                }
                let g = cs.end_capture(sys::CUgraphInstantiate_flags(0)).unwrap().expect("a graph");
                (s, SendGraph(g), out, scratch)
            })
        })
        .collect();
    let results: Vec<_> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    assert_eq!(graph_stats(&mm).pools, 2, "one private pool per capture");
    for a in &results[0].3 {
        for b in &results[1].3 {
            assert!(!overlaps((*a, N * 4), (*b, N * 4)), "the two graphs share {a:#x}");
        }
    }
    let t = Stream::from_cudarc(ctx.new_stream().unwrap());
    for _ in 0..REPLAYS {
        for (_, g, _, scratch) in &results {
            g.0.launch().unwrap();
            let other = mm.allocate_device_on(N * 4, &t).unwrap();
            assert!(scratch.iter().all(|&p| !overlaps((other, N * 4), (p, N * 4))));
            mm.free_device_on(other, &t).unwrap();
        }
    }
    for (i, (s, _, out, _)) in results.iter().enumerate() {
        s.synchronize().unwrap();
        assert!(read(*out, N).iter().all(|&v| v == 1000 * (i as u32 + 1) + 7 + 1));
    }
    t.synchronize().unwrap();
    let outs: Vec<u64> = results.iter().map(|r| r.2).collect();
    drop(results);
    let st = wait_released(&mm);
    assert_eq!(st.pools, 0, "{st:?}");
    for o in outs {
        mm.free_device(o).unwrap();
    }
}

#[test]
fn a_failed_cudarc_capture_releases_its_pool() {
    let Some(ctx) = gpu_for_test("a_failed_cudarc_capture_releases_its_pool") else { return };
    let _serial = serial();
    let k = kernels(&ctx);
    let mm = MemoryManager::new(config()).unwrap();
    let s = Stream::from_cudarc(ctx.new_stream().unwrap());
    let cs = s.cudarc().unwrap().clone();
    cs.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
    let tmp = mm.allocate_device_on(N * 4, &s).unwrap();
    fill(&k, &s, tmp, 1, N);
    mm.free_device_on(tmp, &s).unwrap();
    assert_eq!(graph_stats(&mm).pools, 1);
    // Something illegal during the capture invalidates it.
    // SAFETY: the stream is alive; synchronising a capturing stream is
    // refused by the driver (and invalidates the capture), nothing else.
    let illegal = unsafe { sys::cuStreamSynchronize(cs.cu_stream()) };
    assert_ne!(illegal, sys::CUresult::CUDA_SUCCESS);
    assert!(matches!(mm.allocate_device_on(N * 4, &s), Err(Error::Capture(_))), "an invalidated capture");
    assert!(cs.end_capture(sys::CUgraphInstantiate_flags(0)).is_err(), "ending an invalidated capture fails");
    let st = wait_released(&mm);
    assert_eq!((st.pools, st.reserved), (0, 0), "the failed capture's pool is released: {st:?}");
    let p = mm.allocate_device_on(N * 4, &s).unwrap();
    mm.free_device_on(p, &s).unwrap();
    s.synchronize().unwrap();
}

/// A block freed on `s` with its work still queued, then `s` begins a
/// capture cumem is not told of (`mode`). Callers of the same size on
/// another stream `t` (and, with `unordered`, with no stream: what
/// PyTorch's backend asks for its graph pools) can't be ordered after `s`
/// (a wait would join or break the capture): each gets another block, and
/// the capture stays valid; the graph and the callers' data check out.
fn pending_block_under_capture(
    ctx: &Arc<CudaContext>,
    mm: &MemoryManager,
    mode: sys::CUstreamCaptureMode,
    unordered: bool,
) {
    let k = kernels(ctx);
    let s = Stream::from_cudarc(ctx.new_stream().unwrap());
    let t = Stream::from_cudarc(ctx.new_stream().unwrap());
    let out = mm.allocate_device(N * 4).unwrap();
    let x = mm.allocate_device_on(N * 4, &s).unwrap();
    fill(&k, &s, x, 1, N);
    mm.free_device_on(x, &s).unwrap();
    let cs = s.cudarc().unwrap().clone();
    cs.begin_capture(mode).unwrap();
    let host = unordered.then(|| mm.allocate_device(N * 4).expect("an unordered allocation during the capture"));
    let y = mm.allocate_device_on(N * 4, &t).expect("an allocation on another stream during the capture");
    assert_ne!(y, x);
    assert_ne!(host, Some(x));
    fill(&k, &s, out, 2, N);
    let g = cs.end_capture(sys::CUgraphInstantiate_flags(0)).expect("the capture stays valid").expect("a graph");
    fill(&k, &t, y, 3, N);
    g.launch().unwrap();
    s.synchronize().unwrap();
    t.synchronize().unwrap();
    assert!(read(y, N).iter().all(|&v| v == 3));
    assert!(read(out, N).iter().all(|&v| v == 2));
    mm.free_device_on(y, &t).unwrap();
    t.synchronize().unwrap();
    drop(g);
    if let Some(h) = host {
        mm.free_device(h).unwrap();
    }
    mm.free_device(out).unwrap();
}

#[test]
fn an_eager_caller_never_gets_a_block_whose_last_use_waits_on_a_capturing_stream() {
    let Some(ctx) = gpu_for_test("an_eager_caller_never_gets_a_block_whose_last_use_waits_on_a_capturing_stream")
    else {
        return;
    };
    let _serial = serial();
    let mm = MemoryManager::new(config()).unwrap();
    pending_block_under_capture(&ctx, &mm, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, false);
}

#[test]
fn with_the_promise_an_unregistered_capture_is_never_waited_on() {
    // PyTorch's backend promises to register captures and keeps its graph
    // pools itself, so cumem is not told of PyTorch's captures; memory for
    // those pools comes from cumem with no stream order while the capture
    // runs. A block whose last use is queued on the capturing stream must
    // not be synchronised (that breaks the capture): the caller gets another.
    let Some(ctx) = gpu_for_test("with_the_promise_an_unregistered_capture_is_never_waited_on") else { return };
    let _serial = serial();
    let mm = MemoryManager::new(config().promise_registered_captures(true)).unwrap();
    pending_block_under_capture(&ctx, &mm, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED, true);
}

#[test]
fn a_stream_that_joins_a_cudarc_capture_uses_its_pool() {
    let Some(ctx) = gpu_for_test("a_stream_that_joins_a_cudarc_capture_uses_its_pool") else { return };
    let _serial = serial();
    let k = kernels(&ctx);
    let mm = MemoryManager::new(config()).unwrap();
    let s = Stream::from_cudarc(ctx.new_stream().unwrap());
    let t = Stream::from_cudarc(ctx.new_stream().unwrap());
    let u = Stream::from_cudarc(ctx.new_stream().unwrap());
    let out = mm.allocate_device(N * 4).unwrap();
    let (cs, ct) = (s.cudarc().unwrap().clone(), t.cudarc().unwrap().clone());
    cs.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
    let a = mm.allocate_device_on(N * 4, &s).unwrap();
    fill(&k, &s, a, 5, N);
    ct.join(&cs).unwrap(); // `t` joins the capture
    let b = mm.allocate_device_on(N * 4, &t).unwrap();
    add_copy(&k, &t, b, a, 1, N);
    add_copy(&k, &t, out, b, 1, N);
    mm.free_device_on(b, &t).unwrap();
    mm.free_device_on(a, &t).unwrap();
    cs.join(&ct).unwrap(); // and rejoins `s`
    assert_eq!(graph_stats(&mm).pools, 1, "one capture, one private pool, whichever stream asks");
    let g = cs.end_capture(sys::CUgraphInstantiate_flags(0)).unwrap().expect("a graph");
    for _ in 0..REPLAYS {
        g.launch().unwrap();
        let other = mm.allocate_device_on(N * 4, &u).unwrap();
        assert!(!overlaps((other, N * 4), (a, N * 4)) && !overlaps((other, N * 4), (b, N * 4)));
        mm.free_device_on(other, &u).unwrap();
    }
    s.synchronize().unwrap();
    assert!(read(out, N).iter().all(|&v| v == 7));
    drop(g);
    let st = wait_released(&mm);
    assert_eq!((st.pools, st.reserved), (0, 0), "{st:?}");
    u.synchronize().unwrap();
    mm.free_device(out).unwrap();
}

#[test]
fn releasing_a_shared_pool_never_breaks_a_capture_cumem_is_not_told_of() {
    let Some(ctx) = gpu_for_test("releasing_a_shared_pool_never_breaks_a_capture_cumem_is_not_told_of") else {
        return;
    };
    let _serial = serial();
    let k = kernels(&ctx);
    let mm = MemoryManager::new(config()).unwrap();
    let s = Stream::from_cudarc(ctx.new_stream().unwrap());
    let x = Stream::from_cudarc(ctx.new_stream().unwrap());
    let out = mm.allocate_device(N * 4).unwrap();
    let pool = mm.graph_pool().unwrap();
    let cap = mm.begin_capture(&s, &pool).unwrap();
    let tmp = mm.allocate_device_on(N * 4, &s).unwrap();
    fill(&k, &s, tmp, 1, N);
    mm.free_device_on(tmp, &s).unwrap();
    let g = cap.end().unwrap();
    g.launch(&s).unwrap();
    s.synchronize().unwrap();
    // Another part of the program captures on `x` and never calls cumem in
    // the capture...
    let cx = x.cudarc().unwrap().clone();
    cx.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL).unwrap();
    fill(&k, &x, out, 9, N);
    // ...while the shared pool and its graph go, and cumem is called
    // eagerly. A device-wide wait here would invalidate the capture.
    drop((g, pool));
    for _ in 0..3 {
        let p = mm.allocate_device_on(N * 4, &s).unwrap();
        mm.free_device_on(p, &s).unwrap();
    }
    let gx = cx.end_capture(sys::CUgraphInstantiate_flags(0)).unwrap().expect("the capture is intact");
    gx.launch().unwrap();
    x.synchronize().unwrap();
    assert!(read(out, N).iter().all(|&v| v == 9));
    s.synchronize().unwrap();
    assert_eq!(wait_released(&mm).pools, 0, "the pool goes once its graph is gone");
    drop(gx);
    mm.free_device(out).unwrap();
}
