//! GPU variant of `tests/host/unmapped_pages.rs`: a large request never
//! lands on device pages with nothing mapped, with the library's default
//! configuration, in the layout that broke per-thread shards (removed
//! since; the test failed on every layout with them).
//!
//! Each layout: this thread allocates a small block (and, in the second
//! layout, holds 600 MiB, so the region maps pieces of 32 MiB); another
//! thread allocates a small block and one 16 MiB larger than the
//! request, frees both on the shared stream and ends (or waits); this
//! thread then asks for the request, 66 to 200 MiB. With shards, the
//! other thread's shard handed over the top 64 MiB (or more) of its
//! mapped span, joined with this shard's new chunk of unmapped address
//! space above it, and the request was placed at its start.
//!
//! Two oracles: the driver says whether each 2 MiB granule of the block
//! has memory mapped (`cuMemRetainAllocationHandle`; a block that fails
//! is reported and left untouched, so the context stays usable), and a
//! kernel writes a pattern unique to the block into every byte of every
//! live block and another checks every byte, counting mismatches on the
//! device; a write to an unmapped page faults, and the stream's sync
//! fails. Skips without a GPU; fails instead under `CUMEM_REQUIRE_GPU=1`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};

use cudarc::driver::{sys, CudaContext, PushKernelArg};
use cumem::device::gpu_for_test;
use cumem::{Config, MemoryManager, Stream};

use super::gpu_training_threads::{grid, kernels, Kernels};

const MIB: usize = 1 << 20;

/// The VMM granularity of the device pool's pieces (a piece is a multiple
/// of it and starts on it).
const GRANULE: usize = 2 * MIB;

/// The requests: above the 64 MiB range a hand-over prefers.
const REQUESTS: [usize; 5] = [66 * MIB, 72 * MIB, 96 * MIB, 130 * MIB, 200 * MIB];

/// What this thread holds throughout in the second layout (above 512 MiB
/// mapped, the region maps pieces of 32 MiB).
const BALLAST: usize = 600 * MIB;

/// How much larger than the request the other thread's block is (with
/// shards, one in use gave only what it held above what its live blocks
/// touched).
const GROW_ABOVE: usize = 16 * MIB;

/// Whether the driver has memory mapped at `addr`.
fn mapped_at(addr: u64) -> bool {
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: `handle` is a valid out-pointer; the driver only looks the
    // address up (device memory is never dereferenced on the host).
    let r = unsafe { sys::cuMemRetainAllocationHandle(&mut handle, addr as *mut _) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return false;
    }
    // SAFETY: the retain above took one reference, given back here.
    unsafe { sys::cuMemRelease(handle) }.result().unwrap();
    true
}

/// The bytes of `[ptr, ptr + size)` on granules with nothing mapped.
fn unmapped_bytes(ptr: u64, size: usize) -> usize {
    let mut missing = 0;
    let mut off = 0;
    while off < size {
        let step = (GRANULE - (ptr as usize + off) % GRANULE).min(size - off);
        if !mapped_at(ptr + off as u64) {
            missing += step;
        }
        off += step;
    }
    missing
}

/// What every layout shares: the kernels, a device counter of mismatched
/// bytes, and whether the driver's look at mappings works here.
struct Gpu {
    cu: Arc<CudaContext>,
    k: Kernels,
    errors: u64,
    next_id: AtomicU64,
    driver_look: std::sync::OnceLock<bool>,
}

/// A live block and the id its pattern is made of.
struct Live {
    ptr: u64,
    size: usize,
    id: u64,
}

impl Gpu {
    fn new(cu: Arc<CudaContext>) -> Self {
        let k = kernels(&cu);
        let mut errors = 0u64;
        // SAFETY: `errors` receives a new device pointer to 8 bytes.
        unsafe { sys::cuMemAlloc_v2(&mut errors, 8) }.result().unwrap();
        // SAFETY: `errors` points at 8 device bytes.
        unsafe { sys::cuMemsetD8_v2(errors, 0, 8) }.result().unwrap();
        Gpu { cu, k, errors, next_id: AtomicU64::new(1), driver_look: std::sync::OnceLock::new() }
    }

