//! Several GPUs: every device gets its own stream and buffers from cumem,
//! device 0's kernel then sums all of them by reading the other devices'
//! memory directly (peer access, granted with `enable_peer_access`), and
//! the result is checked. Last, the bandwidth of cumem's peer copies
//! between pool memory is measured against raw `cuMemcpyPeerAsync` between
//! plain `cuMemAlloc` buffers, in the same run.
//!
//! On one GPU, or on the host fallback, the example says what it skips and
//! exits successfully.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{sys, CudaContext, LaunchConfig, PushKernelArg};
use cumem::{DeviceBuffer, Error, MemoryManager, Stream};

const KERNELS: &str = r#"
extern "C" __global__ void fill(float* x, unsigned long long n, float v) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) x[i] = v + (float)(i % 1024);
}
extern "C" __global__ void add_from(float* acc, const float* peer, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) acc[i] += peer[i];
}
"#;

/// Values per device buffer (64 MiB of f32).
const N: usize = 16 << 20;
/// Bytes per copy in the bandwidth test, and copies per measurement.
const COPY_BYTES: usize = 256 << 20;
const COPIES: usize = 20;

fn driver(e: cudarc::driver::DriverError) -> Error {
    Error::InvalidState(e.to_string())
}

/// Times `COPIES` copies queued by `copy` on `stream`; returns GB/s.
fn bandwidth(stream: &Stream, mut copy: impl FnMut() -> Result<(), Error>) -> Result<f64, Error> {
    copy()?; // warm-up
    stream.synchronize()?;
    let t = Instant::now();
    for _ in 0..COPIES {
        copy()?;
    }
    stream.synchronize()?;
    Ok((COPIES * COPY_BYTES) as f64 / t.elapsed().as_secs_f64() / 1e9)
}

/// Raw driver memory for the baseline (`cuMemAlloc` / `cuMemFree`).
struct Raw {
    ctx: Arc<CudaContext>,
    ptr: u64,
}

impl Raw {
    fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Raw, Error> {
        ctx.bind_to_thread().map_err(driver)?;
        // SAFETY: the context is current; the memory is used only as an
        // address in copies and freed once in `drop`.
        let ptr = unsafe { cudarc::driver::result::malloc_sync(bytes) }.map_err(driver)?;
        Ok(Raw { ctx: ctx.clone(), ptr })
    }
}

impl Drop for Raw {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated in `new`, freed once; `cuMemFree` waits for
            // the copies that use it.
            let _ = unsafe { cudarc::driver::result::free_sync(self.ptr) };
        }
    }
}

/// Sums every device's buffer into device 0's with kernels on device 0
/// that read the other devices' memory (peer access), and checks the sum.
fn reduce(
    mm: &MemoryManager,
    module: &Arc<cudarc::driver::CudaModule>,
    streams: &[Stream],
    bufs: &[DeviceBuffer<f32>],
) -> Result<(), Error> {
    let devices = bufs.len();
    for peer in 1..devices {
        mm.enable_peer_access(0, peer)?;
    }
    let add = module.load_function("add_from").map_err(driver)?;
    let t = Instant::now();
    for peer in 1..devices {
        streams[0].wait_for(&streams[peer])?;
        let (acc, src, n) = (bufs[0].device_ptr(), bufs[peer].device_ptr(), N as u64);
        let cs = streams[0].cudarc().expect("a CUDA stream");
        let mut launch = cs.launch_builder(&add);
        launch.arg(&acc).arg(&src).arg(&n);
        // SAFETY: both buffers hold N floats; device 0 has peer access to
        // `peer`'s memory; the fill on `peer`'s stream is ordered before.
        unsafe { launch.launch(LaunchConfig::for_num_elems(N as u32)) }.map_err(driver)?;
    }
    streams[0].synchronize()?;
    let reduce_ms = t.elapsed().as_secs_f64() * 1e3;
    let sum = bufs[0].to_vec()?;
    let base: f32 = (1..=devices).map(|d| d as f32 * 1000.0).sum();
    for i in (0..N).step_by(4093).chain([N - 1]) {
        let want = base + devices as f32 * (i % 1024) as f32;
        assert_eq!(sum[i], want, "element {i} of the reduction");
    }
    println!("peer reduction over {devices} GPUs: {N} values checked, {reduce_ms:.2} ms");
    Ok(())
}

