//! What growing device memory costs, by size: `cuMemCreate`, `cuMemMap`
//! and `cuMemSetAccess` (how the expandable pool grows) against
//! `cuMemAlloc` (how a chunked pool grows), in one run. The replay's cold
//! figures are mostly these costs; the growth policy rests on whether they
//! are per call or per byte.
//!
//! `cuMemCreate`, `cuMemMap` and `cuMemSetAccess` are timed both ways:
//! memory exportable to other processes (a POSIX file descriptor handle
//! type, what cumem makes where the device supports it) and not (the
//! `(no fd)` columns).
//!
//! `cuMemSetAccess` is timed both ways too: naming device 0 alone, and
//! naming it with every device that can reach it (`cuDeviceCanAccessPeer`),
//! one call with several descriptors, which is how cumem maps (so that peer
//! access enabled with `cuCtxEnablePeerAccess` reaches its memory), on a
//! chunk granted for the first time and again. With peers the table is
//! printed twice: before the peers' contexts exist (a process that uses
//! one GPU of several) and with them active. On one GPU the calls are the
//! same.
//!
//! The last column, `cumem map`, is cumem's own mapping path as a program
//! meets it: `GrowableBuffer::with_capacity_on` on device 0 (reserve,
//! `cuMemCreate`, `cuMemMap`, `cuMemSetAccess` naming the peers cumem
//! names, which depends on `CUMEM_MAP_PEERS` and on which peers' contexts
//! are active), so builds of the library can be compared.
//!
//! A second table times a page move's calls on memory that already exists
//! (what a remapping pool does with pieces it unmapped and kept): `n`
//! pieces mapped side by side, then unmapped one `cuMemUnmap` per piece
//! against one `cuMemUnmap` over all of them, `cuMemMap` of a kept piece,
//! and one `cuMemSetAccess` over the run. After the single unmap every
//! piece is mapped again at once: a driver that left any piece mapped
//! refuses that, and the table says so.
//!
//! A third table times a move of `n` pieces from one place to another:
//! unmapped, mapped at the new place and granted there on one thread (a
//! move on the allocating thread), against mapped at the new place while
//! still mapped at the old (one memory, two addresses), granted, and the
//! old addresses unmapped by a second thread meanwhile: the first
//! thread's time, and the time until both are done.
//!
//! A fourth table asks whether the driver lets the two run side by side:
//! `n` other pieces mapped and granted alone, against the same while a
//! second thread unmaps `n` pieces.
//!
//! Prints the median of several rounds per size, in microseconds. Without a
//! GPU it says so and measures nothing.

use std::time::Instant;

use cudarc::driver::result;
use cumem::cuda::{device_context, driver_status, vmm};
use cumem::{Error, GrowableBuffer, VmBackend};

fn driver(call: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| Error::InvalidState(format!("{call}: {e}"))
}

const SIZES_MIB: [usize; 6] = [2, 8, 32, 128, 512, 2048];
const ROUNDS: usize = 7;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The devices that can reach device 0 (`cuDeviceCanAccessPeer`), asked
/// without creating their contexts.
fn peers_of_0(devices: usize) -> Vec<usize> {
    let Ok(d0) = result::device::get(0) else { return Vec::new() };
    (1..devices)
        .filter(|&d| {
            let Ok(dd) = result::device::get(d as i32) else { return false };
            let mut can = 0i32;
            // SAFETY: `can` is a valid out-pointer; both handles come from
            // `cuDeviceGet`.
            let rc = unsafe { cudarc::driver::sys::cuDeviceCanAccessPeer(&mut can, dd, d0) };
            rc.result().is_ok() && can != 0
        })
        .collect()
}

fn main() -> cumem::Result<()> {
    let status = driver_status();
    if status.devices() == 0 {
        println!("vmm: no GPU ({status:?}); nothing measured");
        return Ok(());
    }
    let ctx = device_context(0)?.expect("a device");
    ctx.bind_to_thread().map_err(driver("cuCtxSetCurrent"))?;
    if !vmm::vmm_supported(&ctx)? {
        println!("vmm: device 0 has no virtual memory management; nothing measured");
        return Ok(());
    }
    let range = vmm::AddressRange::reserve(&ctx, 4 << 30, 0)?;
    moves(&ctx, &range)?;
    moves_behind(&ctx, &range)?;
    side_by_side(&ctx, &range)?;
    let peers = peers_of_0(status.devices());
    table(&ctx, &range, &peers, "the peers' contexts not created")?;
    if !peers.is_empty() {
        for &d in &peers {
            device_context(d)?;
        }
        ctx.bind_to_thread().map_err(driver("cuCtxSetCurrent"))?;
        table(&ctx, &range, &peers, "the peers' primary contexts active")?;
    }
    Ok(())
}

