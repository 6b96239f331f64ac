//! Captures broken from outside: another thread drops a stream-less
//! buffer, or frees a block exported over IPC, while a capture goes on.

use super::*;

const CAPTURE_MODES: [sys::CUstreamCaptureMode; 3] = [
    sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
    sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
    sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
];

/// This thread captures `fill(out, 5)` on a new stream with cudarc's API in
/// `mode` while another thread runs `during` (between the capture's first
/// kernel and its end); `before` runs on that thread before the capture
/// begins and hands `during` its state. Returns whether the capture ended
/// with a graph, and whether that graph's replay wrote `out`.
fn capture_around<S: Send>(
    ctx: &Arc<CudaContext>,
    k: &Kernels,
    mode: sys::CUstreamCaptureMode,
    out: u64,
    before: impl FnOnce() -> S + Send,
    during: impl FnOnce(S) + Send,
) -> (bool, bool) {
    let s = Stream::from_cudarc(ctx.new_stream().unwrap());
    let cs = s.cudarc().unwrap().clone();
    let step = &Barrier::new(2);
    let graph = std::thread::scope(|scope| {
        scope.spawn(move || {
            let state = before();
            step.wait(); // the capture may begin
            step.wait(); // it began
            during(state);
            step.wait(); // done
        });
        step.wait();
        cs.begin_capture(mode).unwrap();
        fill(k, &s, out, 5, N);
        step.wait();
        step.wait();
        cs.end_capture(sys::CUgraphInstantiate_flags(0))
    });
    match graph {
        Ok(Some(g)) => {
            g.launch().unwrap();
            s.synchronize().unwrap();
            (true, read(out, N).iter().all(|&v| v == 5))
        }
        other => {
            println!("{mode:?}: the capture ended with {:?}", other.map(|g| g.is_some()));
            (false, false)
        }
    }
}

/// A `DeviceBuffer` made without a stream and used through cudarc (so it
/// has events to wait for) is dropped by another thread while this one
/// captures, in every capture mode: the capture ends with its graph, and
/// the buffer's memory goes back. Control: before the fix the drop
/// synchronised the legacy stream (`control_a_legacy_stream_sync_...`
/// below shows what that does to a capture); the same test run against
/// main's build is recorded in the commit.
#[test]
fn dropping_a_streamless_buffer_never_breaks_another_threads_capture() {
    let Some(ctx) = gpu_for_test("dropping_a_streamless_buffer_never_breaks_another_threads_capture") else {
        return;
    };
    let _serial = serial();
    let k = kernels(&ctx);
    let mm = MemoryManager::global().unwrap();
    let out = mm.allocate_device(N * 4).unwrap();
    let t = ctx.new_stream().unwrap();
    let device = mm.config().device;
    let live = || mm.device_stats(device).unwrap().pool.live_blocks;
    for mode in CAPTURE_MODES {
        let live_before = live();
        let made = || {
            let mut buf = cumem::DeviceBuffer::<u32>::new(N).unwrap();
            t.memcpy_htod(&vec![3u32; N], &mut buf).unwrap(); // tracked by cudarc's events
            t.synchronize().unwrap();
            buf
        };
        let (ended, replayed) = capture_around(&ctx, &k, mode, out, made, drop);
        assert!(ended, "{mode:?}: the capture broke when another thread dropped a buffer");
        assert!(replayed, "{mode:?}: the graph's replay is wrong");
        assert_eq!(live(), live_before, "{mode:?}: the dropped buffer's block went back");
    }
    mm.free_device(out).unwrap();
}

/// Control for the test above: what the drop did before the fix (a host
/// wait on the legacy stream) invalidates another thread's capture made
/// in the global mode (the default of cudarc and CUDA).
#[test]
fn control_a_legacy_stream_sync_breaks_another_threads_global_capture() {
    let Some(ctx) = gpu_for_test("control_a_legacy_stream_sync_breaks_another_threads_global_capture") else {
        return;
    };
    let _serial = serial();
    let k = kernels(&ctx);
    let mm = MemoryManager::new(config()).unwrap();
    let out = mm.allocate_device(N * 4).unwrap();
    let legacy = ctx.default_stream();
    let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;
    let (ended, _) = capture_around(
        &ctx,
        &k,
        mode,
        out,
        || (),
        |()| {
            let r = legacy.synchronize();
            println!("control: cuStreamSynchronize(legacy) during the capture: {r:?}");
        },
    );
    assert!(!ended, "control: a legacy-stream sync during a global capture should have broken it");
    mm.free_device(out).unwrap();
}

/// A block exported over IPC that another thread frees on the capturing
/// stream during a capture (captured work writes it) belongs to the graph
/// like any block freed during a capture: releasing the export while the
/// graph lives frees nothing, eager allocations of its size never get it
/// while the graph replays, and it comes back once the graph is gone.
/// Control: before the fix the release freed it eagerly and the first
/// eager allocation of its size got it (recorded in the commit; the host
/// model `device::exports` test shows the same).
#[test]
fn an_exported_block_freed_during_a_capture_stays_the_graphs_after_its_release() {
    let Some(ctx) = gpu_for_test("an_exported_block_freed_during_a_capture_stays_the_graphs_after_its_release") else {
        return;
    };
    let _serial = serial();
    let k = kernels(&ctx);
    let mm = MemoryManager::new(config()).unwrap();
    let (s, t) = (Stream::from_cudarc(ctx.new_stream().unwrap()), Stream::from_cudarc(ctx.new_stream().unwrap()));
    let out = mm.allocate_device(N * 4).unwrap();
    let e = mm.allocate_device_on(N * 4, &s).unwrap();
    let export = match mm.export_device(e) {
        Ok(x) => x,
        Err(err) => panic!("the sync pool's block can be exported on this GPU: {err}"),
    };
    s.synchronize().unwrap();
    let cs = s.cudarc().unwrap().clone();
    cs.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL).unwrap();
    fill(&k, &s, e, 0x600D, N);
    add_copy(&k, &s, out, e, 1, N);
    std::thread::scope(|scope| scope.spawn(|| mm.free_device_on(e, &s)).join().unwrap()).unwrap();
    let g = cs.end_capture(sys::CUgraphInstantiate_flags(0)).unwrap().expect("the capture ends with a graph");
    export.release().unwrap();
    let (mut apart, mut right) = (true, true);
    for round in 0..20u32 {
        g.launch().unwrap();
        let other = mm.allocate_device_on(N * 4, &t).unwrap();
        apart &= !overlaps((other, N * 4), (e, N * 4));
        fill(&k, &t, other, 0x0BAD + round, N);
        t.synchronize().unwrap();
        g.launch().unwrap();
        s.synchronize().unwrap();
        apart &= read(other, N).iter().all(|&v| v == 0x0BAD + round);
        right &= read(out, N).iter().all(|&v| v == 0x600E);
        mm.free_device_on(other, &t).unwrap();
    }
    assert!(apart, "an eager allocation got the exported block the graph still uses");
    assert!(right, "the graph's output is wrong");
    t.synchronize().unwrap();
    drop(g);
    let st = wait_released(&mm);
    assert_eq!((st.pools, st.held), (0, 0), "the graph's memory came back: {st:?}");
    let again: Vec<u64> = (0..3).map(|_| mm.allocate_device_on(N * 4, &t).unwrap()).collect();
    assert!(again.contains(&e), "the block is the pool's again once the graph is gone");
    for p in again {
        mm.free_device_on(p, &t).unwrap();
    }
    t.synchronize().unwrap();
    mm.free_device(out).unwrap();
}