fn main() -> Result<(), Error> {
    let mm = MemoryManager::global()?;
    println!("cumem runs on: {}", mm.backend());
    if mm.backend().is_host() {
        println!("skipped: the host fallback has no GPUs to reduce across or copy between.");
        return Ok(());
    }
    let devices = mm.device_count();
    if devices < 2 {
        println!("skipped: {devices} GPU present; the peer reduction and peer-copy bandwidth need two or more.");
        return Ok(());
    }
    let ctxs: Vec<Arc<CudaContext>> = (0..devices)
        .map(|d| cumem::cuda::device_context(d).map(|c| c.expect("CUDA backend")))
        .collect::<Result<_, _>>()?;
    let streams: Vec<Stream> = (0..devices).map(Stream::new_on).collect::<Result<_, _>>()?;
    let ptx = cudarc::nvrtc::compile_ptx(KERNELS).map_err(|e| Error::InvalidState(e.to_string()))?;
    let modules: Vec<_> = ctxs.iter().map(|c| c.load_module(ptx.clone()).map_err(driver)).collect::<Result<_, _>>()?;

    // Each device fills its own buffer on its own stream.
    let bufs: Vec<DeviceBuffer<f32>> =
        streams.iter().map(|s| DeviceBuffer::<f32>::new_on(N, s)).collect::<Result<_, _>>()?;
    for (d, (buf, s)) in bufs.iter().zip(&streams).enumerate() {
        assert_eq!(buf.device(), d, "a buffer made on device {d}'s stream lives on device {d}");
        let f = modules[d].load_function("fill").map_err(driver)?;
        let (p, n, v) = (buf.device_ptr(), N as u64, (d + 1) as f32 * 1000.0);
        let cs = s.cudarc().expect("a CUDA stream");
        let mut launch = cs.launch_builder(&f);
        launch.arg(&p).arg(&n).arg(&v);
        // SAFETY: `fill` takes (float*, u64, float); the buffer holds N floats
        // and lives until the streams are synchronised.
        unsafe { launch.launch(LaunchConfig::for_num_elems(N as u32)) }.map_err(driver)?;
    }

    // Device 0 reads every other device's buffer directly.
    let unreachable: Vec<usize> =
        (1..devices).filter(|&p| !cumem::cuda::can_access_peer(0, p).unwrap_or(false)).collect();
    if unreachable.is_empty() {
        reduce(mm, &modules[0], &streams, &bufs)?;
    } else {
        println!("skipped the peer reduction: device 0 has no peer path to device(s) {unreachable:?}");
    }

    // Peer-copy bandwidth, 0 -> 1, cumem buffers against raw cuMemAlloc.
    let s1 = &streams[1];
    let src = DeviceBuffer::<u8>::new_on(COPY_BYTES, &streams[0])?;
    let mut dst = DeviceBuffer::<u8>::new_on(COPY_BYTES, s1)?;
    streams[0].synchronize()?;
    let cumem_rate = bandwidth(s1, || {
        // SAFETY: both buffers live until `bandwidth` synchronised `s1`.
        unsafe { dst.copy_from_buffer_async(&src, s1) }
    })?;
    let (raw_src, raw_dst) = (Raw::new(&ctxs[0], COPY_BYTES)?, Raw::new(&ctxs[1], COPY_BYTES)?);
    let raw_rate = bandwidth(s1, || {
        ctxs[1].bind_to_thread().map_err(driver)?;
        // SAFETY: both raw buffers hold COPY_BYTES and live until the
        // stream is synchronised.
        unsafe {
            sys::cuMemcpyPeerAsync(
                raw_dst.ptr,
                ctxs[1].cu_ctx(),
                raw_src.ptr,
                ctxs[0].cu_ctx(),
                COPY_BYTES,
                s1.cu_stream(),
            )
        }
        .result()
        .map_err(driver)
    })?;
    println!(
        "peer copy 0 -> 1, {} MiB x {COPIES}: cumem DeviceBuffer {cumem_rate:.1} GB/s, raw cuMemcpyPeerAsync on cuMemAlloc {raw_rate:.1} GB/s (ratio {:.3})",
        COPY_BYTES >> 20,
        cumem_rate / raw_rate
    );
    drop((src, dst, raw_src, raw_dst));
    for s in &streams {
        s.synchronize()?;
    }
    drop(bufs);
    println!("{}", mm.memory_summary());
    Ok(())
}
