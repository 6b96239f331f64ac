//! GrowableBuffer: contents survive growth on both paths (in place and
//! remapped), the pointer is stable in place, shrinking releases memory.
//! The host tests run everywhere on the explicit host backend; the GPU
//! tests skip with a reason without a GPU (and fail under
//! CUMEM_REQUIRE_GPU=1).

use std::sync::{Arc, Barrier, Mutex, MutexGuard};

use cudarc::driver::{sys, CudaContext};
use cumem::device::vmm::{self, AddressRange};
use cumem::{Error, GrowPath, GrowableBuffer, Stream, VmBackend};

/// GPU tests run one at a time: a device-wide wait in one would break
/// another's capture.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn pattern(start: usize, n: usize) -> Vec<u32> {
    (start..start + n).map(|i| (i as u32).wrapping_mul(2_654_435_761)).collect()
}

/// Appends `rounds` slices of `step` elements, checking the whole contents
/// after every growth. Returns the paths taken.
fn fill_and_check(buf: &mut GrowableBuffer<u32>, rounds: usize, step: usize) -> Vec<GrowPath> {
    let mut paths = Vec::new();
    for _ in 0..rounds {
        let before = buf.capacity();
        let ptr = buf.device_ptr();
        let start = buf.len();
        let path = buf.reserve(step).expect("reserve");
        if matches!(path, GrowPath::InPlace | GrowPath::WithinReservation) {
            assert_eq!(buf.device_ptr(), ptr, "pointer moved on the {path:?} path");
        }
        if path != GrowPath::Unchanged {
            assert!(buf.capacity() >= (2 * before).max(start + step), "growth at least doubles");
            paths.push(path);
        }
        buf.extend_from_host(&pattern(start, step)).expect("extend");
        assert_eq!(buf.to_vec().unwrap(), pattern(0, buf.len()), "contents after {path:?}");
    }
    paths
}