    /// The block's bytes on unmapped granules, per the driver (0 where the
    /// driver can't say: the kernels are the oracle then).
    fn unmapped(&self, b: &Live) -> usize {
        if self.driver_look.get() != Some(&true) {
            return 0;
        }
        unmapped_bytes(b.ptr, b.size)
    }

    /// Writes the block's pattern into every byte.
    fn fill(&self, stream: &Stream, b: &Live) {
        let n = b.size as u64;
        let mut l = stream.cudarc().unwrap().launch_builder(&self.k.fill);
        l.arg(&b.ptr).arg(&b.id).arg(&n);
        // SAFETY: the arguments match the kernel; `ptr` holds `size` bytes
        // and stays live until it is freed on the same stream, after the
        // kernels that use it.
        unsafe { l.launch(grid(n)) }.unwrap();
    }

    /// Counts the bytes that lost the block's pattern.
    fn check(&self, stream: &Stream, b: &Live) {
        let n = b.size as u64;
        let mut l = stream.cudarc().unwrap().launch_builder(&self.k.check);
        l.arg(&b.ptr).arg(&b.id).arg(&n).arg(&self.errors);
        // SAFETY: as in `fill`; `errors` is a live 8-byte device counter.
        unsafe { l.launch(grid(n)) }.unwrap();
    }

    /// A block of `size` bytes on `stream`, filled with its pattern.
    fn alloc(&self, mm: &MemoryManager, stream: &Stream, size: usize) -> Live {
        let ptr = mm.allocate_device_on(size, stream).unwrap();
        let b = Live { ptr, size, id: self.next_id.fetch_add(1, Ordering::Relaxed) };
        // The first block says whether the driver's look works here (the
        // device pool maps it with the VMM calls).
        let missing = unmapped_bytes(b.ptr, b.size);
        let look = *self.driver_look.get_or_init(|| {
            if missing > 0 {
                eprintln!("the driver's look at mappings fails on a fresh block: the kernels alone check");
            }
            missing == 0
        });
        assert!(!look || missing == 0, "a block the test did not aim at lies on unmapped pages");
        self.fill(stream, &b);
        b
    }

    /// Checks the block and frees it on `stream`.
    fn free(&self, mm: &MemoryManager, stream: &Stream, b: Live) {
        self.check(stream, &b);
        mm.free_device_on(b.ptr, stream).unwrap();
    }

    /// The mismatched bytes counted so far (syncs the context).
    fn mismatches(&self) -> u64 {
        self.cu.synchronize().expect("no kernel faulted on a block the pool left unmapped");
        let mut bad = 0u64;
        // SAFETY: `bad` is 8 host bytes; `errors` 8 device bytes, whose
        // writers were synchronised above.
        unsafe { sys::cuMemcpyDtoH_v2((&mut bad as *mut u64).cast(), self.errors, 8) }.result().unwrap();
        bad
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // SAFETY: `errors` came from cuMemAlloc and is no longer used.
        let _ = unsafe { sys::cuMemFree_v2(self.errors) };
    }
}

/// How the other thread goes on after it freed its blocks.
#[derive(Clone, Copy, Debug)]
enum Giver {
    /// It flushes its thread caches and ends.
    Gone,
    /// It stays until the request is served.
    Waiting,
}

