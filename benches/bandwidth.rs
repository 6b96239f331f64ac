//! Host↔device copy bandwidth from 1 to 256 MiB: from a pageable `Vec`
//! staged through the pinned pool (`copy_from_pageable` /
//! `copy_to_pageable`), from the same `Vec` plain (`cuMemcpyHtoDAsync` /
//! `cuMemcpyDtoHAsync`), from raw `cuMemHostAlloc` memory and from a
//! `PinnedVec` (cumem's pinned pool), all measured in the same run on one
//! stream, median of several copies.
//!
//! Prints a table; on the host fallback it says there is nothing to measure.

use std::time::Instant;

use cudarc::driver::{result, sys};
use cumem::{DeviceBuffer, MemoryManager, PinnedAlloc, PinnedVec, Stream};

const BYTES: usize = 256 << 20;
const REPS: usize = 9;

/// Median seconds of `REPS` runs of `copy`.
fn median(mut copy: impl FnMut()) -> f64 {
    copy(); // warm-up: staging blocks, page tables
    let mut times = Vec::with_capacity(REPS);
    for _ in 0..REPS {
        let t = Instant::now();
        copy();
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    times[REPS / 2]
}

/// Median seconds of plain copies of `bytes` between `host` and `dev`.
fn time_copies(host: *mut u8, dev: u64, stream: &Stream, to_device: bool, bytes: usize) -> f64 {
    median(|| {
        // SAFETY: `host` points to at least `bytes` bytes that outlive the
        // copy, `dev` to a device buffer at least as long; the stream is
        // synchronised before either is touched again.
        let r = unsafe {
            if to_device {
                sys::cuMemcpyHtoDAsync_v2(dev, host.cast(), bytes, stream.cu_stream())
            } else {
                sys::cuMemcpyDtoHAsync_v2(host.cast(), dev, bytes, stream.cu_stream())
            }
        };
        r.result().expect("copy queued");
        stream.synchronize().expect("copy done");
    })
}

/// Median seconds of staged copies of `host.len()` bytes.
fn time_staged(mm: &MemoryManager, host: &mut [u8], dev: u64, stream: &Stream, to_device: bool) -> f64 {
    median(|| {
        // SAFETY: `dev` is a device buffer of `host.len()` bytes, unshared.
        let r = unsafe {
            if to_device {
                mm.copy_from_pageable(dev, host, stream)
            } else {
                mm.copy_to_pageable(host, dev, stream)
            }
        };
        r.expect("staged copy");
    })
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

    println!("| size | direction | pageable, staged | pageable, plain | raw pinned | PinnedVec (cumem) | staged / raw pinned |");
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for mib in [1usize, 2, 4, 8, 16, 32, 256] {
        let n = mib << 20;
        for to_device in [true, false] {
            let d = dev.device_ptr();
            let staged = time_staged(mm, &mut pageable[..n], d, &stream, to_device);
            let hosts = [pageable.as_mut_ptr(), raw, pinned.as_mut_ptr()];
            let [plain, raw_pinned, ours] = hosts.map(|h| time_copies(h, d, &stream, to_device, n));
            let [s, p, r, o] = [staged, plain, raw_pinned, ours].map(|secs| n as f64 / secs / 1e9);
            let dir = if to_device { "to device" } else { "to host" };
            println!(
                "| {mib} MiB | {dir} | {s:.1} GB/s | {p:.1} GB/s | {r:.1} GB/s | {o:.1} GB/s | {:.1}% |",
                100.0 * s / r
            );
        }
    }
    // SAFETY: `raw` came from cuMemHostAlloc and no copy uses it any more.
    unsafe { result::free_host(raw.cast()) }.expect("cuMemFreeHost");
    Ok(())
}
