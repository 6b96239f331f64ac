//! A data pipeline: batches are filled in pinned host memory, copied to the
//! GPU on two streams (double-buffered, so one batch's copies overlap the
//! other's kernel), transformed by a kernel, copied back and checked. The
//! same pipeline then runs from pageable `Vec`s for comparison.
//!
//! On the host fallback there is no kernel to run: the example says so and
//! stops.

use std::time::Instant;

use cudarc::driver::{LaunchConfig, PushKernelArg};
use cumem::{DeviceBuffer, MemoryManager, PinnedAlloc, PinnedVec, Stream};

const KERNEL: &str = r#"
extern "C" __global__ void transform(float* x, unsigned long long n, float a, float b) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) x[i] = a * x[i] + b;
}
"#;

const BATCH: usize = 16 << 20; // floats per batch (64 MiB)
const BATCHES: usize = 24;

fn expected(batch: usize, i: usize) -> f32 {
    2.0 * ((batch * 7 + i) % 1000) as f32 + 1.0
}

/// Every STRIDE-th value is written and checked: enough to prove each batch
/// went through the kernel, cheap enough that the copies, not the CPU, set
/// the pace.
const STRIDE: usize = 4096;

fn fill(buf: &mut [f32], batch: usize) {
    for i in (0..buf.len()).step_by(STRIDE) {
        buf[i] = ((batch * 7 + i) % 1000) as f32;
    }
}

/// Runs the pipeline over host buffers `host[0..2]`; returns GB/s moved
/// (both directions).
fn run<H: AsMut<[f32]> + AsRef<[f32]>>(host: &mut [H; 2], label: &str) -> Result<f64, cumem::Error> {
    let mm = MemoryManager::global()?;
    let Some(ctx) = mm.default_device()?.context().cloned() else {
        return Ok(0.0);
    };
    let ptx = cudarc::nvrtc::compile_ptx(KERNEL).expect("NVRTC compiles the kernel");
    let module = ctx.load_module(ptx).map_err(|e| cumem::Error::InvalidState(e.to_string()))?;
    let f = module.load_function("transform").map_err(|e| cumem::Error::InvalidState(e.to_string()))?;
    let streams = [Stream::new()?, Stream::new()?];
    let mut dev = [DeviceBuffer::<f32>::new_on(BATCH, &streams[0])?, DeviceBuffer::<f32>::new_on(BATCH, &streams[1])?];
    let (n, a, b) = (BATCH as u64, 2.0f32, 1.0f32);
    let start = Instant::now();
    for batch in 0..BATCHES {
        let slot = batch % 2;
        let s = &streams[slot];
        // Wait until this slot's previous batch is back, check it, refill.
        s.synchronize()?;
        if batch >= 2 {
            check(host[slot].as_ref(), batch - 2);
        }
        fill(host[slot].as_mut(), batch);
        let ptr = dev[slot].device_ptr();
        // SAFETY: the host buffer is not touched again until this slot's
        // stream is synchronised (top of the loop, or after it).
        unsafe { dev[slot].copy_from_host_async(host[slot].as_ref(), s)? };
        let cs = s.cudarc().expect("a CUDA stream");
        let mut launch = cs.launch_builder(&f);
        launch.arg(&ptr).arg(&n).arg(&a).arg(&b);
        // SAFETY: the kernel takes (float*, u64, float, float); the buffer
        // holds BATCH floats and outlives the stream's work.
        unsafe { launch.launch(LaunchConfig::for_num_elems(BATCH as u32)) }
            .map_err(|e| cumem::Error::InvalidState(e.to_string()))?;
        // SAFETY: as for the copy in.
        unsafe { dev[slot].copy_to_host_async(host[slot].as_mut(), s)? };
    }
    for (slot, s) in streams.iter().enumerate() {
        s.synchronize()?;
        check(host[slot].as_ref(), BATCHES - 2 + slot);
    }
    let secs = start.elapsed().as_secs_f64();
    let gbps = (2 * BATCHES * BATCH * 4) as f64 / secs / 1e9;
    println!(
        "{label:>9}: {BATCHES} batches of {} MiB in, transformed and out in {secs:.3} s: {gbps:.1} GB/s both ways",
        (BATCH * 4) >> 20
    );
    Ok(gbps)
}

fn check(buf: &[f32], batch: usize) {
    for i in (0..buf.len()).step_by(STRIDE) {
        assert_eq!(buf[i], expected(batch, i), "batch {batch}, element {i}");
    }
}

fn main() -> Result<(), cumem::Error> {
    let mm = MemoryManager::global()?;
    println!("cumem runs on: {}", mm.backend());
    if mm.backend().is_host() {
        println!("the pipeline needs a GPU to run its kernel; nothing to do on the host fallback.");
        return Ok(());
    }
    let mut pinned: [PinnedVec<f32>; 2] = [PinnedVec::new_in(PinnedAlloc), PinnedVec::new_in(PinnedAlloc)];
    for p in &mut pinned {
        p.resize(BATCH, 0.0);
    }
    let pinned_rate = run(&mut pinned, "PinnedVec")?;
    drop(pinned);
    let mut pageable = [vec![0.0f32; BATCH], vec![0.0f32; BATCH]];
    let pageable_rate = run(&mut pageable, "Vec")?;
    println!("pinned/pageable throughput: {:.2}x; results checked for every batch", pinned_rate / pageable_rate);
    println!("{}", mm.memory_summary());
    Ok(())
}
