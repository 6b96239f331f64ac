//! `ManagedAlloc`: collections in managed memory, its bad inputs (errors,
//! never aborts, the pool intact), and on the GPU a vector written by the
//! host, changed by a kernel and checked on the host. Sizes stay small:
//! no test asks for more managed memory than a device has free.

use std::alloc::Layout;

use allocator_api2::alloc::Allocator;
use cudarc::driver::{LaunchConfig, PushKernelArg};
use cumem::device::gpu_for_test;
use cumem::managed::{advise, prefetch, Advice, Location, ManagedAlloc, ManagedBox, ManagedVec};
use cumem::{Error, MemoryManager, PoolKind, Stream};

fn still_works(mm: &MemoryManager) {
    let p = mm.allocate_managed(1000).expect("the managed pool still serves");
    mm.free_managed(p.as_ptr()).expect("and frees");
    mm.managed_pool().unwrap().with_fit(|f| f.check_invariants()).expect("managed pool intact");
}

#[test]
fn vectors_boxes_and_maps_in_managed_memory() {
    let mut v: ManagedVec<u64> = ManagedVec::new_in(ManagedAlloc);
    for i in 0..50_000u64 {
        v.push(i * 3);
    }
    assert_eq!(v.as_ptr() as usize % 256, 0);
    v.truncate(1000);
    v.shrink_to_fit();
    v.reserve(100_000);
    assert!(v.iter().enumerate().all(|(i, x)| *x == i as u64 * 3));
    let b: ManagedBox<[u8; 4096]> = ManagedBox::new_in([9; 4096], ManagedAlloc);
    assert!(b.iter().all(|x| *x == 9));
    let mut m: hashbrown::HashMap<u32, u32, hashbrown::DefaultHashBuilder, ManagedAlloc> =
        hashbrown::HashMap::with_hasher_in(Default::default(), ManagedAlloc);
    m.extend((0..10_000).map(|i| (i, i + 1)));
    assert_eq!(m[&777], 778);
    let stats = MemoryManager::global().unwrap().managed_stats().expect("the pool exists after use");
    assert!(stats.reserved > 0);
    assert!(MemoryManager::global().unwrap().memory_summary().contains("| managed"));
}

#[test]
fn zero_sizes_and_bad_layouts() {
    let l = Layout::from_size_align(0, 64).unwrap();
    let p = ManagedAlloc.allocate(l).unwrap();
    assert_eq!(p.len(), 0);
    // SAFETY: `p` came from `allocate` with layout `l`.
    unsafe { ManagedAlloc.deallocate(p.cast(), l) };
    let big_align = Layout::from_size_align(64, cumem::pool::MAX_ALIGN * 2).unwrap();
    assert!(ManagedAlloc.allocate(big_align).is_err());
    let huge = Layout::from_size_align(isize::MAX as usize - 4096, 256).unwrap();
    assert!(ManagedAlloc.allocate(huge).is_err());
    let mm = MemoryManager::global().unwrap();
    for size in [0usize, usize::MAX, isize::MAX as usize] {
        let e = mm.allocate_managed(size).unwrap_err();
        assert!(matches!(e, Error::InvalidSize { .. }), "managed {size}: {e}");
    }
    still_works(mm);
}

#[test]
fn bad_frees_are_errors_and_lose_nothing() {
    let mm = MemoryManager::global().unwrap();
    let p = mm.allocate_managed(4096).unwrap();
    // Interior pointer.
    // SAFETY: 16 bytes into a 4096-byte block: an address, not a use.
    let inner = unsafe { p.as_ptr().add(16) };
    let e = mm.free_managed(inner).unwrap_err();
    assert!(matches!(e, Error::InteriorPointer { pool: PoolKind::Managed, .. }), "{e}");
    // A pointer the pool never gave out, and null.
    let mut local = 0u64;
    let e = mm.free_managed(&mut local as *mut u64 as *mut u8).unwrap_err();
    assert!(matches!(e, Error::UnknownPointer { pool: PoolKind::Managed, .. }), "{e}");
    assert!(mm.free_managed(std::ptr::null_mut()).is_err());
    // A pinned pointer is not managed.
    let q = mm.allocate_pinned(4096).unwrap();
    assert!(matches!(mm.free_managed(q.as_ptr()), Err(Error::UnknownPointer { .. })));
    mm.free_pinned(q.as_ptr()).unwrap();
    // Double free.
    mm.free_managed(p.as_ptr()).unwrap();
    let e = mm.free_managed(p.as_ptr()).unwrap_err();
    assert!(matches!(e, Error::DoubleFree { pool: PoolKind::Managed, .. }), "{e}");
    still_works(mm);
}