/// Occupies the addresses right after the buffer's reservation so the next
/// growth can't extend in place. Returns the mapping to unmap later.
fn block_host_tail(buf: &GrowableBuffer<u32>) -> (*mut libc::c_void, usize) {
    let end = buf.device_ptr() as usize + buf.reserved_bytes();
    let len = 4096;
    // SAFETY: MAP_FIXED_NOREPLACE never replaces an existing mapping; the
    // page is ours to unmap later.
    let p = unsafe {
        libc::mmap(
            end as *mut libc::c_void,
            len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        // EEXIST: something already lives there, which blocks just as well.
        return (std::ptr::null_mut(), 0);
    }
    assert_eq!(p as usize, end, "MAP_FIXED_NOREPLACE placed the blocker elsewhere");
    (p, len)
}

#[test]
fn host_contents_survive_many_grows() {
    let mut buf = GrowableBuffer::<u32>::with_capacity_on(VmBackend::Host, 1000).unwrap();
    assert_eq!(buf.backend(), VmBackend::Host);
    let paths = fill_and_check(&mut buf, 40, 30_000);
    assert!(paths.len() >= 5, "expected several growths, got {paths:?}");
    let s = buf.stats();
    assert_eq!(s.within_reservation + s.in_place + s.remapped, paths.len() as u64);
}

#[test]
fn host_pointer_stable_on_in_place_path() {
    let mut buf = GrowableBuffer::<u32>::with_capacity_on(VmBackend::Host, 1024).unwrap();
    assert!(buf.headroom_bytes() >= 1 << 30, "a guard holds the addresses after the range");
    let ptr = buf.device_ptr();
    buf.extend_from_host(&pattern(0, 1024)).unwrap();
    let mut in_place = 0;
    for i in 0..10 {
        let path = buf.grow(buf.capacity() + 1).unwrap();
        assert_ne!(path, GrowPath::Remapped, "growth {i} remapped although the tail was cleared");
        in_place += u32::from(path == GrowPath::InPlace);
        assert_eq!(buf.device_ptr(), ptr);
    }
    assert!(in_place >= 5, "in-place growths: {in_place}");
    assert_eq!(buf.stats().in_place, u64::from(in_place));
    assert_eq!(buf.to_vec().unwrap(), pattern(0, 1024));
}

#[test]
fn host_remap_path_keeps_contents() {
    let mut buf = GrowableBuffer::<u32>::with_capacity_on(VmBackend::Host, 1 << 12).unwrap();
    // Give back the guard after the reservation, so the blockers can take
    // those addresses.
    buf.set_headroom(false);
    assert_eq!(buf.headroom_bytes(), 0);
    let mut blockers = Vec::new();
    let mut blocked = 0;
    for round in 0..8 {
        let n = buf.capacity() - buf.len() + 17;
        let start = buf.len();
        let old_ptr = buf.device_ptr();
        let blocker = block_host_tail(&buf);
        // Where another thread's mapping stood in the way instead, it may
        // be gone by the growth: only our own blocker makes it move.
        let ours = !blocker.0.is_null();
        blockers.push(blocker);
        buf.extend_from_host(&pattern(start, n)).unwrap();
        if ours {
            blocked += 1;
            assert_ne!(buf.device_ptr(), old_ptr, "round {round}: the pointer should move");
        }
        assert_eq!(buf.to_vec().unwrap(), pattern(0, buf.len()), "round {round}");
    }
    assert!(blocked > 0, "no round placed its blocker: the test checked nothing");
    assert!(buf.stats().remapped >= blocked, "{:?}", buf.stats());
    assert_eq!(buf.stats().remapped + buf.stats().in_place, 8);
    for (p, len) in blockers.into_iter().filter(|(p, _)| !p.is_null()) {
        // SAFETY: these pages were mapped above and nothing uses them.
        assert_eq!(unsafe { libc::munmap(p, len) }, 0);
    }
}

#[test]
fn host_mixed_paths_and_shrink() {
    let mut buf = GrowableBuffer::<u32>::with_capacity_on(VmBackend::Host, 0).unwrap();
    assert_eq!(buf.capacity(), 0);
    buf.set_headroom(false);
    let mut blockers = Vec::new();
    for round in 0..12 {
        if round % 3 == 2 {
            blockers.push(block_host_tail(&buf));
        }
        let start = buf.len();
        buf.extend_from_host(&pattern(start, 5000 * (round + 1))).unwrap();
        assert_eq!(buf.to_vec().unwrap(), pattern(0, buf.len()));
    }
    let s = buf.stats();
    assert!(s.remapped >= 1 && s.in_place + s.within_reservation >= 1, "{s:?}");
    let len = buf.len();
    buf.truncate(1000);
    let released = buf.shrink_to_fit().unwrap();
    assert!(released > 0);
    assert!(buf.capacity() >= 1000 && buf.capacity() < len);
    assert_eq!(buf.to_vec().unwrap(), pattern(0, 1000));
    // Growing again maps inside the reservation it kept.
    assert_eq!(buf.grow(buf.capacity() + 1).unwrap(), GrowPath::WithinReservation);
    buf.resize(3000, 7).unwrap();
    let mut want = pattern(0, 1000);
    want.resize(3000, 7);
    assert_eq!(buf.to_vec().unwrap(), want);
    buf.clear();
    assert!(buf.shrink_to_fit().unwrap() > 0);
    assert_eq!(buf.capacity(), 0);
    for (p, len) in blockers.into_iter().filter(|(p, _)| !p.is_null()) {
        // SAFETY: mapped above, unused.
        assert_eq!(unsafe { libc::munmap(p, len) }, 0);
    }
}

#[test]
fn host_extend_from_buffer_and_device() {
    let mut a = GrowableBuffer::<u32>::with_capacity_on(VmBackend::Host, 10).unwrap();
    a.extend_from_host(&pattern(0, 5000)).unwrap();
    let mut b = GrowableBuffer::<u32>::with_capacity_on(VmBackend::Host, 10).unwrap();
    b.extend_from_host(&pattern(0, 10)).unwrap();
    b.extend_from_buffer(&a).unwrap();
    let mut want = pattern(0, 10);
    want.extend(pattern(0, 5000));
    assert_eq!(b.to_vec().unwrap(), want);
    // SAFETY: `a` holds 5000 valid u32 on the host backend, unchanged
    // during the call.
    unsafe { b.extend_from_device(a.device_ptr(), 100) }.unwrap();
    want.extend(pattern(0, 100));
    assert_eq!(b.to_vec().unwrap(), want);
    let mut head = [0u32; 3];
    b.copy_to_host(&mut head).unwrap();
    assert_eq!(head.to_vec(), pattern(0, 3));
}

#[test]
fn host_bad_input_is_an_error() {
    assert!(matches!(GrowableBuffer::<()>::with_capacity_on(VmBackend::Host, 1), Err(Error::InvalidSize { .. })));
    let mut buf = GrowableBuffer::<u64>::with_capacity_on(VmBackend::Host, 4).unwrap();
    assert!(matches!(buf.reserve(usize::MAX), Err(Error::InvalidSize { .. })));
    assert!(matches!(buf.grow(usize::MAX / 4), Err(Error::InvalidSize { .. })));
    let mut too_long = [0u64; 1];
    assert!(matches!(buf.copy_to_host(&mut too_long), Err(Error::InvalidState(_))));
    assert_eq!(buf.len(), 0);
    assert!(buf.is_empty());
}

#[test]
fn automatic_backend_matches_driver_status() {
    let buf = GrowableBuffer::<u8>::with_capacity(100).unwrap();
    assert_eq!(buf.backend(), VmBackend::auto());
    println!("GrowableBuffer::with_capacity runs on: {}", buf.backend());
}

// ---- GPU tests ----------------------------------------------------------

#[test]
fn gpu_growable_many_grows_keep_contents() {
    let Some(ctx) = cumem::device::gpu_for_test("gpu_growable_many_grows_keep_contents") else { return };
    let _serial = serial();
    let mut buf = GrowableBuffer::<u32>::with_capacity_on(VmBackend::Cuda(ctx.ordinal()), 1).unwrap();
    assert_eq!(buf.granularity() % (2 << 20), 0, "VMM granularity {}", buf.granularity());
    let paths = fill_and_check(&mut buf, 24, 400_000);
    println!("paths: {paths:?}, stats: {:?}", buf.stats());
    assert!(paths.len() >= 3);
    // Device-to-device appends (cuMemcpyDtoD) from another buffer.
    let mut other = GrowableBuffer::<u32>::with_capacity_on(VmBackend::Cuda(ctx.ordinal()), 1).unwrap();
    other.extend_from_buffer(&buf).unwrap();
    other.extend_from_buffer(&buf).unwrap();
    let mut want = pattern(0, buf.len());
    want.extend(pattern(0, buf.len()));
    assert_eq!(other.to_vec().unwrap(), want);
}

#[test]
fn gpu_growable_pointer_stable_in_place() {
    let Some(ctx) = cumem::device::gpu_for_test("gpu_growable_pointer_stable_in_place") else { return };
    let _serial = serial();
    let mut buf = GrowableBuffer::<u32>::with_capacity_on(VmBackend::Cuda(ctx.ordinal()), 1 << 19).unwrap();
    println!("headroom guard: {} B", buf.headroom_bytes());
    buf.extend_from_host(&pattern(0, 1 << 19)).unwrap();
    let mut ptr = buf.device_ptr();
    for _ in 0..6 {
        let path = buf.grow(buf.capacity() + 1).unwrap();
        println!("grew to {} B via {path:?}", buf.capacity_bytes());
        if path != GrowPath::Remapped {
            assert_eq!(buf.device_ptr(), ptr, "pointer moved on the {path:?} path");
        }
        ptr = buf.device_ptr();
    }
    assert!(buf.stats().in_place >= 1, "the driver never extended in place: {:?}", buf.stats());
    assert_eq!(buf.to_vec().unwrap(), pattern(0, 1 << 19));
}

#[test]
fn gpu_growable_remap_path_forced() {
    let Some(ctx) = cumem::device::gpu_for_test("gpu_growable_remap_path_forced") else { return };
    let _serial = serial();
    let gran = vmm::granularity(&ctx).unwrap().minimum;
    let mut buf = GrowableBuffer::<u32>::with_capacity_on(VmBackend::Cuda(ctx.ordinal()), 1).unwrap();
    buf.set_headroom(false);
    let mut blockers = Vec::new();
    for round in 0..6 {
        let end = buf.device_ptr() + buf.reserved_bytes() as u64;
        let blocker = AddressRange::reserve(&ctx, gran, end).unwrap();
        let blocked = blocker.ptr() == end;
        blockers.push(blocker);
        let old = buf.device_ptr();
        let start = buf.len();
        let n = buf.capacity() - start + 1000;
        buf.extend_from_host(&pattern(start, n)).unwrap();
        if blocked {
            assert_ne!(buf.device_ptr(), old, "round {round}: expected a remap");
        } else {
            println!("round {round}: the driver placed the blocker elsewhere; tail may have been taken anyway");
        }
        assert_eq!(buf.to_vec().unwrap(), pattern(0, buf.len()), "round {round}");
    }
    println!("stats: {:?}", buf.stats());
    assert!(buf.stats().remapped >= 1);
    drop(buf);
    drop(blockers);
}

#[test]
fn gpu_growable_beyond_half_of_free_memory() {
    let Some(ctx) = cumem::device::gpu_for_test("gpu_growable_beyond_half_of_free_memory") else { return };
    let _serial = serial();
    let (free, total) = vmm::memory_info(&ctx).unwrap();
    let target = free / 4 * 3;
    println!("device free {free} B of {total} B; growing to {target} B");
    let mut buf = GrowableBuffer::<u8>::with_capacity_on(VmBackend::Cuda(ctx.ordinal()), 2 << 20).unwrap();
    let head: Vec<u8> = (0..1 << 20).map(|i| (i * 7 + 3) as u8).collect();
    buf.extend_from_host(&head).unwrap();
    let mut crossed_half = false;
    while buf.capacity() < target {
        let want = (buf.capacity() * 2).min(target);
        let path = buf.grow(want).unwrap_or_else(|e| panic!("growing to {want} B: {e}"));
        crossed_half |= buf.capacity() > free / 2;
        println!(
            "capacity {} B ({:.0}% of free) via {path:?}",
            buf.capacity(),
            100.0 * buf.capacity() as f64 / free as f64
        );
    }
    assert!(crossed_half && buf.capacity() >= target);
    // The last bytes are real memory: write and read them back.
    let tail_at = buf.device_ptr() + (buf.capacity() - head.len()) as u64;
    let mut back = vec![0u8; head.len()];
    ctx.bind_to_thread().unwrap();
    // SAFETY: the span lies in the buffer's mapped memory; `head` and `back`
    // are live host slices of the copied length.
    unsafe {
        sys::cuMemcpyHtoD_v2(tail_at, head.as_ptr().cast(), head.len()).result().unwrap();
        sys::cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), tail_at, head.len()).result().unwrap();
    }
    assert_eq!(back, head);
    let mut first = vec![0u8; head.len()];
    buf.copy_to_host(&mut first).unwrap();
    assert_eq!(first, head, "contents survived the growth");
    // Allocate-bigger-and-copy would need a second buffer at least as large:
    // it can't be had.
    let mut p: sys::CUdeviceptr = 0;
    // SAFETY: `p` is a valid out-pointer.
    let rc = unsafe { sys::cuMemAlloc_v2(&mut p, buf.capacity()) };
    if rc == sys::CUresult::CUDA_SUCCESS {
        // SAFETY: `p` was just allocated.
        unsafe { sys::cuMemFree_v2(p) };
    }
    assert_eq!(rc, sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY, "a copying growth of {} B would have fit", buf.capacity());
}

