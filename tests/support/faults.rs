//! A random workload run while cumem's fault injection fails driver calls
//! (or their host stand-ins): device and pinned blocks, growable buffers,
//! frees across streams, releases. After every step the pools' invariants
//! hold; every failure is a typed error; live blocks never overlap and keep
//! their contents; at the end everything is freed and released, and
//! reserved memory is back where it started.

use std::collections::BTreeMap;

use cumem::fault::{self, Point, Scope, Trigger};
use cumem::{Error, GrowableBuffer, MemoryManager, Stream, VmBackend};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// How the workload reaches device memory: fills a block with a byte on a
/// stream, and reads a few bytes of it back.
pub trait DeviceBytes {
    /// Fills `len` bytes at `addr` with `value`, in order on `stream`.
    fn fill(&self, addr: u64, len: usize, value: u8, stream: &Stream);
    /// The `len` bytes at `addr`, read after the work queued on `stream`.
    fn read(&self, addr: u64, len: usize, stream: &Stream) -> Vec<u8>;
}

/// What a run saw.
#[derive(Debug, Default, Clone, Copy)]
pub struct Outcome {
    /// Operations run.
    pub ops: u64,
    /// Failures injected during the run.
    pub injected: u64,
    /// Operations that returned an error.
    pub errors: u64,
}

/// The points the workload arms.
pub const POINTS: [Point; 7] = Point::ALL;

/// An error the injection may cause: out of memory, or the driver's error.
fn typed(e: &Error) -> bool {
    matches!(e, Error::OutOfMemory { .. } | Error::Driver { .. } | Error::Os { .. })
}

/// The bytes of a block the workload writes and checks: its first and
/// last 64 bytes (a block handed out twice, or moved, shows there).
fn samples(addr: u64, size: usize) -> [(u64, usize); 2] {
    let n = size.min(64);
    [(addr, n), (addr + (size - n) as u64, n)]
}

fn check_pools(mm: &MemoryManager, device: usize, step: u64) {
    let d = mm.device(device).expect("the device");
    d.pool().check_invariants().unwrap_or_else(|e| panic!("step {step}: device pool: {e}"));
    mm.pinned_pool().check_invariants().unwrap_or_else(|e| panic!("step {step}: pinned pool: {e}"));
}

/// Live blocks never overlap: `addr` of `size` bytes meets none of `live`.
fn assert_disjoint(live: &BTreeMap<u64, (usize, u8, usize)>, addr: u64, size: usize, what: &str) {
    if let Some((&a, &(s, ..))) = live.range(..=addr).next_back() {
        assert!(a + s as u64 <= addr, "{what} {addr:#x}+{size} overlaps live {a:#x}+{s}");
    }
    if let Some((&a, _)) = live.range(addr..).next() {
        assert!(addr + size as u64 <= a, "{what} {addr:#x}+{size} overlaps live {a:#x}");
    }
}

