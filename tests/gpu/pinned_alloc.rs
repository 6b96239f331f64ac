//! `PinnedAlloc` through allocator-api2's collections: contents survive
//! growth and shrinking, zero-size layouts work, and an in-place grow is
//! observed when the next block is free.

use std::alloc::Layout;

use allocator_api2::alloc::Allocator;
use cumem::{MemoryManager, PinnedAlloc, PinnedBox, PinnedVec};

/// The global manager, so that a manager that can't be had (for example
/// `CUMEM_CONF=device=1` on a one-GPU machine) fails the test with its
/// error instead of aborting inside a collection's infallible growth.
fn manager() -> &'static MemoryManager {
    MemoryManager::global().unwrap_or_else(|e| panic!("the global manager: {e}"))
}

#[test]
fn vec_push_grow_shrink_keeps_contents() {
    manager();
    for round in 0..20u32 {
        let mut v: PinnedVec<u64> = PinnedVec::new_in(PinnedAlloc);
        let n = 1000 + round as usize * 3777;
        for i in 0..n {
            v.push(i as u64 ^ u64::from(round));
        }
        assert_eq!(v.as_ptr() as usize % 256, 0);
        for (i, x) in v.iter().enumerate() {
            assert_eq!(*x, i as u64 ^ u64::from(round));
        }
        v.truncate(n / 3);
        v.shrink_to_fit();
        assert_eq!(v.len(), n / 3);
        for (i, x) in v.iter().enumerate() {
            assert_eq!(*x, i as u64 ^ u64::from(round), "after shrink");
        }
        v.reserve(n * 2);
        for (i, x) in v.iter().enumerate() {
            assert_eq!(*x, i as u64 ^ u64::from(round), "after regrow");
        }
    }
}

#[test]
fn box_and_zero_sized_types() {
    manager();
    let b: PinnedBox<[u8; 4096]> = PinnedBox::new_in([7u8; 4096], PinnedAlloc);
    assert!(b.iter().all(|&x| x == 7));
    let z: PinnedBox<()> = PinnedBox::new_in((), PinnedAlloc);
    drop(z);
    let mut e: PinnedVec<()> = PinnedVec::new_in(PinnedAlloc);
    e.push(());
    assert_eq!(e.len(), 1);
    let empty: PinnedVec<u32> = PinnedVec::new_in(PinnedAlloc);
    assert_eq!(empty.capacity(), 0);
    // Zero-size layouts straight through the trait.
    let l = Layout::from_size_align(0, 64).unwrap();
    let p = PinnedAlloc.allocate(l).unwrap();
    assert_eq!(p.len(), 0);
    assert_eq!(p.cast::<u8>().as_ptr() as usize % 64, 0);
    // SAFETY: `p` came from `allocate` with layout `l`.
    unsafe { PinnedAlloc.deallocate(p.cast(), l) };
}

#[test]
fn hashbrown_map_in_pinned_memory() {
    manager();
    let mut m: hashbrown::HashMap<u32, String, hashbrown::DefaultHashBuilder, PinnedAlloc> =
        hashbrown::HashMap::with_hasher_in(hashbrown::DefaultHashBuilder::default(), PinnedAlloc);
    for i in 0..20_000u32 {
        m.insert(i, format!("v{i}"));
    }
    for i in (0..20_000u32).step_by(2) {
        m.remove(&i);
    }
    m.shrink_to_fit();
    for i in 0..20_000u32 {
        assert_eq!(m.get(&i).cloned(), (i % 2 == 1).then(|| format!("v{i}")));
    }
}

