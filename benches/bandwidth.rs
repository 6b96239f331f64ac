//! Host↔device copy bandwidth of 256 MiB: from a `PinnedVec` (cumem's
//! pinned pool), from raw `cuMemHostAlloc` memory, and from a pageable
//! `Vec`, all measured in the same run (`cuMemcpyHtoDAsync` /
//! `cuMemcpyDtoHAsync` on one stream, median of several copies).
//!
//! Prints a table; on the host fallback it says there is nothing to measure.

use std::time::Instant;

use cudarc::driver::{result, sys};
use cumem::{DeviceBuffer, MemoryManager, PinnedAlloc, PinnedVec, Stream};

const BYTES: usize = 256 << 20;
const REPS: usize = 9;

/// Median seconds of `REPS` copies of BYTES between `host` and `dev`.
fn time_copies(host: *mut u8, dev: u64, stream: &Stream, to_device: bool) -> f64 {
    let mut times = Vec::with_capacity(REPS);
    for _ in 0..REPS {
        let t = Instant::now();
        // SAFETY: `host` points to BYTES bytes that outlive the copy, `dev`
        // to a BYTES-long device buffer; the stream is synchronised before
        // either is touched again.
        let r = unsafe {
            if to_device {
                sys::cuMemcpyHtoDAsync_v2(dev, host.cast(), BYTES, stream.cu_stream())
            } else {
                sys::cuMemcpyDtoHAsync_v2(host.cast(), dev, BYTES, stream.cu_stream())
            }
        };
        r.result().expect("copy queued");
        stream.synchronize().expect("copy done");
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    times[REPS / 2]
}

fn main() -> Result<(), cumem::Error> {
    let mm = MemoryManager::global()?;
    println!("cumem bandwidth bench on {}", mm.backend());
    if mm.backend().is_host() {
        println!("no GPU: nothing to measure on the host fallback");
        return Ok(());
    }
    let ctx = mm.default_device()?.context().cloned().expect("a CUDA device");
    ctx.bind_to_thread().expect("context");
    let stream = Stream::new()?;
    let dev = DeviceBuffer::<u8>::new(BYTES)?;

    let mut pinned: PinnedVec<u8> = PinnedVec::with_capacity_in(BYTES, PinnedAlloc);
    pinned.resize(BYTES, 1);
    // SAFETY: plain page-locked host memory of BYTES bytes, freed below.
    let raw = unsafe { result::malloc_host(BYTES, 0) }.expect("cuMemHostAlloc") as *mut u8;
    // SAFETY: `raw` holds BYTES writable bytes.
    unsafe { raw.write_bytes(1, BYTES) };
    let mut pageable = vec![1u8; BYTES];

    let gbps = |secs: f64| BYTES as f64 / secs / 1e9;
    let mut rows = Vec::new();
    for (name, ptr) in [
        ("PinnedVec (cumem)", pinned.as_mut_ptr()),
        ("raw cuMemHostAlloc", raw),
        ("pageable Vec", pageable.as_mut_ptr()),
    ] {
        let h2d = gbps(time_copies(ptr, dev.device_ptr(), &stream, true));
        let d2h = gbps(time_copies(ptr, dev.device_ptr(), &stream, false));
        rows.push((name, h2d, d2h));
    }
    let (raw_h2d, raw_d2h) = (rows[1].1, rows[1].2);
    println!("| 256 MiB copy | host to device | device to host | vs raw pinned (H2D / D2H) |");
    println!("| --- | --- | --- | --- |");
    for (name, h2d, d2h) in &rows {
        println!(
            "| {name} | {h2d:.1} GB/s | {d2h:.1} GB/s | {:.1}% / {:.1}% |",
            100.0 * h2d / raw_h2d,
            100.0 * d2h / raw_d2h
        );
    }
    // SAFETY: `raw` came from cuMemHostAlloc and no copy uses it any more.
    unsafe { result::free_host(raw.cast()) }.expect("cuMemFreeHost");
    Ok(())
}
