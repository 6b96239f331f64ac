//! Staged pageable copies round-trip every size class from 1 B to 300 MiB,
//! odd sizes included, on the host fallback here and on the GPU (the same
//! test; under `CUMEM_REQUIRE_GPU=1` it refuses to run on the fallback).

use cumem::device::gpu_for_test;
use cumem::{DeviceBuffer, Error, MemoryManager, Stream};

const SIZES: &[usize] = &[
    1,
    3,
    255,
    256,
    4097,
    65_537,
    (1 << 20) - 1,
    2 << 20,
    (2 << 20) + 1,
    (4 << 20) + 3,
    8 << 20,
    13_000_001,
    (64 << 20) + 7,
    300 << 20,
];

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8 ^ seed).collect()
}

fn on_gpu_if_required(test: &str) {
    // Prints why when there is no GPU; panics under CUMEM_REQUIRE_GPU=1.
    let _ = gpu_for_test(test);
}

#[test]
fn round_trips_every_size_class() {
    on_gpu_if_required("round_trips_every_size_class");
    let stream = Stream::new().unwrap();
    for (k, &n) in SIZES.iter().enumerate() {
        let src = pattern(n, k as u8);
        let mut buf = DeviceBuffer::<u8>::new_on(n, &stream).unwrap();
        buf.copy_from_pageable(&src, &stream).unwrap();
        // Read back through the plain path first: the staged write landed.
        stream.synchronize().unwrap();
        let plain = buf.to_vec().unwrap();
        assert!(plain == src, "{n} B: staged write differs");
        let mut back = vec![0u8; n];
        buf.copy_to_pageable(&mut back, &stream).unwrap();
        assert!(back == src, "{n} B: staged read differs");
    }
}

#[test]
fn typed_values_and_odd_element_sizes() {
    on_gpu_if_required("typed_values_and_odd_element_sizes");
    let stream = Stream::new().unwrap();
    let words: Vec<u64> = (0..1_000_003u64).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15)).collect();
    let mut buf = DeviceBuffer::<u64>::new(words.len()).unwrap();
    buf.copy_from_pageable(&words, &stream).unwrap();
    let mut back = vec![0u64; words.len()];
    buf.copy_to_pageable(&mut back, &stream).unwrap();
    assert_eq!(back, words);

    let triples: Vec<[u8; 3]> = (0..(3 << 20) + 1).map(|i| [i as u8, (i >> 8) as u8, (i >> 16) as u8]).collect();
    let mut buf = DeviceBuffer::<[u8; 3]>::new(triples.len()).unwrap();
    buf.copy_from_pageable(&triples, &stream).unwrap();
    assert_eq!(buf.to_vec().unwrap(), triples);
}

#[test]
fn length_mismatches_and_host_queues_are_errors() {
    let mm = MemoryManager::global().unwrap();
    let stream = Stream::new().unwrap();
    let mut buf = DeviceBuffer::<u32>::new(10).unwrap();
    assert!(matches!(buf.copy_from_pageable(&[1; 9], &stream), Err(Error::InvalidState(_))));
    assert!(matches!(buf.copy_to_pageable(&mut [0; 11], &stream), Err(Error::InvalidState(_))));
    if !mm.backend().is_host() {
        // A host queue can't move CUDA memory.
        let r = buf.copy_from_pageable(&[1; 10], &Stream::host());
        assert!(matches!(r, Err(Error::InvalidState(_))), "{r:?}");
    }
    // Zero bytes is nothing to do.
    // SAFETY: no byte is copied.
    unsafe { mm.copy_from_pageable::<u8>(buf.device_ptr(), &[], &stream) }.unwrap();
}

const KERNEL: &str = r#"
extern "C" __global__ void spin_then_fill(unsigned char* p, unsigned char v, unsigned long long n, long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    for (; i < n; i += (unsigned long long)gridDim.x * blockDim.x) p[i] = v;
}
"#;

/// The staged copies are stream-ordered: a read queued after a slow kernel
/// on the same stream sees what the kernel wrote, and a write queued
/// behind it lands after it.
#[test]
fn staged_copies_follow_the_stream_order() {
    use cudarc::driver::{LaunchConfig, PushKernelArg};
    let Some(ctx) = gpu_for_test("staged_copies_follow_the_stream_order") else { return };
    let ptx = cudarc::nvrtc::compile_ptx(KERNEL).expect("NVRTC compiles the kernel");
    let f = ctx.load_module(ptx).unwrap().load_function("spin_then_fill").unwrap();
    let stream = Stream::new().unwrap();
    let s = stream.cudarc().unwrap();
    let n = (16 << 20) + 5;
    let mut buf = DeviceBuffer::<u8>::new_on(n, &stream).unwrap();
    buf.copy_from_pageable(&vec![1u8; n], &stream).unwrap();
    // About 0.1 s of spinning, then the whole buffer becomes 9.
    let (ptr, v, nn, cycles) = (buf.device_ptr(), 9u8, n as u64, 200_000_000i64);
    let launch_fill = |v: &u8| {
        let mut launch = s.launch_builder(&f);
        launch.arg(&ptr).arg(v).arg(&nn).arg(&cycles);
        let cfg = LaunchConfig { grid_dim: (256, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: the signature matches; the buffer holds `n` bytes and
        // lives until after the stream is synchronised.
        unsafe { launch.launch(cfg) }.unwrap();
    };
    launch_fill(&v);
    let mut back = vec![0u8; n];
    buf.copy_to_pageable(&mut back, &stream).unwrap();
    assert!(back.iter().all(|b| *b == 9), "the read did not wait for the kernel");
    // A write queued behind a slow fill of 3 lands after it.
    launch_fill(&3u8);
    buf.copy_from_pageable(&vec![5u8; n], &stream).unwrap();
    buf.copy_to_pageable(&mut back, &stream).unwrap();
    assert!(back.iter().all(|b| *b == 5), "the write landed before the kernel's");
}