#[test]
fn helpers_accept_empty_and_refuse_bad_devices() {
    let v: ManagedVec<u32> = ManagedVec::new_in(ManagedAlloc);
    let stream = Stream::new().unwrap();
    prefetch(&v, Location::Device(0), &stream).unwrap();
    advise(&v, Advice::ReadMostly, true).unwrap();
    let mut w: ManagedVec<u32> = ManagedVec::new_in(ManagedAlloc);
    w.resize(1024, 1);
    if !MemoryManager::global().unwrap().backend().is_host() {
        let e = prefetch(&w, Location::Device(1 << 20), &stream).unwrap_err();
        assert!(matches!(e, Error::NoSuchDevice { .. }), "{e}");
    }
    prefetch(&w, Location::Host, &stream).unwrap();
    stream.synchronize().unwrap();
}

const KERNEL: &str = r#"
extern "C" __global__ void twice_plus_one(unsigned int* p, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) p[i] = 2u * p[i] + 1u;
}
"#;

#[test]
fn a_kernel_reads_and_writes_a_managed_vec() {
    let Some(ctx) = gpu_for_test("a_kernel_reads_and_writes_a_managed_vec") else { return };
    let ptx = cudarc::nvrtc::compile_ptx(KERNEL).expect("NVRTC compiles the kernel");
    let f = ctx.load_module(ptx).unwrap().load_function("twice_plus_one").unwrap();
    let n = 1usize << 20; // 4 MiB
    let mut v: ManagedVec<u32> = ManagedVec::with_capacity_in(n, ManagedAlloc);
    v.extend((0..n as u32).map(|i| i ^ 0x55));
    let stream = Stream::new().unwrap();
    let s = stream.cudarc().unwrap();
    advise(&v, Advice::PreferredLocation(Location::Device(0)), true).unwrap();
    prefetch(&v, Location::Device(0), &stream).unwrap();
    let (ptr, nn) = (v.as_mut_ptr() as u64, n as u64);
    let mut launch = s.launch_builder(&f);
    launch.arg(&ptr).arg(&nn);
    // SAFETY: the kernel takes (unsigned*, u64); `ptr` is `n` u32 values of
    // managed memory that the host leaves alone until the sync below.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n as u32)) }.unwrap();
    prefetch(&v, Location::Host, &stream).unwrap();
    stream.synchronize().unwrap();
    for (i, x) in v.iter().enumerate() {
        assert_eq!(*x, 2 * (i as u32 ^ 0x55) + 1, "element {i}");
    }
    advise(&v, Advice::PreferredLocation(Location::Device(0)), false).unwrap();
}

#[test]
fn shutdown_reports_live_managed_blocks_and_refuses_more() {
    let mm = MemoryManager::new(cumem::Config::new()).unwrap();
    let p = mm.allocate_managed(3000).unwrap();
    let q = mm.allocate_managed(100).unwrap();
    mm.free_managed(q.as_ptr()).unwrap();
    let report = mm.shutdown().unwrap();
    let managed: Vec<_> = report.live.iter().filter(|a| a.pool == PoolKind::Managed).collect();
    assert_eq!(managed.len(), 1);
    assert_eq!(managed[0].addr, p.as_ptr() as usize);
    assert!(matches!(mm.allocate_managed(10), Err(Error::ShutDown(_))));
    // The live block stays valid and can still be freed.
    // SAFETY: `p` is a live 3000-byte managed block.
    unsafe { p.as_ptr().write_bytes(1, 3000) };
    mm.free_managed(p.as_ptr()).unwrap();
}
