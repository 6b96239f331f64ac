//! Host↔device copy bandwidth of 256 MiB: from a `PinnedVec` (cumem's
//! pinned pool), from raw `cuMemHostAlloc` memory, from a pageable `Vec`
//! (plain `cuMemcpyHtoDAsync` / `cuMemcpyDtoHAsync`), and from the same
//! pageable `Vec` staged through the pinned pool
//! (`copy_from_pageable` / `copy_to_pageable`), all measured in the same
//! run on one stream, median of several copies. A second table compares
//! the staged copy with the plain ones from 1 to 256 MiB.
//!
//! Prints tables; on the host fallback it says there is nothing to measure.

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
        // SAFETY: `dev` is a device buffer at least `host.len()` bytes long
        // that nothing else uses meanwhile.
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

    let gbps = |secs: f64| BYTES as f64 / secs / 1e9;
    let mut rows = Vec::new();
    for (name, ptr) in [
        ("PinnedVec (cumem)", pinned.as_mut_ptr()),
        ("raw cuMemHostAlloc", raw),
        ("pageable Vec", pageable.as_mut_ptr()),
    ] {
        let h2d = gbps(time_copies(ptr, dev.device_ptr(), &stream, true, BYTES));
        let d2h = gbps(time_copies(ptr, dev.device_ptr(), &stream, false, BYTES));
        rows.push((name, h2d, d2h));
    }
    let h2d = gbps(time_staged(mm, &mut pageable, dev.device_ptr(), &stream, true));
    let d2h = gbps(time_staged(mm, &mut pageable, dev.device_ptr(), &stream, false));
    rows.push(("pageable Vec, staged (copy_from/to_pageable)", h2d, d2h));
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

    println!();
    println!("| size | staged H2D | plain pageable H2D | raw pinned H2D | staged D2H | plain pageable D2H | raw pinned D2H |");
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for mib in [1usize, 2, 4, 8, 16, 32, 256] {
        let n = mib << 20;
        let rate = |secs: f64| n as f64 / secs / 1e9;
        let d = dev.device_ptr();
        let sh = rate(time_staged(mm, &mut pageable[..n], d, &stream, true));
        let ph = rate(time_copies(pageable.as_mut_ptr(), d, &stream, true, n));
        let rh = rate(time_copies(raw, d, &stream, true, n));
        let sd = rate(time_staged(mm, &mut pageable[..n], d, &stream, false));
        let pd = rate(time_copies(pageable.as_mut_ptr(), d, &stream, false, n));
        let rd = rate(time_copies(raw, d, &stream, false, n));
        println!(
            "| {mib} MiB | {sh:.1} GB/s | {ph:.1} GB/s | {rh:.1} GB/s | {sd:.1} GB/s | {pd:.1} GB/s | {rd:.1} GB/s |"
        );
    }

    // SAFETY: `raw` came from cuMemHostAlloc and no copy uses it any more.
    unsafe { result::free_host(raw.cast()) }.expect("cuMemFreeHost");
    Ok(())
}
