//! Expandable segments: a pool over HostExpandable / CudaVmm grows by
//! extending its chunk, so new memory coalesces with the old tail; shrink
//! and deallocation unmap exactly what was mapped.

use cumem::pool::{Pool, PoolConfig, StreamTag};
use cumem::upstream::{Chunk, CudaVmm, HostExpandable, Upstream};
use cumem::{Error, PoolKind};

const MIB: usize = 1 << 20;

/// Thread caches off: these tests look at how freed blocks coalesce in the
/// shared pool, which parked (cached) blocks would hide.
fn config() -> PoolConfig {
    let mut c = PoolConfig::new(PoolKind::Standalone);
    c.thread_cache = false;
    c
}

#[test]
fn host_upstream_extend_shrink_deallocate() {
    let up = HostExpandable::new(256 * MIB).unwrap();
    let g = up.granularity();
    assert!(g >= 4096 && g.is_power_of_two());
    let a = up.allocate_chunk(3 * g).unwrap();
    assert_eq!(a.addr, up.base());
    assert_eq!(a.addr % 256, 0);
    // The chunk is committed memory: write it all.
    // SAFETY: the chunk is committed read-write host memory of 3 pages that
    // nothing else uses.
    unsafe { std::ptr::write_bytes(a.addr as *mut u8, 0xAB, a.size) };
    assert!(up.try_extend(a, 2 * g).unwrap());
    let a = Chunk { addr: a.addr, size: a.size + 2 * g };
    // SAFETY: the extension is committed too; the old bytes are intact.
    unsafe {
        std::ptr::write_bytes((a.addr + 3 * g) as *mut u8, 0xCD, 2 * g);
        assert_eq!(*(a.addr as *const u8), 0xAB);
        assert_eq!(*((a.end() - 1) as *const u8), 0xCD);
    }
    assert_eq!(up.mapped(), 5 * g);
    // Extending a chunk whose tail is taken fails softly.
    let b = up.allocate_chunk(g).unwrap();
    assert_eq!(b.addr, a.end());
    assert!(!up.try_extend(a, g).unwrap());
    assert!(!up.try_extend(a, g / 2).unwrap(), "extra must be a multiple of the granularity");
    // Shrink gives back exactly the pieces mapped by the extension; a cut
    // through a piece is refused.
    assert!(!up.try_shrink(a, g).unwrap());
    assert!(up.try_shrink(a, 2 * g).unwrap());
    let a = Chunk { addr: a.addr, size: 3 * g };
    assert_eq!(up.mapped(), 4 * g);
    up.deallocate_chunk(b).unwrap();
    assert!(matches!(up.deallocate_chunk(b), Err(Error::InvalidState(_))), "double deallocation");
    up.deallocate_chunk(a).unwrap();
    assert_eq!(up.mapped(), 0);
    // Unknown chunks are errors, not crashes.
    assert!(up.deallocate_chunk(Chunk { addr: 4096, size: g }).is_err());
    assert!(matches!(up.allocate_chunk(0), Err(Error::InvalidSize { .. })));
    assert!(matches!(up.allocate_chunk(512 * MIB), Err(Error::OutOfMemory { .. })));
}

#[test]
fn host_upstream_reuses_holes() {
    let up = HostExpandable::new(8 * 4096).unwrap();
    let g = up.granularity();
    let reserved = up.reserved();
    let chunks: Vec<Chunk> = (0..reserved / g).map(|_| up.allocate_chunk(g).unwrap()).collect();
    assert!(up.allocate_chunk(g).is_err(), "the reservation is full");
    up.deallocate_chunk(chunks[1]).unwrap();
    assert_eq!(up.allocate_chunk(g).unwrap(), chunks[1], "the hole is reused");
}

#[test]
fn host_pool_grows_as_one_chunk() {
    let pool = Pool::new(HostExpandable::new(4096 * MIB).unwrap(), config());
    let mut blocks = Vec::new();
    for i in 0..40usize {
        let size = (i + 1) * 3 * MIB + 256 * i;
        let a = pool.allocate(size, 256).unwrap();
        // SAFETY: the block is committed host memory of `a.size` bytes that
        // the pool handed to this test alone; both ends are written.
        unsafe {
            std::ptr::write_bytes(a.addr as *mut u8, i as u8, 4096);
            std::ptr::write_bytes((a.addr + a.size - 4096) as *mut u8, i as u8, 4096);
        }
        blocks.push((a, i as u8));
        let s = pool.stats();
        assert_eq!(s.chunks, 1, "after {} growths the pool holds {} chunks", i + 1, s.chunks);
    }
    for (a, byte) in &blocks {
        // SAFETY: still live blocks, written above.
        unsafe {
            assert_eq!(*(a.addr as *const u8), *byte);
            assert_eq!(*((a.addr + a.size - 1) as *const u8), *byte);
        }
    }
    let reserved = pool.stats().reserved;
    assert_eq!(pool.upstream().mapped(), reserved);
    for (a, _) in blocks {
        pool.deallocate(a.addr, StreamTag::NONE).unwrap();
    }
    let s = pool.stats();
    assert_eq!((s.chunks, s.free_blocks, s.largest_free), (1, 1, reserved), "everything coalesced");
    assert_eq!(pool.release_cached().unwrap(), reserved);
    assert_eq!(pool.upstream().mapped(), 0);
    // The pool starts over in the same reservation.
    let a = pool.allocate(5 * MIB, 256).unwrap();
    assert_eq!(a.addr, pool.upstream().base());
    pool.deallocate(a.addr, StreamTag::NONE).unwrap();
}

