//! What growing device memory costs, by size: `cuMemCreate`, `cuMemMap`
//! and `cuMemSetAccess` (how the expandable pool grows) against
//! `cuMemAlloc` (how a chunked pool grows), in one run. The replay's cold
//! figures are mostly these costs; the growth policy rests on whether they
//! are per call or per byte.
//!
//! `cuMemCreate` is timed both ways: memory exportable to other processes
//! (a POSIX file descriptor handle type, what cumem makes where the device
//! supports it) and not.
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
        "{:>9} {:>11} {:>12} {:>9} {:>13} {:>10} {:>10} {:>10} {:>9} {:>11} {:>10} {:>10}",
        "size",
        "cuMemCreate",
        "(no fd type)",
        "cuMemMap",
        "cuMemSetAccess",
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
        for _ in 0..ROUNDS {
            let t = Instant::now();
            let buf = GrowableBuffer::<u8>::with_capacity_on(VmBackend::Cuda(0), size)?;
            cumem_map.push(t.elapsed().as_secs_f64() * 1e6);
            drop(buf);
            ctx.bind_to_thread().map_err(driver("cuCtxSetCurrent"))?;
            let t = Instant::now();
            drop(vmm::PhysicalChunk::create_with(ctx, size, false)?);
            plain.push(t.elapsed().as_secs_f64() * 1e6);
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
        let total = c + m + a;
        let gbs = |us: f64| size as f64 / (us * 1e3);
        println!(
            "{:>5} MiB {c:>11.1} {np:>12.1} {m:>9.1} {a:>13.1} {ap:>10.1} {ag:>10.1} {total:>10.1} {:>9.1} {al:>11.1} {:>10.1} {cm:>10.1}",
            mib,
            gbs(total),
            gbs(al)
        );
    }
    Ok(())
}