fn table(
    ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
    range: &vmm::AddressRange,
    peers: &[usize],
    what: &str,
) -> cumem::Result<()> {
    println!("vmm growth costs (median of {ROUNDS} rounds, microseconds); peers of device 0: {peers:?}, {what}");
    println!(
        "{:>9} {:>11} {:>12} {:>9} {:>10} {:>13} {:>10} {:>10} {:>10} {:>10} {:>9} {:>11} {:>10} {:>10}",
        "size",
        "cuMemCreate",
        "(no fd type)",
        "cuMemMap",
        "(no fd)",
        "cuMemSetAccess",
        "(no fd)",
        "(+peers)",
        "(again)",
        "vmm total",
        "GB/s",
        "cuMemAlloc",
        "GB/s",
        "cumem map"
    );
    for mib in SIZES_MIB {
        let size = mib << 20;
        let (mut create, mut map, mut access, mut alloc) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut with_peers, mut again) = (Vec::new(), Vec::new());
        let (mut plain, mut cumem_map) = (Vec::new(), Vec::new());
        let (mut plain_map, mut plain_access) = (Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            let t = Instant::now();
            let buf = GrowableBuffer::<u8>::with_capacity_on(VmBackend::Cuda(0), size)?;
            cumem_map.push(t.elapsed().as_secs_f64() * 1e6);
            drop(buf);
            ctx.bind_to_thread().map_err(driver("cuCtxSetCurrent"))?;
            // Memory no other process can import: created, mapped and
            // granted as the pool's pieces would be without the handle.
            let t = Instant::now();
            let bare = vmm::PhysicalChunk::create_with(ctx, size, false)?;
            plain.push(t.elapsed().as_secs_f64() * 1e6);
            let t = Instant::now();
            range.map(0, &bare)?;
            plain_map.push(t.elapsed().as_secs_f64() * 1e6);
            let t = Instant::now();
            range.set_access(0, size, &[])?;
            plain_access.push(t.elapsed().as_secs_f64() * 1e6);
            range.unmap(0, size)?;
            drop(bare);
            let t = Instant::now();
            let chunk = vmm::PhysicalChunk::create(ctx, size)?;
            create.push(t.elapsed().as_secs_f64() * 1e6);
            let t = Instant::now();
            range.map(0, &chunk)?;
            map.push(t.elapsed().as_secs_f64() * 1e6);
            let t = Instant::now();
            range.set_access(0, size, &[])?;
            access.push(t.elapsed().as_secs_f64() * 1e6);
            range.unmap(0, size)?;
            // The same chunk mapped again and given to every peer, twice
            // (the second is how a remapped spare is granted).
            for times in [&mut with_peers, &mut again] {
                range.map(0, &chunk)?;
                let t = Instant::now();
                range.set_access(0, size, peers)?;
                times.push(t.elapsed().as_secs_f64() * 1e6);
                range.unmap(0, size)?;
            }
            drop(chunk);
            let t = Instant::now();
            // SAFETY: the context is current; the memory is freed at once
            // and never touched.
            let p = unsafe { result::malloc_sync(size) }.map_err(driver("cuMemAlloc"))?;
            alloc.push(t.elapsed().as_secs_f64() * 1e6);
            // SAFETY: `p` came from cuMemAlloc just now and is freed once.
            unsafe { result::free_sync(p) }.map_err(driver("cuMemFree"))?;
        }
        let (c, m, a, al) = (median(create), median(map), median(access), median(alloc));
        let (np, ap, ag, cm) = (median(plain), median(with_peers), median(again), median(cumem_map));
        let (nm, na) = (median(plain_map), median(plain_access));
        let total = c + m + a;
        let gbs = |us: f64| size as f64 / (us * 1e3);
        println!(
            "{:>5} MiB {c:>11.1} {np:>12.1} {m:>9.1} {nm:>10.1} {a:>13.1} {na:>10.1} {ap:>10.1} {ag:>10.1} {total:>10.1} {:>9.1} {al:>11.1} {:>10.1} {cm:>10.1}",
            mib,
            gbs(total),
            gbs(al)
        );
    }
    Ok(())
}