#[test]
fn host_upstream_is_shared_across_threads() {
    let pool = std::sync::Arc::new(Pool::new(HostExpandable::new(2048 * MIB).unwrap(), config()));
    let handles: Vec<_> = (0..4)
        .map(|t| {
            let pool = pool.clone();
            std::thread::spawn(move || {
                for i in 0..50 {
                    let a = pool.allocate((t + 1) * MIB + i * 4096, 256).unwrap();
                    // SAFETY: the block is committed host memory the pool
                    // handed to this thread alone.
                    unsafe { std::ptr::write_bytes(a.addr as *mut u8, t as u8, 4096) };
                    pool.deallocate(a.addr, StreamTag::NONE).unwrap();
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(pool.stats().in_use, 0);
    pool.release_cached().unwrap();
    assert_eq!(pool.upstream().mapped(), 0);
}

#[test]
fn cuda_vmm_needs_a_gpu_here() {
    if cumem::device::driver_status().devices() == 0 {
        assert!(matches!(CudaVmm::new(0), Err(Error::NeedsGpu(_))));
    }
}

#[test]
fn gpu_pool_over_cuda_vmm_grows_as_one_chunk() {
    let Some(ctx) = cumem::device::gpu_for_test("gpu_pool_over_cuda_vmm_grows_as_one_chunk") else { return };
    let up = CudaVmm::new(ctx.ordinal()).unwrap();
    assert_eq!(up.granularity() % (2 * MIB), 0);
    println!("reserved {} B at {:#x}, granularity {} B", up.reserved(), up.base(), up.granularity());
    let pool = Pool::new(up, PoolConfig::new(PoolKind::Device));
    let mut blocks = Vec::new();
    for i in 0..24usize {
        let size = (i + 1) * 5 * MIB + 256;
        let a = pool.allocate(size, 256).unwrap();
        // Each block is real device memory: write and read back its ends.
        let bytes = vec![i as u8; 4096];
        let mut back = vec![0u8; 4096];
        ctx.bind_to_thread().unwrap();
        for at in [a.addr, a.addr + a.size - 4096] {
            // SAFETY: the span lies in a live block of mapped device memory;
            // the host slices are live and as long as the copies.
            unsafe {
                cudarc::driver::sys::cuMemcpyHtoD_v2(at as u64, bytes.as_ptr().cast(), 4096).result().unwrap();
                cudarc::driver::sys::cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), at as u64, 4096).result().unwrap();
            }
            assert_eq!(back, bytes);
        }
        blocks.push(a);
        assert_eq!(pool.stats().chunks, 1, "growth {i} added a chunk");
    }
    let reserved = pool.stats().reserved;
    assert_eq!(pool.upstream().mapped(), reserved);
    for a in blocks {
        pool.deallocate(a.addr, StreamTag::NONE).unwrap();
    }
    // Blocks up to 64 MiB went to this thread's cache: flush it, and every
    // block is back in the one chunk.
    cumem::pool::release_thread_caches();
    assert_eq!(pool.stats().largest_free, reserved);
    assert_eq!(pool.release_cached().unwrap(), reserved);
    assert_eq!(pool.upstream().mapped(), 0);
    // Shrinking an extended chunk directly on the upstream.
    let up = pool.upstream();
    let g = up.granularity();
    let c = up.allocate_chunk(2 * g).unwrap();
    assert!(up.try_extend(c, 3 * g).unwrap());
    let c = Chunk { addr: c.addr, size: 5 * g };
    assert!(up.try_shrink(c, 3 * g).unwrap());
    up.deallocate_chunk(Chunk { addr: c.addr, size: 2 * g }).unwrap();
    assert_eq!(up.mapped(), 0);
}

#[test]
fn remap_pieces_grow_with_the_pool_and_shrink_with_the_free_device() {
    use cumem::upstream::{remap_piece, PRESSED_PIECE, REMAP_PIECE};
    const GIB: usize = 1 << 30;
    let roomy = usize::MAX;
    // A 32nd of what is mapped, from 8 MiB up to the 32 MiB ceiling.
    assert_eq!(remap_piece(0, roomy), REMAP_PIECE);
    assert_eq!(remap_piece(512 * MIB, roomy), 16 * MIB);
    assert_eq!(remap_piece(64 * GIB, roomy), 32 * MIB);
    // A 512th of the device's free memory, a power of two, down to 2 MiB.
    assert_eq!(remap_piece(64 * GIB, 16 * GIB), 32 * MIB);
    assert_eq!(remap_piece(64 * GIB, 12 * GIB), 16 * MIB);
    assert_eq!(remap_piece(64 * GIB, 4 * GIB), 8 * MIB);
    assert_eq!(remap_piece(64 * GIB, GIB), PRESSED_PIECE);
    assert_eq!(remap_piece(64 * GIB, 0), PRESSED_PIECE);
    assert_eq!(remap_piece(0, 2 * GIB), 4 * MIB);
}
