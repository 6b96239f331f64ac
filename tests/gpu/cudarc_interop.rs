//! cumem buffers through cudarc's own API: copies (`memcpy_htod`,
//! `memcpy_dtoh`, `memcpy_dtod`), kernel arguments (`launch.arg(&mut buf)`),
//! views, pinned host slices, and cudarc's cross-stream events. The GPU
//! tests skip with a printed reason without a GPU, and fail instead under
//! `CUMEM_REQUIRE_GPU=1`.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, DeviceSlice, LaunchConfig, PushKernelArg};
use cumem::device::gpu_for_test;
use cumem::{DeviceBuffer, Error, GrowableBuffer, MemoryManager, PinnedAlloc, PinnedVec, Stream, TrackedPinnedVec};

const KERNELS: &str = r#"
extern "C" __global__ void saxpy(float* y, const float* x, float a, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
extern "C" __global__ void spin_then_fill(float* p, float v, unsigned long long n, long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) p[i] = v;
}
"#;

fn kernels(ctx: &Arc<CudaContext>) -> (CudaFunction, CudaFunction) {
    let ptx = cudarc::nvrtc::compile_ptx(KERNELS).expect("NVRTC compiles the test kernels");
    let m = ctx.load_module(ptx).expect("the module loads");
    (m.load_function("saxpy").unwrap(), m.load_function("spin_then_fill").unwrap())
}

fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn new_stream(ctx: &Arc<CudaContext>) -> (Arc<CudaStream>, Stream) {
    let s = ctx.new_stream().unwrap();
    let cs = Stream::from_cudarc(s.clone());
    (s, cs)
}

#[test]
fn copies_and_kernels_through_cudarc_only() {
    let Some(ctx) = gpu_for_test("copies_and_kernels_through_cudarc_only") else { return };
    let _serial = serial();
    let (saxpy, _) = kernels(&ctx);
    let (s, stream) = new_stream(&ctx);
    let n = 100_003usize;
    let xs: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let ys: Vec<f32> = (0..n).map(|i| 0.5 * i as f32).collect();
    // One buffer on a stream, one without: both kinds of shadow.
    let mut x = DeviceBuffer::<f32>::new_on(n, &stream).unwrap();
    let mut y = DeviceBuffer::<f32>::new(n).unwrap();
    assert_eq!(DeviceSlice::len(&x), n);
    s.memcpy_htod(&xs, &mut x).unwrap();
    s.memcpy_htod(&ys, &mut y).unwrap();
    let (a, nn) = (3.0f32, n as u64);
    let mut launch = s.launch_builder(&saxpy);
    launch.arg(&mut y).arg(&x).arg(&a).arg(&nn);
    // SAFETY: the kernel's signature matches; both buffers hold `n` floats.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n as u32)) }.unwrap();
    let mut out = vec![0f32; n];
    s.memcpy_dtoh(&y, &mut out).unwrap();
    s.synchronize().unwrap();
    for i in (0..n).step_by(997) {
        assert_eq!(out[i], 3.0 * i as f32 + 0.5 * i as f32, "element {i}");
    }

    // Device to device into a growable buffer, then a view of a range.
    let mut g = GrowableBuffer::<f32>::with_capacity(n).unwrap();
    g.resize(n, 0.0).unwrap();
    s.memcpy_dtod(&y, &mut g).unwrap();
    let mut part = vec![0f32; 10];
    let view = g.cuda_view(1000..1010).unwrap();
    s.memcpy_dtoh(&view, &mut part).unwrap();
    s.synchronize().unwrap();
    assert_eq!(part, out[1000..1010]);
    // A growable buffer as a kernel argument: g = 1 * x + g.
    let one = 1.0f32;
    let mut launch = s.launch_builder(&saxpy);
    launch.arg(&mut g).arg(&x).arg(&one).arg(&nn);
    // SAFETY: the signature matches; both hold `n` floats.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n as u32)) }.unwrap();
    let mut gv = vec![0f32; n];
    s.memcpy_dtoh(&g, &mut gv).unwrap();
    s.synchronize().unwrap();
    for i in (0..n).step_by(991) {
        assert_eq!(gv[i], out[i] + xs[i], "growable element {i}");
    }

    // A mutable view of a sub-range: only that range changes.
    let mut view = x.cuda_view_mut(10..20).unwrap();
    s.memcpy_htod(&[-1.0f32; 10], &mut view).unwrap();
    let mut back = vec![0f32; n];
    s.memcpy_dtoh(&x, &mut back).unwrap();
    s.synchronize().unwrap();
    assert_eq!(&back[..10], &xs[..10]);
    assert!(back[10..20].iter().all(|v| *v == -1.0));
    assert_eq!(&back[20..], &xs[20..]);

    // Pinned host memory, tracked: an asynchronous copy the host can't race.
    let mut pv: PinnedVec<f32> = PinnedVec::new_in(PinnedAlloc);
    pv.resize(n, 0.0);
    let mut tracked = TrackedPinnedVec::new(pv);
    s.memcpy_dtoh(&y, &mut tracked).unwrap();
    assert_eq!(tracked.as_slice().unwrap(), &out[..]);
    tracked.as_mut_slice().unwrap().fill(2.0);
    s.memcpy_htod(&tracked, &mut y).unwrap();
    assert!(y.to_vec_synced(&s).iter().all(|v| *v == 2.0));
    ctx.check_err().unwrap();
}

