//! Sleep and wake of a tag's memory, measured: the pinned copy bandwidth
//! of this machine, then a tag holding `GIB` GiB of model-like blocks put
//! to sleep (offloaded to pinned memory) and woken, several times, beside
//! it; the device memory the sleep gave back, as the driver reports it;
//! then 100 cycles of a smaller tag, watching address space, pinned memory
//! and the process's resident memory.
//!
//! ```text
//! cargo run --release --example sleep_wake -- [GIB] [CYCLE_GIB]
//! ```
//! Defaults: 20 GiB and 1 GiB on a GPU, 0.25 and 0.0625 on the host
//! fallback (where "device" memory is host memory and nothing is timed
//! that means anything).

use std::time::Instant;

use cudarc::driver::sys;
use cumem::{MemoryManager, Stream};

const MIB: usize = 1 << 20;

fn main() -> cumem::Result<()> {
    let mm = MemoryManager::global()?;
    let gpu = !mm.backend().is_host();
    let args: Vec<f64> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let gib = args.first().copied().unwrap_or(if gpu { 20.0 } else { 0.25 });
    let cycle_gib = args.get(1).copied().unwrap_or(if gpu { 1.0 } else { 0.0625 });
    println!("backend: {}", mm.backend());
    let stream = Stream::new()?;

    // The baseline: pinned <-> device copies of 2 GiB (one block each way).
    let (h2d, d2h) = pinned_bandwidth(mm, &stream, if gpu { 2048 * MIB } else { 64 * MIB })?;
    println!("pinned copy bandwidth: host->device {h2d:.1} GB/s, device->host {d2h:.1} GB/s");

    // A model's weights: a few large tensors, many middling, many small.
    let sizes = model_sizes((gib * 1024.0) as usize * MIB);
    let blocks: Vec<u64> = {
        let _tag = mm.tag("weights")?;
        sizes.iter().map(|&s| mm.allocate_device(s)).collect::<cumem::Result<_>>()?
    };
    let total: usize = sizes.iter().sum();
    for (i, (&p, &s)) in blocks.iter().zip(&sizes).enumerate() {
        fill(mm, &stream, p, s, i as u32)?;
    }
    stream.synchronize()?;
    println!("tag 'weights': {} blocks, {:.2} GiB", blocks.len(), total as f64 / (1024.0 * MIB as f64));

    println!("cycle | sleep s | copy out GB/s | wake s | copy in GB/s | released (driver) / held");
    for cycle in 0..4 {
        let held: usize = mm.tag_usage().iter().filter(|u| u.name == "weights").map(|u| u.pool.mapped).sum();
        let free_before = device_free();
        let s = mm.sleep(&["weights"], &[])?;
        let free_after = device_free();
        let w = mm.wake(&["weights"])?;
        let gbps = |bytes: usize, secs: f64| bytes as f64 / secs / 1e9;
        let released = match (free_before, free_after) {
            (Some(b), Some(a)) => format!("{:.4}", (a as f64 - b as f64) / held as f64),
            _ => "n/a".into(),
        };
        println!(
            "{cycle} | {:.3} | {:.1} | {:.3} | {:.1} | {released}",
            s.seconds,
            gbps(s.offloaded, s.copy_seconds),
            w.seconds,
            gbps(w.restored, w.copy_seconds),
        );
        println!(
            "{{\"cycle\":{cycle},\"bytes\":{},\"sleep_s\":{:.4},\"sleep_copy_s\":{:.4},\"wake_s\":{:.4},\
             \"wake_copy_s\":{:.4},\"h2d_gbps\":{h2d:.2},\"d2h_gbps\":{d2h:.2},\"released_of_held\":\"{released}\"}}",
            s.offloaded, s.seconds, s.copy_seconds, w.seconds, w.copy_seconds
        );
    }
    // The contents came back: every block's pattern, checked on the host.
    for (i, (&p, &s)) in blocks.iter().zip(&sizes).enumerate().step_by(7) {
        check(mm, &stream, p, s, i as u32)?;
    }
    println!("contents after 4 cycles: identical (every 7th block checked)");
    for p in blocks {
        mm.free_device(p)?;
    }
    mm.release_cached()?;

    // Growth over 100 cycles of a smaller tag and a discarded one.
    let small = model_sizes((cycle_gib * 1024.0) as usize * MIB);
    let (kept, kv) = {
        let _w = mm.tag("cycle")?;
        let kept: Vec<u64> = small.iter().map(|&s| mm.allocate_device(s)).collect::<cumem::Result<_>>()?;
        let _kv = mm.tag("cycle-kv")?;
        (kept, mm.allocate_device(64 * MIB)?)
    };
    for (i, (&p, &s)) in kept.iter().zip(&small).enumerate() {
        fill(mm, &stream, p, s, 1000 + i as u32)?;
    }
    stream.synchronize()?;
    let figures = || {
        let u = mm.tag_usage();
        let reserved: usize = u.iter().filter(|u| u.name.starts_with("cycle")).map(|u| u.pool.reserved).sum();
        (reserved, mm.pinned_stats().reserved, resident())
    };
    let mut first = None;
    let start = Instant::now();
    for cycle in 1..=100 {
        mm.sleep(&["cycle"], &["cycle-kv"])?;
        mm.wake(&[])?;
        if cycle == 1 {
            first = Some(figures());
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let (f, l) = (first.expect("set at cycle 1"), figures());
    println!(
        "100 cycles of {:.2} GiB in {secs:.1} s: address space {} -> {} B, pinned reserved {} -> {} B, resident {} -> {} kB",
        small.iter().sum::<usize>() as f64 / (1024.0 * MIB as f64),
        f.0,
        l.0,
        f.1,
        l.1,
        f.2,
        l.2
    );
    for (i, (&p, &s)) in kept.iter().zip(&small).enumerate() {
        check(mm, &stream, p, s, 1000 + i as u32)?;
    }
    println!("contents after 100 cycles: identical");
    for p in kept.into_iter().chain([kv]) {
        mm.free_device(p)?;
    }
    Ok(())
}

/// Block sizes adding up to about `total`: a quarter in 256 MiB blocks,
/// half in 8-64 MiB blocks, the rest in 4 KiB-2 MiB blocks (a fixed
/// sequence, so runs compare).
fn model_sizes(total: usize) -> Vec<usize> {
    let mut sizes = Vec::new();
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = |lo: usize, hi: usize| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        lo + (x as usize) % (hi - lo)
    };
    let (mut big, mut mid, mut small) = (total / 4, total / 2, total / 4);
    while big >= 256 * MIB {
        sizes.push(256 * MIB);
        big -= 256 * MIB;
    }
    mid += big;
    while mid > 8 * MIB {
        let s = next(8 * MIB, 64 * MIB).min(mid);
        sizes.push(s);
        mid -= s;
    }
    small += mid;
    while small > 4096 {
        let s = next(4096, 2 * MIB).min(small);
        sizes.push(s);
        small -= s;
    }
    sizes
}

/// Writes a pattern of `seed` over the block (`u32` words).
fn fill(mm: &MemoryManager, stream: &Stream, p: u64, size: usize, seed: u32) -> cumem::Result<()> {
    let words: Vec<u32> = (0..size / 4).map(|i| (i as u32).wrapping_mul(2_654_435_761) ^ seed).collect();
    // SAFETY: `p` is a live device block of `size` bytes; `words` holds
    // `size / 4` words and lives until the stream is synchronised here.
    unsafe { mm.copy_to_device_async(p, words.as_ptr().cast(), words.len() * 4, stream)? };
    stream.synchronize()
}

/// Reads the block back and checks `fill`'s pattern.
fn check(mm: &MemoryManager, stream: &Stream, p: u64, size: usize, seed: u32) -> cumem::Result<()> {
    let mut words = vec![0u32; size / 4];
    // SAFETY: as in `fill`, reading into `words`.
    unsafe { mm.copy_to_host_async(words.as_mut_ptr().cast(), p, words.len() * 4, stream)? };
    stream.synchronize()?;
    match words.iter().enumerate().find(|&(i, &w)| w != (i as u32).wrapping_mul(2_654_435_761) ^ seed) {
        Some((i, _)) => Err(cumem::Error::InvalidState(format!("block {p:#x}: word {i} differs after wake"))),
        None => Ok(()),
    }
}

/// The best of five pinned copies of `bytes` each way, in GB/s.
fn pinned_bandwidth(mm: &MemoryManager, stream: &Stream, bytes: usize) -> cumem::Result<(f64, f64)> {
    let host = mm.allocate_pinned(bytes)?;
    let dev = mm.allocate_device(bytes)?;
    let mut best = (0f64, 0f64);
    for _ in 0..5 {
        let t = Instant::now();
        // SAFETY: both are blocks of `bytes` bytes of their kinds, used by
        // nothing else, until the synchronisation below.
        unsafe { mm.copy_to_device_async(dev, host.as_ptr(), bytes, stream)? };
        stream.synchronize()?;
        best.0 = best.0.max(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
        let t = Instant::now();
        // SAFETY: as above, the other way.
        unsafe { mm.copy_to_host_async(host.as_ptr(), dev, bytes, stream)? };
        stream.synchronize()?;
        best.1 = best.1.max(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    mm.free_device(dev)?;
    mm.free_pinned(host.as_ptr())?;
    Ok(best)
}

/// The device's free memory as the driver reports it (`None` on the host
/// fallback).
fn device_free() -> Option<usize> {
    let ctx = cumem::device::device_context(0).ok()??;
    ctx.bind_to_thread().ok()?;
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: two valid out-pointers; the context is current.
    unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) }.result().ok()?;
    Some(free)
}

/// The process's resident memory in kB (`VmRSS`), 0 where unknown.
fn resident() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}
