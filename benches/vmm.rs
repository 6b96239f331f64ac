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
//! Prints the median of several rounds per size, in microseconds. Without a
//! GPU it says so and measures nothing.

use std::time::Instant;

use cudarc::driver::result;
use cumem::cuda::{device_context, driver_status, vmm};
use cumem::Error;

fn driver(call: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| Error::InvalidState(format!("{call}: {e}"))
}

const SIZES_MIB: [usize; 6] = [2, 8, 32, 128, 512, 2048];
const ROUNDS: usize = 7;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
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
    println!("vmm growth costs (median of {ROUNDS} rounds, microseconds)");
    println!(
        "{:>9} {:>11} {:>12} {:>9} {:>13} {:>10} {:>9} {:>11} {:>10}",
        "size", "cuMemCreate", "(no fd type)", "cuMemMap", "cuMemSetAccess", "vmm total", "GB/s", "cuMemAlloc", "GB/s"
    );
    for mib in SIZES_MIB {
        let size = mib << 20;
        let (mut create, mut map, mut access, mut alloc) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut plain = Vec::new();
        for _ in 0..ROUNDS {
            let t = Instant::now();
            drop(vmm::PhysicalChunk::create_with(&ctx, size, false)?);
            plain.push(t.elapsed().as_secs_f64() * 1e6);
            let t = Instant::now();
            let chunk = vmm::PhysicalChunk::create(&ctx, size)?;
            create.push(t.elapsed().as_secs_f64() * 1e6);
            let t = Instant::now();
            range.map(0, &chunk)?;
            map.push(t.elapsed().as_secs_f64() * 1e6);
            let t = Instant::now();
            range.set_access(0, size, &[])?;
            access.push(t.elapsed().as_secs_f64() * 1e6);
            range.unmap(0, size)?;
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
        let np = median(plain);
        let total = c + m + a;
        let gbs = |us: f64| size as f64 / (us * 1e3);
        println!(
            "{:>5} MiB {c:>11.1} {np:>12.1} {m:>9.1} {a:>13.1} {total:>10.1} {:>9.1} {al:>11.1} {:>10.1}",
            mib,
            gbs(total),
            gbs(al)
        );
    }
    Ok(())
}