// ---- Captures beside growth, shrink and drop ---------------------------

/// Who captures: cudarc's capture on a non-blocking stream of its own, or
/// a raw capture on a blocking stream (which the legacy stream reports).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Capturer {
    Cudarc,
    Blocking,
}

const CAP_N: usize = 1 << 20;

/// Device-to-host of `n` u32 at `p` (after the streams writing it were
/// waited for).
fn read_u32(ctx: &CudaContext, p: u64, n: usize) -> Vec<u32> {
    ctx.bind_to_thread().unwrap();
    let mut v = vec![0u32; n];
    // SAFETY: `v` holds `n` u32; `p` is a live allocation of at least that.
    unsafe { sys::cuMemcpyDtoH_v2(v.as_mut_ptr().cast(), p, n * 4) }.result().unwrap();
    v
}

/// Growth, shrink and drop of buffers on their own stream (`own`), and,
/// with `streamless`, of buffers without one (no copies: those run on the
/// legacy stream). Returns what went wrong.
fn churn(ctx: &Arc<CudaContext>, own: &Stream, streamless: bool, old: GrowableBuffer<u32>) -> Vec<String> {
    let mut errors = Vec::new();
    let mut check = |what: &str, r: Result<bool, Error>| match r {
        Ok(true) => {}
        Ok(false) => errors.push(format!("{what}: wrong values")),
        Err(e) => errors.push(format!("{what}: {e}")),
    };
    // A buffer made before the capture began is dropped during it.
    drop(old);
    for round in 0..6 {
        let r = (|| {
            let mut b = GrowableBuffer::<u32>::with_capacity_for(own, 1 << 18)?;
            b.extend_from_host(&pattern(0, 1 << 18))?;
            b.reserve(1 << 21)?;
            b.extend_from_host(&pattern(1 << 18, 1 << 18))?;
            let grown = b.to_vec()? == pattern(0, 1 << 19);
            b.truncate(1 << 16);
            b.shrink_to_fit()?;
            let shrunk = b.to_vec()? == pattern(0, 1 << 16);
            drop(b);
            Ok(grown && shrunk)
        })();
        check(&format!("round {round}, own stream"), r);
        if streamless {
            let r = (|| {
                let mut b = GrowableBuffer::<u32>::with_capacity_on(VmBackend::Cuda(ctx.ordinal()), 1 << 18)?;
                b.reserve(1 << 21)?;
                b.shrink_to_fit()?;
                drop(b);
                Ok(true)
            })();
            check(&format!("round {round}, no stream"), r);
        }
    }
    errors
}

