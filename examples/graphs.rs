//! An inference-like step captured once into a CUDA graph and replayed many
//! times: three kernels with temporary `DeviceBuffer`s, allocated and
//! dropped inside the step. The temporaries come from the graph's private
//! pool, so replays never touch anyone else's memory.
//!
//! Prints ns per step run eagerly against ns per graph replay, and the
//! memory the graph holds. On the host fallback it says what it skips (no
//! kernels run there) and exits 0.

use std::time::Instant;

use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use cumem::{DeviceBuffer, MemoryManager, Stream};

const KERNELS: &str = r#"
extern "C" __global__ void scale_shift(float* out, const float* x, float a, float b, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) out[i] = a * x[i] + b;
}
extern "C" __global__ void square(float* out, const float* x, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] * x[i];
}
extern "C" __global__ void residual(float* y, const float* h, const float* x, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = h[i] - x[i];
}
"#;

const N: usize = 1 << 16;
const RUNS: usize = 2000;

struct Step {
    scale_shift: CudaFunction,
    square: CudaFunction,
    residual: CudaFunction,
}

impl Step {
    /// y = (2x + 1)^2 - x, through two temporaries freed on the stream.
    fn run(&self, stream: &Stream, x: &DeviceBuffer<f32>, y: &DeviceBuffer<f32>) -> Result<(), cumem::Error> {
        let t1 = DeviceBuffer::<f32>::new_on(N, stream)?;
        let t2 = DeviceBuffer::<f32>::new_on(N, stream)?;
        let s = stream.cudarc().expect("a CUDA stream");
        let (xp, yp, p1, p2) = (x.device_ptr(), y.device_ptr(), t1.device_ptr(), t2.device_ptr());
        let (a, b, n) = (2.0f32, 1.0f32, N as u64);
        let cfg = LaunchConfig::for_num_elems(N as u32);
        let mut l = s.launch_builder(&self.scale_shift);
        l.arg(&p1).arg(&xp).arg(&a).arg(&b).arg(&n);
        // SAFETY: the arguments match the kernel; every buffer holds N floats
        // and lives until its work is done (temporaries are freed in stream
        // order when dropped below).
        unsafe { l.launch(cfg) }.map_err(|e| cumem::Error::InvalidState(e.to_string()))?;
        let mut l = s.launch_builder(&self.square);
        l.arg(&p2).arg(&p1).arg(&n);
        // SAFETY: as above.
        unsafe { l.launch(cfg) }.map_err(|e| cumem::Error::InvalidState(e.to_string()))?;
        let mut l = s.launch_builder(&self.residual);
        l.arg(&yp).arg(&p2).arg(&xp).arg(&n);
        // SAFETY: as above.
        unsafe { l.launch(cfg) }.map_err(|e| cumem::Error::InvalidState(e.to_string()))?;
        Ok(())
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mm = MemoryManager::global()?;
    println!("cumem runs on: {}", mm.backend());
    let stream = Stream::new()?;
    let Some(cs) = stream.cudarc() else {
        println!("host fallback: skipped the kernels, the capture and the timings (they need a GPU).");
        return Ok(());
    };
    let ctx = cs.context().clone();
    let module = ctx.load_module(cudarc::nvrtc::compile_ptx(KERNELS)?)?;
    let step = Step {
        scale_shift: module.load_function("scale_shift")?,
        square: module.load_function("square")?,
        residual: module.load_function("residual")?,
    };
    let xs: Vec<f32> = (0..N).map(|i| (i % 1000) as f32 * 0.001).collect();
    let x = DeviceBuffer::from_host(&xs)?;
    let y = DeviceBuffer::<f32>::new(N)?;

    // Eagerly: allocate, launch, free, every step.
    step.run(&stream, &x, &y)?;
    stream.synchronize()?;
    let t0 = Instant::now();
    for _ in 0..RUNS {
        step.run(&stream, &x, &y)?;
    }
    stream.synchronize()?;
    let eager = t0.elapsed().as_nanos() as f64 / RUNS as f64;

    // Captured once, replayed.
    let pool = mm.graph_pool()?;
    let capture = mm.begin_capture(&stream, &pool)?;
    step.run(&stream, &x, &y)?;
    let graph = capture.end()?;
    graph.launch(&stream)?;
    stream.synchronize()?;
    let t0 = Instant::now();
    for _ in 0..RUNS {
        graph.launch(&stream)?;
    }
    stream.synchronize()?;
    let replay = t0.elapsed().as_nanos() as f64 / RUNS as f64;

    let out = y.to_vec()?;
    for (i, (&yi, &xi)) in out.iter().zip(&xs).enumerate() {
        let want = (2.0 * xi + 1.0) * (2.0 * xi + 1.0) - xi;
        if (yi - want).abs() > 1e-4 * want.abs().max(1.0) {
            return Err(format!("element {i}: {yi} != {want}").into());
        }
    }
    let held = graph.pool().stats();
    println!("results checked: {N} values");
    println!("eager step (2 temporaries, 3 kernels): {eager:.0} ns per step");
    println!("graph replay:                          {replay:.0} ns per replay ({:.2}x)", eager / replay);
    println!(
        "the graph holds {} reserved ({} in live blocks; temporaries are reused within the graph)",
        cumem::manager::human_bytes(held.reserved),
        cumem::manager::human_bytes(held.in_use)
    );
    drop((graph, pool));
    let after = mm.device_stats(mm.config().device)?.graphs;
    println!("after dropping the graph: {} private pools, {} reserved", after.pools, after.reserved);

    // The same step captured with cudarc's own API: cumem is told nothing,
    // notices the capture and keeps its memory until the graph is gone.
    cs.begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)?;
    step.run(&stream, &x, &y)?;
    let graph = cs.end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))?.ok_or("an empty capture")?;
    for _ in 0..RUNS {
        graph.launch()?;
    }
    stream.synchronize()?;
    let held = mm.device_stats(mm.config().device)?.graphs;
    println!(
        "captured with cudarc: {} private pool(s), {} reserved while the graph lives",
        held.pools,
        cumem::manager::human_bytes(held.reserved)
    );
    drop(graph);
    // The driver runs the graph's user-object destructor on a thread of its
    // own; the next cumem call releases the pool.
    let start = Instant::now();
    let mut after = mm.device_stats(mm.config().device)?.graphs;
    while after.pools > 0 && start.elapsed().as_secs() < 5 {
        std::thread::sleep(std::time::Duration::from_millis(1));
        after = mm.device_stats(mm.config().device)?.graphs;
    }
    println!("after dropping it: {} private pools, {} reserved", after.pools, after.reserved);
    Ok(())
}