/// Runs `ops` random operations on `mm`'s device `device` with faults at
/// every point failing with `probability` (seeded with `seed`), armed for
/// this thread only. Returns what it saw; panics on the first broken rule.
pub fn run(
    mm: &MemoryManager,
    device: usize,
    streams: &[Stream],
    mem: &dyn DeviceBytes,
    seed: u64,
    ops: u64,
    probability: f64,
) -> Outcome {
    let mut rng = SmallRng::seed_from_u64(seed);
    let start_device = mm.device(device).unwrap().stats().pool.reserved;
    let start_pinned = mm.pinned_stats().reserved;
    // addr → (size, value, stream index)
    let mut device_live: BTreeMap<u64, (usize, u8, usize)> = BTreeMap::new();
    let mut pinned_live: BTreeMap<u64, (usize, u8, usize)> = BTreeMap::new();
    let mut growable: Option<(GrowableBuffer<u32>, Vec<u32>)> = None;
    let mut out = Outcome::default();
    let injected_before = fault::injected();
    fault::arm(&POINTS, Trigger::Random { probability, seed }, Scope::ThisThread);
    for step in 0..ops {
        out.ops += 1;
        let value = rng.r#gen::<u8>() | 1;
        match rng.gen_range(0..100) {
            0..=34 => {
                let size = 1usize << rng.gen_range(8..23);
                let size = rng.gen_range(size / 2..=size);
                let si = rng.gen_range(0..streams.len());
                match mm.allocate_device_on(size, &streams[si]) {
                    Ok(addr) => {
                        assert_disjoint(&device_live, addr, size, "device block");
                        for (a, n) in samples(addr, size) {
                            mem.fill(a, n, value, &streams[si]);
                        }
                        device_live.insert(addr, (size, value, si));
                    }
                    Err(e) => {
                        assert!(typed(&e), "step {step}: device allocation failed with {e:?}");
                        out.errors += 1;
                    }
                }
            }
            35..=64 if !device_live.is_empty() => {
                let nth = rng.gen_range(0..device_live.len());
                let (&addr, &(size, v, si)) = device_live.iter().nth(nth).unwrap();
                for (a, n) in samples(addr, size) {
                    let got = mem.read(a, n, &streams[si]);
                    assert!(got.iter().all(|&b| b == v), "step {step}: block {addr:#x}+{size} lost its contents");
                }
                // Freed on its own stream or another one (cross-stream).
                let fi = if rng.gen_bool(0.7) { si } else { rng.gen_range(0..streams.len()) };
                mm.free_device_on(addr, &streams[fi]).unwrap_or_else(|e| panic!("step {step}: free: {e}"));
                device_live.remove(&addr);
            }
            65..=76 => {
                let top = 1usize << rng.gen_range(8..21);
                let size = rng.gen_range(1..top);
                match mm.allocate_pinned(size) {
                    Ok(p) => {
                        let addr = p.as_ptr() as u64;
                        assert_disjoint(&pinned_live, addr, size, "pinned block");
                        // SAFETY: the block is `size` bytes of host memory
                        // this test owns until it frees it.
                        unsafe { std::ptr::write_bytes(p.as_ptr(), value, size.min(4096)) };
                        pinned_live.insert(addr, (size, value, 0));
                    }
                    Err(e) => {
                        assert!(typed(&e), "step {step}: pinned allocation failed with {e:?}");
                        out.errors += 1;
                    }
                }
            }
            77..=88 if !pinned_live.is_empty() => {
                let nth = rng.gen_range(0..pinned_live.len());
                let (&addr, &(size, v, _)) = pinned_live.iter().nth(nth).unwrap();
                // SAFETY: a live pinned block of `size` bytes.
                let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, size.min(4096)) };
                assert!(bytes.iter().all(|&b| b == v), "step {step}: pinned block {addr:#x} lost its contents");
                mm.free_pinned(addr as *mut u8).unwrap_or_else(|e| panic!("step {step}: pinned free: {e}"));
                pinned_live.remove(&addr);
            }
            89..=95 => {
                let (buf, mirror) = match growable.take() {
                    Some(g) => g,
                    None => match GrowableBuffer::<u32>::with_capacity_on(mem_backend(mm, device), 1024) {
                        Ok(b) => (b, Vec::new()),
                        Err(e) => {
                            assert!(typed(&e), "step {step}: growable buffer failed with {e:?}");
                            out.errors += 1;
                            continue;
                        }
                    },
                };
                let mut buf = buf;
                let mut mirror = mirror;
                let more: Vec<u32> = (0..rng.gen_range(1..200_000)).map(|i| i ^ u32::from(value)).collect();
                match buf.extend_from_host(&more) {
                    Ok(()) => mirror.extend_from_slice(&more),
                    Err(e) => {
                        assert!(typed(&e), "step {step}: growing a buffer failed with {e:?}");
                        out.errors += 1;
                    }
                }
                assert_eq!(buf.len(), mirror.len(), "step {step}: a failed grow changed the length");
                // The contents survive every grow, failed or not (the first
                // 4,096 elements: the whole buffer every time is slow).
                let mut head = vec![0u32; mirror.len().min(4096)];
                if buf.copy_to_host(&mut head).is_ok() {
                    assert!(head[..] == mirror[..head.len()], "step {step}: the growable buffer's contents changed");
                }
                // Large buffers go, so address space comes and goes too.
                if mirror.len() < 4 << 20 {
                    growable = Some((buf, mirror));
                }
            }
            _ => {
                if rng.gen_bool(0.3) {
                    mm.release_cached().unwrap_or_else(|e| panic!("step {step}: release_cached: {e}"));
                }
            }
        }
        check_pools(mm, device, step);
    }
    fault::disarm();
    out.injected = fault::injected() - injected_before;
    for (&addr, &(size, v, si)) in &device_live {
        for (a, n) in samples(addr, size) {
            assert!(mem.read(a, n, &streams[si]).iter().all(|&b| b == v), "block {addr:#x} lost its contents");
        }
        mm.free_device_on(addr, &streams[si]).unwrap();
    }
    for &addr in pinned_live.keys() {
        mm.free_pinned(addr as *mut u8).unwrap();
    }
    drop(growable);
    for s in streams {
        s.synchronize().unwrap();
    }
    mm.release_cached().unwrap();
    check_pools(mm, device, ops);
    let d = mm.device(device).unwrap().stats().pool;
    assert_eq!((d.in_use, d.live_blocks), (0, 0), "device blocks left live: {d:?}");
    assert_eq!(d.reserved, start_device, "device reserved went from {start_device} to {}", d.reserved);
    let p = mm.pinned_stats();
    assert_eq!(p.reserved, start_pinned, "pinned reserved went from {start_pinned} to {}", p.reserved);
    out
}

/// Growable buffers live where the manager's device memory does.
fn mem_backend(mm: &MemoryManager, device: usize) -> VmBackend {
    if mm.backend().is_host() {
        VmBackend::Host
    } else {
        VmBackend::Cuda(device)
    }
}
