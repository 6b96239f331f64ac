//! GPU test: near a full device, new memory comes in small pieces
//! (`upstream::remap_piece`). A pool over CUDA VMM maps a new block's pages
//! in pieces of 8 MiB on a roomy device (a new pool's first pieces), and in
//! pieces of 2 MiB once a ballast leaves about 1 GiB free. A binary of its
//! own: the ballast fills the device, which would fail GPU tests running
//! beside it. Skips with a printed reason without a GPU; fails instead
//! under `CUMEM_REQUIRE_GPU=1`.

use cumem::device::gpu_for_test;
use cumem::pool::{Pool, PoolConfig, StreamTag};
use cumem::upstream::{CudaVmm, Upstream, PRESSED_PIECE, REMAP_PIECE};
use cumem::PoolKind;

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

/// The sizes of the pieces a fresh pool maps for one block of `size`
/// bytes on device `ordinal`.
fn pieces_of_a_block(ordinal: usize, size: usize) -> Vec<usize> {
    let vmm = CudaVmm::with_reservation(ordinal, GIB).expect("a VMM reservation");
    let mut pc = PoolConfig::new(PoolKind::Device);
    pc.thread_cache = false;
    let pool = Pool::new(vmm, pc);
    let a = pool.allocate(size, 256).expect("the block");
    let pieces = pool.upstream().mapped_pieces(a.addr, size).expect("a remapping upstream lists its pieces");
    pool.deallocate(a.addr, StreamTag::NONE).expect("the block goes back");
    pieces.iter().map(|p| p.size).collect()
}

#[test]
fn new_pieces_shrink_near_a_full_device() {
    let Some(ctx) = gpu_for_test("new_pieces_shrink_near_a_full_device") else { return };
    ctx.bind_to_thread().expect("the context binds");
    let (free, _) = cumem::cuda::vmm::memory_info(&ctx).expect("the device's free memory");
    assert!(free > 6 * GIB, "the test needs 6 GiB free, the device has {} MiB", free / MIB);
    let roomy = pieces_of_a_block(ctx.ordinal(), 64 * MIB);
    assert!(roomy.iter().all(|&s| s == REMAP_PIECE), "roomy device: pieces {roomy:?}");

    // Leave about 1 GiB free: a 512th of it is 2 MiB.
    let ballast_bytes = (free - GIB) / (2 * MIB) * (2 * MIB);
    // SAFETY: a plain device allocation on the bound context, freed below
    // and never touched from the host.
    let ballast = unsafe { cudarc::driver::result::malloc_sync(ballast_bytes) }.expect("the ballast");
    let pressed = pieces_of_a_block(ctx.ordinal(), 64 * MIB);
    let (left, _) = cumem::cuda::vmm::memory_info(&ctx).expect("the device's free memory");
    // SAFETY: allocated above by `malloc_sync`, freed once.
    unsafe { cudarc::driver::result::free_sync(ballast) }.expect("the ballast goes back");
    println!("roomy: {roomy:?}; with {} MiB left free: {pressed:?}", left / MIB);
    assert_eq!(pressed.iter().sum::<usize>(), 64 * MIB, "the block's pages are mapped");
    assert!(pressed.iter().all(|&s| s == PRESSED_PIECE), "near a full device: pieces {pressed:?}");
}
