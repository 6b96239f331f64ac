//! What growing device memory costs, by size: `cuMemCreate`, `cuMemMap`
//! and `cuMemSetAccess` (how the expandable pool grows) against
//! `cuMemAlloc` (how a chunked pool grows), in one run; and cumem's own
//! mapping path as a program meets it (`cumem map`:
//! `GrowableBuffer::with_capacity_on` on device 0: reserve, create, map,
//! grant), so builds of the library can be compared. The replay's cold
//! figures are mostly these costs.
//!
//! Prints the median of several rounds per size, in µs; without a GPU, why.

use std::time::Instant;

use cudarc::driver::result;
use cumem::cuda::{device_context, driver_status, vmm};
use cumem::{Error, GrowableBuffer, VmBackend};

const SIZES_MIB: [usize; 6] = [2, 8, 32, 128, 512, 2048];
const ROUNDS: usize = 7;

/// Microseconds since `t`.
fn us(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e6
}

fn main() -> cumem::Result<()> {
    if driver_status().devices() == 0 {
        println!("vmm: no GPU; nothing measured");
        return Ok(());
    }
    let ctx = device_context(0)?.expect("a device");
    let bind = || ctx.bind_to_thread().map_err(|e| Error::InvalidState(format!("cuCtxSetCurrent: {e}")));
    bind()?;
    if !vmm::vmm_supported(&ctx)? {
        println!("vmm: device 0 has no virtual memory management; nothing measured");
        return Ok(());
    }
    let range = vmm::AddressRange::reserve(&ctx, 4 << 30, 0)?;
    println!("vmm growth costs (median of {ROUNDS} rounds, microseconds)");
    println!(
        "{:>9} {:>11} {:>9} {:>14} {:>10} {:>9} {:>11} {:>9} {:>10}",
        "size", "cuMemCreate", "cuMemMap", "cuMemSetAccess", "vmm total", "GB/s", "cuMemAlloc", "GB/s", "cumem map"
    );
    for mib in SIZES_MIB {
        let size = mib << 20;
        let mut times = [(); 5].map(|_| Vec::new());
        for _ in 0..ROUNDS {
            let t = Instant::now();
            drop(GrowableBuffer::<u8>::with_capacity_on(VmBackend::Cuda(0), size)?);
            times[4].push(us(t));
            bind()?;
            let t = Instant::now();
            let chunk = vmm::PhysicalChunk::create(&ctx, size)?;
            times[0].push(us(t));
            let t = Instant::now();
            range.map(0, &chunk)?;
            times[1].push(us(t));
            let t = Instant::now();
            range.set_access(0, size, &[])?;
            times[2].push(us(t));
            range.unmap(0, size)?;
            drop(chunk);
            let t = Instant::now();
            // SAFETY: the context is current; the memory is freed, untouched.
            let p =
                unsafe { result::malloc_sync(size) }.map_err(|e| Error::InvalidState(format!("cuMemAlloc: {e}")))?;
            times[3].push(us(t));
            // SAFETY: `p` came from cuMemAlloc just now and is freed once.
            unsafe { result::free_sync(p) }.map_err(|e| Error::InvalidState(format!("cuMemFree: {e}")))?;
        }
        let [create, map, access, alloc, cumem] = times.map(|mut v| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        });
        let total = create + map + access;
        let gbs = |us: f64| size as f64 / (us * 1e3);
        println!(
            "{mib:>5} MiB {create:>11.1} {map:>9.1} {access:>14.1} {total:>10.1} {:>9.1} {alloc:>11.1} {:>9.1} {cumem:>10.1}",
            gbs(total),
            gbs(alloc)
        );
    }
    Ok(())
}