/// The second table (see the module docs): a move's calls on `n` pieces
/// of existing memory mapped side by side at the start of `range`.
fn moves(ctx: &std::sync::Arc<cudarc::driver::CudaContext>, range: &vmm::AddressRange) -> cumem::Result<()> {
    println!("page moves on existing memory (median of {ROUNDS} rounds, microseconds; per call unless said)");
    println!(
        "{:>7} {:>6} {:>13} {:>13} {:>17} {:>14} {:>14}",
        "piece", "pieces", "cuMemMap", "cuMemUnmap", "one cuMemUnmap", "(per piece)", "cuMemSetAccess"
    );
    for (piece_mib, n) in [(2, 1), (2, 16), (32, 1), (32, 4), (32, 16), (32, 64)] {
        let piece = piece_mib << 20;
        let pieces: Vec<vmm::PhysicalChunk> =
            (0..n).map(|_| vmm::PhysicalChunk::create(ctx, piece)).collect::<cumem::Result<_>>()?;
        let map_all = |times: Option<&mut Vec<f64>>| -> cumem::Result<()> {
            let t = Instant::now();
            for (i, c) in pieces.iter().enumerate() {
                range.map(i * piece, c)?;
            }
            if let Some(v) = times {
                v.push(t.elapsed().as_secs_f64() * 1e6 / n as f64);
            }
            Ok(())
        };
        let (mut map, mut each, mut one, mut access) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut refused = None;
        for _ in 0..ROUNDS {
            map_all(Some(&mut map))?;
            let t = Instant::now();
            range.set_access(0, n * piece, &[])?;
            access.push(t.elapsed().as_secs_f64() * 1e6);
            let t = Instant::now();
            for i in 0..n {
                range.unmap(i * piece, piece)?;
            }
            each.push(t.elapsed().as_secs_f64() * 1e6 / n as f64);
            map_all(None)?;
            range.set_access(0, n * piece, &[])?;
            let t = Instant::now();
            let single = range.unmap(0, n * piece);
            let took = t.elapsed().as_secs_f64() * 1e6;
            match single {
                // Every piece maps again only if the one call unmapped all.
                Ok(()) => match map_all(None) {
                    Ok(()) => {
                        one.push(took);
                        for i in 0..n {
                            range.unmap(i * piece, piece)?;
                        }
                    }
                    Err(e) => {
                        refused = Some(format!("left pieces mapped: {e}"));
                        for i in 0..n {
                            // Whatever is still mapped goes; the rest errs.
                            let _ = range.unmap(i * piece, piece);
                        }
                        break;
                    }
                },
                Err(e) => {
                    refused = Some(format!("refused: {e}"));
                    for i in 0..n {
                        range.unmap(i * piece, piece)?;
                    }
                    break;
                }
            }
        }
        let one_call = match &refused {
            Some(why) => why.clone(),
            None => format!("{:>17.1} {:>14.1}", median(one.clone()), median(one) / n as f64),
        };
        println!(
            "{:>3} MiB {n:>6} {:>13.1} {:>13.1} {one_call} {:>14.1}",
            piece_mib,
            median(map),
            median(each),
            median(access)
        );
    }
    Ok(())
}