/// One thread captures (memset a source, copy it to `dst`) while another
/// grows, shrinks and drops growable buffers between the two captured
/// steps; then the graph is replayed into a cleared `dst`. Returns (the
/// capture ended with success, the replay wrote the right values, the
/// churn's errors).
fn capture_beside_churn(
    ctx: &Arc<CudaContext>,
    capturer: Capturer,
    mode: sys::CUstreamCaptureMode,
) -> (bool, bool, Vec<String>) {
    ctx.bind_to_thread().unwrap();
    let (mut src, mut dst): (sys::CUdeviceptr, sys::CUdeviceptr) = (0, 0);
    // SAFETY: valid out-pointers; freed at the end.
    unsafe {
        sys::cuMemAlloc_v2(&mut src, CAP_N * 4).result().unwrap();
        sys::cuMemAlloc_v2(&mut dst, CAP_N * 4).result().unwrap();
    }
    let own = Stream::from_cudarc(ctx.new_stream().unwrap());
    let mut old = GrowableBuffer::<u32>::with_capacity_for(&own, 1 << 18).unwrap();
    old.extend_from_host(&pattern(0, 1 << 18)).unwrap();
    let cudarc_stream = ctx.new_stream().unwrap();
    let raw: sys::CUstream = match capturer {
        Capturer::Cudarc => cudarc_stream.cu_stream(),
        Capturer::Blocking => {
            let mut s: sys::CUstream = std::ptr::null_mut();
            // SAFETY: valid out-pointer; flags 0 make a blocking stream,
            // destroyed at the end.
            unsafe { sys::cuStreamCreate(&mut s, 0) }.result().unwrap();
            s
        }
    };
    let barrier = Arc::new(Barrier::new(2));
    let worker = {
        let (ctx, barrier, own) = (ctx.clone(), barrier.clone(), own.clone());
        let streamless = capturer == Capturer::Blocking;
        std::thread::spawn(move || {
            barrier.wait();
            let errors = churn(&ctx, &own, streamless, old);
            barrier.wait();
            errors
        })
    };
    match capturer {
        Capturer::Cudarc => cudarc_stream.begin_capture(mode).unwrap(),
        // SAFETY: `raw` is a live stream that does not capture.
        Capturer::Blocking => unsafe { sys::cuStreamBeginCapture_v2(raw, mode) }.result().unwrap(),
    }
    // SAFETY: `src` holds CAP_N u32; queued (captured) on the live stream.
    let first = unsafe { sys::cuMemsetD32Async(src, 0x600D, CAP_N, raw) }.result();
    barrier.wait();
    barrier.wait();
    // SAFETY: both hold CAP_N u32; captured on the live stream.
    let second = unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, CAP_N * 4, raw) }.result();
    let errors = worker.join().unwrap();
    let mut captured = first.is_ok() && second.is_ok();
    let mut right = false;
    // Once the capture ended (a legacy-stream memset during a blocking
    // stream's capture would invalidate it): the replay must write `dst`.
    let clear = || {
        // SAFETY: `dst` holds CAP_N u32; the synchronous memset finishes
        // before the replay is queued.
        unsafe { sys::cuMemsetD32_v2(dst, 0, CAP_N) }.result().unwrap();
    };
    match capturer {
        Capturer::Cudarc => match cudarc_stream.end_capture(sys::CUgraphInstantiate_flags(0)) {
            Ok(Some(graph)) => {
                clear();
                graph.launch().unwrap();
                cudarc_stream.synchronize().unwrap();
                right = read_u32(ctx, dst, CAP_N).iter().all(|&v| v == 0x600D);
            }
            other => {
                println!("end_capture: {:?}", other.err());
                captured = false;
            }
        },
        Capturer::Blocking => {
            let mut graph: sys::CUgraph = std::ptr::null_mut();
            // SAFETY: `raw` captures (or its capture was invalidated);
            // `graph` is a valid out-pointer.
            let rc = unsafe { sys::cuStreamEndCapture(raw, &mut graph) };
            println!("cuStreamEndCapture: {rc:?}");
            captured &= rc == sys::CUresult::CUDA_SUCCESS;
            if captured {
                clear();
                let mut exec: sys::CUgraphExec = std::ptr::null_mut();
                // SAFETY: `graph` was just captured; `exec` is a valid
                // out-pointer; both are destroyed below.
                unsafe {
                    sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0).result().unwrap();
                    sys::cuGraphLaunch(exec, raw).result().unwrap();
                    sys::cuStreamSynchronize(raw).result().unwrap();
                    sys::cuGraphExecDestroy(exec).result().unwrap();
                }
                right = read_u32(ctx, dst, CAP_N).iter().all(|&v| v == 0x600D);
            }
            if !graph.is_null() {
                // SAFETY: the graph is no longer used.
                unsafe { sys::cuGraphDestroy(graph) };
            }
            // SAFETY: nothing is queued on the stream any more.
            unsafe { sys::cuStreamDestroy_v2(raw) };
        }
    }
    ctx.bind_to_thread().unwrap();
    // SAFETY: the graph and the streams that used them are done.
    unsafe {
        sys::cuCtxSynchronize().result().unwrap();
        sys::cuMemFree_v2(src).result().unwrap();
        sys::cuMemFree_v2(dst).result().unwrap();
    }
    println!("{capturer:?} capture in {mode:?}: captured {captured}, replay right {right}, churn errors {errors:?}");
    (captured, right, errors)
}

fn captures_survive_churn(name: &str, capturer: Capturer) {
    let Some(ctx) = cumem::device::gpu_for_test(name) else { return };
    let _serial = serial();
    let mut failures = Vec::new();
    for mode in [
        sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
        sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
    ] {
        let (captured, right, errors) = capture_beside_churn(&ctx, capturer, mode);
        if !(captured && right && errors.is_empty()) {
            failures.push(format!("{mode:?}: captured {captured}, right {right}, errors {errors:?}"));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn gpu_a_cudarc_capture_survives_growth_shrink_and_drop_of_buffers_on_their_streams() {
    captures_survive_churn(
        "gpu_a_cudarc_capture_survives_growth_shrink_and_drop_of_buffers_on_their_streams",
        Capturer::Cudarc,
    );
}

#[test]
fn gpu_a_blocking_stream_capture_survives_growth_shrink_and_drop_of_any_buffer() {
    captures_survive_churn(
        "gpu_a_blocking_stream_capture_survives_growth_shrink_and_drop_of_any_buffer",
        Capturer::Blocking,
    );
}