/// A helper: the contents after the stream's work.
trait SyncedVec {
    fn to_vec_synced(&self, s: &Arc<CudaStream>) -> Vec<f32>;
}

impl SyncedVec for DeviceBuffer<f32> {
    fn to_vec_synced(&self, s: &Arc<CudaStream>) -> Vec<f32> {
        s.synchronize().unwrap();
        self.to_vec().unwrap()
    }
}

#[test]
fn cudarc_events_order_a_read_on_another_stream() {
    let Some(ctx) = gpu_for_test("cudarc_events_order_a_read_on_another_stream") else { return };
    let _serial = serial();
    let (_, spin_then_fill) = kernels(&ctx);
    let (s1, stream1) = new_stream(&ctx);
    let (s2, _) = new_stream(&ctx);
    assert!(ctx.is_managing_stream_synchronization());
    let n = 4096usize;
    let mut buf = DeviceBuffer::<f32>::new_on(n, &stream1).unwrap();
    s1.memcpy_htod(&vec![1.0f32; n], &mut buf).unwrap();
    s1.synchronize().unwrap();
    // The kernel writes only after spinning (~0.1 s); a read on s2 that
    // ignored cudarc's write event would see the old values.
    let (v, nn, cycles) = (9.0f32, n as u64, 200_000_000i64);
    let mut launch = s1.launch_builder(&spin_then_fill);
    launch.arg(&mut buf).arg(&v).arg(&nn).arg(&cycles);
    // SAFETY: the signature matches; the buffer holds `n` floats.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n as u32)) }.unwrap();
    let mut out = vec![0f32; n];
    s2.memcpy_dtoh(&buf, &mut out).unwrap();
    s2.synchronize().unwrap();
    assert!(out.iter().all(|x| *x == 9.0), "the read on s2 did not wait for the kernel on s1");
    // cumem's own synchronous copy waits for cudarc's tracked write too.
    let mut launch = s1.launch_builder(&spin_then_fill);
    let v2 = 4.0f32;
    launch.arg(&mut buf).arg(&v2).arg(&nn).arg(&cycles);
    // SAFETY: as above.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n as u32)) }.unwrap();
    assert!(buf.to_vec().unwrap().iter().all(|x| *x == 4.0), "to_vec did not wait for the kernel on s1");
    // And a cudarc read after cumem's own write sees it.
    buf.copy_from_host(&vec![6.0f32; n]).unwrap();
    s2.memcpy_dtoh(&buf, &mut out).unwrap();
    s2.synchronize().unwrap();
    assert!(out.iter().all(|x| *x == 6.0));
    // Dropping the buffer orders its free after the tracked uses.
    drop(buf);
    s1.synchronize().unwrap();
    ctx.check_err().unwrap();
}

#[test]
fn views_refuse_bad_ranges_and_the_host_fallback() {
    let mm = MemoryManager::global().unwrap();
    let mut b = DeviceBuffer::<u32>::new(16).unwrap();
    for r in [(0usize, 17usize), (5, 4), (17, 17)] {
        assert!(matches!(b.cuda_view(r.0..r.1), Err(Error::InvalidState(_)) | Err(Error::NeedsGpu(_))), "{r:?}");
    }
    assert!(b.cuda_view(..=usize::MAX).is_err());
    if mm.backend().is_host() {
        assert!(matches!(b.cuda_view(0..4), Err(Error::NeedsGpu(_))));
        assert!(matches!(b.cuda_view_mut(..), Err(Error::NeedsGpu(_))));
    } else {
        assert_eq!(b.cuda_view(2..6).unwrap().len(), 4);
        assert_eq!(b.cuda_view_mut(..).unwrap().len(), 16);
    }
}