/// The third table (see the module docs): `n` pieces moved from the start
/// of `range` to its second half, all on one thread against the old
/// addresses unmapped by another thread after the new are mapped.
fn moves_behind(ctx: &std::sync::Arc<cudarc::driver::CudaContext>, range: &vmm::AddressRange) -> cumem::Result<()> {
    println!("a move of n pieces (median of {ROUNDS} rounds, microseconds for the whole move)");
    println!(
        "{:>7} {:>6} {:>14} {:>22} {:>18} {:>16} {:>22}",
        "piece", "pieces", "one thread", "map first: mover", "(both done)", "grant alone", "grant while unmapping"
    );
    let far = range.size() / 2;
    for (piece_mib, n) in [(32, 1), (32, 4), (32, 16), (32, 48)] {
        let piece = piece_mib << 20;
        let pieces: Vec<vmm::PhysicalChunk> =
            (0..n).map(|_| vmm::PhysicalChunk::create(ctx, piece)).collect::<cumem::Result<_>>()?;
        let place = |at: usize| place(range, at, &pieces);
        let unplace = |at: usize| unplace(range, at, n, piece);
        let (mut one, mut mover, mut both) = (Vec::new(), Vec::new(), Vec::new());
        let (mut granted, mut alone) = (Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            place(far)?;
            let g = Instant::now();
            range.set_access(far, n * piece, &[])?;
            alone.push(g.elapsed().as_secs_f64() * 1e6);
            unplace(far)?;
            place(0)?;
            let t = Instant::now();
            unplace(0)?;
            place(far)?;
            one.push(t.elapsed().as_secs_f64() * 1e6);
            unplace(far)?;
            place(0)?;
            let t = Instant::now();
            let moved = std::thread::scope(|s| {
                place(far)?;
                let moved = t.elapsed().as_secs_f64() * 1e6;
                let behind = s.spawn(|| {
                    ctx.bind_to_thread().map_err(driver("cuCtxSetCurrent"))?;
                    unplace(0)
                });
                // The mover's next move meanwhile: the same pieces granted
                // again where they are (what a later map pays).
                let g = Instant::now();
                range.set_access(far, n * piece, &[])?;
                granted.push(g.elapsed().as_secs_f64() * 1e6);
                behind.join().map_err(|_| Error::InvalidState("unmapping thread panicked".into()))??;
                Ok::<f64, Error>(moved)
            })?;
            mover.push(moved);
            both.push(t.elapsed().as_secs_f64() * 1e6);
            unplace(far)?;
        }
        println!(
            "{:>3} MiB {n:>6} {:>14.1} {:>22.1} {:>18.1} {:>16.1} {:>22.1}",
            piece_mib,
            median(one),
            median(mover),
            median(both),
            median(alone),
            median(granted)
        );
    }
    Ok(())
}

/// The fourth table (see the module docs): a map and grant of `n` pieces
/// at the middle of `range`, alone and while another thread unmaps `n`
/// pieces at its start.
fn side_by_side(ctx: &std::sync::Arc<cudarc::driver::CudaContext>, range: &vmm::AddressRange) -> cumem::Result<()> {
    println!("a map and grant of n pieces beside a second thread's unmaps (median of {ROUNDS} rounds, microseconds)");
    println!("{:>7} {:>6} {:>10} {:>22}", "piece", "pieces", "alone", "while n are unmapped");
    let there = range.size() / 2;
    for (piece_mib, n) in [(32, 4), (32, 16), (32, 48)] {
        let piece = piece_mib << 20;
        let make = || -> cumem::Result<Vec<vmm::PhysicalChunk>> {
            (0..n).map(|_| vmm::PhysicalChunk::create(ctx, piece)).collect()
        };
        let (old, new) = (make()?, make()?);
        let place = |at: usize, pieces: &[vmm::PhysicalChunk]| place(range, at, pieces);
        let unplace = |at: usize| unplace(range, at, n, piece);
        let (mut alone, mut beside) = (Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            let t = Instant::now();
            place(there, &new)?;
            alone.push(t.elapsed().as_secs_f64() * 1e6);
            unplace(there)?;
            place(0, &old)?;
            let go = std::sync::Barrier::new(2);
            let took = std::thread::scope(|s| {
                let behind = s.spawn(|| {
                    ctx.bind_to_thread().map_err(driver("cuCtxSetCurrent"))?;
                    go.wait();
                    unplace(0)
                });
                go.wait();
                let t = Instant::now();
                place(there, &new)?;
                let took = t.elapsed().as_secs_f64() * 1e6;
                behind.join().map_err(|_| Error::InvalidState("unmapping thread panicked".into()))??;
                Ok::<f64, Error>(took)
            })?;
            beside.push(took);
            unplace(there)?;
        }
        println!("{:>3} MiB {n:>6} {:>10.1} {:>22.1}", piece_mib, median(alone), median(beside));
    }
    Ok(())
}

/// Maps `pieces` (of one size) side by side at `at` and grants the run.
fn place(range: &vmm::AddressRange, at: usize, pieces: &[vmm::PhysicalChunk]) -> cumem::Result<()> {
    let mut end = at;
    for c in pieces {
        range.map(end, c)?;
        end += c.size();
    }
    range.set_access(at, end - at, &[])
}

/// Unmaps `n` pieces of `piece` bytes side by side at `at`, one call each.
fn unplace(range: &vmm::AddressRange, at: usize, n: usize, piece: usize) -> cumem::Result<()> {
    for i in 0..n {
        range.unmap(at + i * piece, piece)?;
    }
    Ok(())
}