#[test]
fn grow_in_place_when_the_next_block_is_free() {
    let mm = manager();
    // A large block whose tail stays free: shrink it, then grow it back.
    // Other tests share the global pinned pool and may take the freed
    // tail between the shrink and the grow: then the block moves (its
    // bytes kept), and the test tries again with a fresh block.
    let mut in_place = 0;
    for _ in 0..8 {
        let l = Layout::from_size_align(1 << 20, 256).unwrap();
        let p = PinnedAlloc.allocate(l).unwrap();
        let ptr = p.cast::<u8>();
        // SAFETY: `ptr` is a fresh 1 MiB allocation.
        unsafe { ptr.as_ptr().write_bytes(0x5a, 1 << 20) };
        let small = Layout::from_size_align(4096, 256).unwrap();
        // SAFETY: `ptr` was allocated with `l`; 4096 ≤ 1 MiB.
        let s = unsafe { PinnedAlloc.shrink(ptr, l, small) }.unwrap();
        assert_eq!(s.cast::<u8>(), ptr, "shrink happens in place");
        assert_eq!(mm.pinned_pool().block_size(ptr.as_ptr() as usize), Some(4096));
        let big = Layout::from_size_align(512 << 10, 256).unwrap();
        // SAFETY: `ptr` is live with layout `small`.
        let g = unsafe { PinnedAlloc.grow(ptr, small, big) }.unwrap().cast::<u8>();
        // SAFETY: the first 4096 bytes were kept, in place or moved; the
        // block now holds 512 KiB.
        unsafe {
            assert_eq!(*g.as_ptr(), 0x5a);
            assert_eq!(*g.as_ptr().add(4095), 0x5a);
        }
        in_place += usize::from(g == ptr);
        // SAFETY: live with layout `big`.
        unsafe { PinnedAlloc.deallocate(g, big) };
        if in_place > 0 {
            break;
        }
    }
    assert!(in_place > 0, "grow into the free block after it never happened in place");
}

#[test]
fn grow_moves_when_the_next_block_is_taken() {
    manager();
    let a_layout = Layout::from_size_align(4096, 256).unwrap();
    let a = PinnedAlloc.allocate(a_layout).unwrap().cast::<u8>();
    let b = PinnedAlloc.allocate(a_layout).unwrap().cast::<u8>();
    // SAFETY: fresh 4096-byte allocation.
    unsafe { a.as_ptr().write_bytes(0x11, 4096) };
    let big = Layout::from_size_align(64 << 10, 256).unwrap();
    let moved = if b.as_ptr() as usize == a.as_ptr() as usize + 4096 {
        // SAFETY: `a` is live with `a_layout`.
        let g = unsafe { PinnedAlloc.grow(a, a_layout, big) }.unwrap().cast::<u8>();
        assert_ne!(g, a, "the neighbour is live, so the block must move");
        g
    } else {
        // SAFETY: as above.
        unsafe { PinnedAlloc.grow(a, a_layout, big) }.unwrap().cast::<u8>()
    };
    // SAFETY: the first 4096 bytes were copied.
    unsafe { assert!((0..4096).all(|i| *moved.as_ptr().add(i) == 0x11)) };
    let z = Layout::from_size_align(64 << 10, 256).unwrap();
    // SAFETY: live allocations with these layouts.
    unsafe {
        PinnedAlloc.deallocate(moved, z);
        PinnedAlloc.deallocate(b, a_layout);
    }
}

#[test]
fn refusals_are_errors_with_a_reason_not_aborts() {
    manager();
    let mut v: PinnedVec<u8> = PinnedVec::new_in(PinnedAlloc);
    v.extend_from_slice(&[1, 2, 3]);
    // More than any machine has: the pool refuses, the fallible form
    // returns the error, and the vector is unchanged.
    assert!(v.try_reserve(isize::MAX as usize / 2 + 4096).is_err());
    let why = PinnedAlloc::last_error().expect("the refusal's reason is kept");
    assert!(why.contains("invalid size"), "{why}");
    assert_eq!(&v[..], &[1, 2, 3]);
    // An alignment over the pool's limit.
    let l = Layout::from_size_align(4096, 1 << 22).unwrap();
    assert!(PinnedAlloc.allocate(l).is_err());
    assert!(PinnedAlloc::last_error().unwrap().contains("alignment"));
    // A box through the fallible constructor.
    assert!(PinnedBox::try_new_in([0u8; 64], PinnedAlloc).is_ok());
    v.try_reserve(1 << 20).unwrap();
    assert!(v.capacity() >= (1 << 20) + 3);
}
