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