/// One layout (see the module docs) with `config`; `Err` says what of the
/// request's block lay on unmapped pages (the block then stays untouched).
fn scenario(g: &Gpu, config: Config, ballast: usize, request: usize, giver: Giver) -> Result<(), String> {
    let mm = MemoryManager::new(config).unwrap();
    let stream = Stream::new().unwrap();
    let first = g.alloc(&mm, &stream, 1 << 20);
    let ballast = (ballast > 0).then(|| g.alloc(&mm, &stream, ballast));
    let (ready_tx, ready) = mpsc::channel::<()>();
    let (done, done_rx) = mpsc::channel::<()>();
    let big = std::thread::scope(|s| {
        let (mm, stream) = (&mm, &stream);
        let other = s.spawn(move || {
            g.cu.bind_to_thread().unwrap();
            // A small block first, freed last (the block freed last stays
            // out of the free index until the pool's next operation).
            let small = g.alloc(mm, stream, 2 * MIB);
            let b = g.alloc(mm, stream, request + GROW_ABOVE);
            g.free(mm, stream, b);
            g.free(mm, stream, small);
            if let Giver::Gone = giver {
                cumem::pool::release_thread_caches();
                return;
            }
            ready_tx.send(()).unwrap();
            let _ = done_rx.recv();
        });
        if let Giver::Gone = giver {
            other.join().unwrap();
        } else {
            ready.recv().expect("the other thread freed its blocks");
        }
        // As with shards: past their pause of asks after one that found
        // nothing (1 ms) and their reuse of a look at each other (100 µs).
        std::thread::sleep(std::time::Duration::from_millis(3));
        let big = mm.allocate_device_on(request, stream);
        drop(done);
        big.unwrap()
    });
    let big = Live { ptr: big, size: request, id: g.next_id.fetch_add(1, Ordering::Relaxed) };
    let missing = g.unmapped(&big);
    eprintln!(
        "{giver:?}, ballast {} MiB, request {} MiB: {} MiB unmapped",
        ballast.as_ref().map_or(0, |b| b.size / MIB),
        request / MIB,
        missing / MIB
    );
    let outcome = if missing == 0 {
        g.fill(&stream, &big);
        g.free(&mm, &stream, big);
        Ok(())
    } else {
        mm.free_device_on(big.ptr, &stream).unwrap();
        Err(format!(
            "{:.1} MiB of the {} MiB block at {:#x} lie on granules with nothing mapped",
            missing as f64 / MIB as f64,
            request / MIB,
            big.ptr
        ))
    };
    if let Some(b) = ballast {
        g.free(&mm, &stream, b);
    }
    g.free(&mm, &stream, first);
    stream.synchronize().expect("no kernel faulted on a block the pool left unmapped");
    outcome
}

/// Every layout with `config`; the failures, one line each.
fn run_all(g: &Gpu, config: &Config) -> Vec<String> {
    let mut failures = Vec::new();
    for ballast in [0, BALLAST] {
        for giver in [Giver::Gone, Giver::Waiting] {
            for request in REQUESTS {
                let what = format!("{giver:?}, ballast {} MiB, request {} MiB", ballast / MIB, request / MIB);
                if let Err(e) = scenario(g, config.clone(), ballast, request, giver) {
                    failures.push(format!("{what}: {e}"));
                }
            }
        }
    }
    let bad = g.mismatches();
    if bad > 0 {
        failures.push(format!("{bad} bytes of live blocks lost their patterns"));
    }
    failures
}

/// With the library's defaults, a request larger than the range a
/// hand-over between shards preferred lies wholly on mapped pages, and
/// every byte of every live block keeps its pattern.
#[test]
fn a_large_request_never_lands_on_unmapped_device_pages() {
    let Some(cu) = gpu_for_test("gpu_unmapped_pages::a_large_request_never_lands_on_unmapped_device_pages") else {
        return;
    };
    cu.bind_to_thread().unwrap();
    let g = Gpu::new(cu);
    let failures = run_all(&g, &Config::new());
    assert!(failures.is_empty(), "blocks on unmapped pages:\n{}", failures.join("\n"));
}

/// The control of the oracle: a granule of a reservation with nothing
/// mapped reads as unmapped, and one with memory mapped as mapped.
#[test]
fn the_driver_oracle_sees_an_unmapped_granule() {
    let Some(cu) = gpu_for_test("gpu_unmapped_pages::the_driver_oracle_sees_an_unmapped_granule") else {
        return;
    };
    cu.bind_to_thread().unwrap();
    let mut va: sys::CUdeviceptr = 0;
    // SAFETY: `va` is a valid out-pointer; a reservation of two granules
    // with no memory mapped.
    unsafe { sys::cuMemAddressReserve(&mut va, 2 * GRANULE, 0, 0, 0) }.result().unwrap();
    assert!(!mapped_at(va) && !mapped_at(va + GRANULE as u64), "a reservation with nothing mapped reads as mapped");
    let mm = MemoryManager::new(Config::new()).unwrap();
    let p = mm.allocate_device(GRANULE).unwrap();
    assert!(mapped_at(p), "a live block of the pool reads as unmapped");
    mm.free_device(p).unwrap();
    // SAFETY: the reservation above, with nothing mapped in it.
    unsafe { sys::cuMemAddressFree(va, 2 * GRANULE) }.result().unwrap();
}
