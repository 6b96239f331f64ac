//! The workers' tasks. Each returns an error for a failed call; wrong
//! values are counted where they are found.

use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use cudarc::driver::sys;
use cumem::{DeviceBuffer, GrowableBuffer, PinnedAlloc, PinnedVec, Stream};
use cumem_c::CumemStream;

use crate::work::{add_copy, c, check, err, fill, read, Res};
use crate::{pattern, Rng, Soak};

/// The workers' tasks, with their weights (percent).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Task {
    /// Cumem streams, blocks handed across streams.
    Rust,
    /// The C ABI with its own and raw streams.
    CAbi,
    /// Graph captures in every mode.
    Graphs,
    /// Growable buffers.
    Growable,
    /// Pinned vectors.
    Pinned,
    /// Buffers on the legacy stream.
    Legacy,
}

pub const TASKS: [(Task, &str, usize); 6] = [
    (Task::Rust, "rust", 22),
    (Task::CAbi, "c", 22),
    (Task::Graphs, "graphs", 18),
    (Task::Growable, "growable", 12),
    (Task::Pinned, "pinned", 14),
    (Task::Legacy, "legacy", 12),
];

/// A worker: random tasks until its life ends or the soak stops.
pub fn worker(s: &Soak, seed: u64, life: Duration) {
    let mut rng = Rng::new(seed);
    if let Err(e) = s.ctx.bind_to_thread() {
        s.error(&format!("bind_to_thread: {e}"));
        return;
    }
    let end = Instant::now() + life;
    while Instant::now() < end && !s.stop.load(Ordering::Relaxed) {
        let task = s.pick(&mut rng);
        let r = match task {
            // Takes the exclusive lock itself (global captures run alone).
            Task::Graphs => crate::graphs::capture(s, &mut rng),
            _ => {
                let _g = s.exclusive.read().unwrap_or_else(|e| e.into_inner());
                let _apart = (s.apart && matches!(task, Task::Growable | Task::Legacy))
                    .then(|| s.capture_gate.write().unwrap_or_else(|e| e.into_inner()));
                match task {
                    Task::Rust => rust_cross_stream(s, &mut rng),
                    Task::CAbi => c_abi_streams(s, &mut rng),
                    Task::Growable => growable(s, &mut rng),
                    Task::Pinned => pinned(s, &mut rng),
                    Task::Legacy => legacy(s, &mut rng),
                    Task::Graphs => unreachable!(),
                }
            }
        };
        match r {
            Ok(()) => {
                s.ops.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => s.error(&e),
        }
    }
}

/// A block handed from one cumem stream to another and freed there; the
/// next block of its size on the first stream must wait for the second.
fn rust_cross_stream(s: &Soak, rng: &mut Rng) -> Res {
    let s1 = Stream::new().map_err(err("Stream::new"))?;
    let s2 = Stream::new().map_err(err("Stream::new"))?;
    s.streams_made.fetch_add(2, Ordering::Relaxed);
    let (c1, c2) = (s1.cudarc().unwrap().clone(), s2.cudarc().unwrap().clone());
    let mm = s.mm;
    for _ in 0..rng.range(1, 4) {
        let n = rng.range(64, s.max_values());
        let (seed1, seed2) = (rng.next() as u32, rng.next() as u32);
        let a = mm.allocate_device_on(n * 4, &s1).map_err(err("allocate_device_on"))?;
        fill(s, &c1, a, seed1, n)?;
        let b = mm.allocate_device_on(n * 4, &s2).map_err(err("allocate_device_on"))?;
        s2.wait_for(&s1).map_err(err("wait_for"))?;
        add_copy(&s.add_copy, &c2, b, a, 1, n)?;
        // `a`'s last use is on s2: freed there, in stream order.
        mm.free_device_on(a, &s2).map_err(err("free_device_on"))?;
        let c = mm.allocate_device_on(n * 4, &s1).map_err(err("allocate_device_on"))?;
        fill(s, &c1, c, seed2, n)?;
        check(s, "a block copied on another stream", &read(s, &s2, b, n)?, seed1, 1);
        check(s, "a block reused across streams", &read(s, &s1, c, n)?, seed2, 0);
        mm.free_device_on(b, &s2).map_err(err("free_device_on"))?;
        mm.free_device_on(c, &s1).map_err(err("free_device_on"))?;
    }
    // Streams go with their frees still queued, half the time.
    if rng.coin(50) {
        s1.synchronize().map_err(err("synchronize"))?;
    }
    Ok(())
}

/// The C ABI with a stream of `cumem_stream_create` and a raw stream made
/// (and destroyed) outside cumem.
fn c_abi_streams(s: &Soak, rng: &mut Rng) -> Res {
    let mut owned: CumemStream = std::ptr::null_mut();
    // SAFETY: `owned` is valid for a write.
    c(unsafe { cumem_c::cumem_stream_create(&mut owned) }, "cumem_stream_create")?;
    let raw = s.foreign.take().map_or_else(new_raw_stream, Ok)?;
    s.streams_made.fetch_add(1, Ordering::Relaxed);
    let foreign = raw.0 as CumemStream;
    let r = c_abi_work(s, rng, owned, foreign);
    // Both streams go: synchronised first (their frees' work is done).
    let done = c(cumem_c::cumem_stream_synchronize(owned), "cumem_stream_synchronize")
        .and_then(|_| c(cumem_c::cumem_stream_destroy(owned), "cumem_stream_destroy"));
    let gone = if s.destroy_foreign { destroy_raw_stream(raw) } else { s.foreign.give_back(raw) };
    r.and(done).and(gone)
}

/// A raw stream made outside cumem (`cuStreamCreate`).
pub struct RawStream(pub sys::CUstream);

// SAFETY: a CUstream is a handle any thread of the process may use.
unsafe impl Send for RawStream {}

pub fn new_raw_stream() -> Result<RawStream, String> {
    let mut raw: sys::CUstream = std::ptr::null_mut();
    // SAFETY: `raw` is valid for a write; the context is current.
    unsafe { sys::cuStreamCreate(&mut raw, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) }
        .result()
        .map_err(err("cuStreamCreate"))?;
    Ok(RawStream(raw))
}

/// Synchronises and destroys a raw stream, telling the C ABI first.
pub fn destroy_raw_stream(raw: RawStream) -> Res {
    // SAFETY: `raw` is a stream the soak made; nothing else uses it now.
    unsafe { sys::cuStreamSynchronize(raw.0) }.result().map_err(err("cuStreamSynchronize"))?;
    forget_stream(raw.0 as CumemStream)?;
    // SAFETY: as above; cumem was told it is gone.
    unsafe { sys::cuStreamDestroy_v2(raw.0) }.result().map_err(err("cuStreamDestroy"))
}

/// Tells the C ABI a raw stream is about to be destroyed.
fn forget_stream(raw: CumemStream) -> Res {
    c(cumem_c::cumem_stream_forget(raw), "cumem_stream_forget")
}

/// Raw streams kept for reuse (as PyTorch's stream pool does) when they
/// are not destroyed after each task.
#[derive(Default)]
pub struct ForeignStreams(std::sync::Mutex<Vec<RawStream>>);

impl ForeignStreams {
    fn take(&self) -> Option<RawStream> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).pop()
    }
    fn give_back(&self, raw: RawStream) -> Res {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(raw);
        Ok(())
    }
    /// Destroys every kept stream (at the end of the soak).
    pub fn destroy_all(&self) -> Res {
        let all = std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()));
        all.into_iter().try_for_each(destroy_raw_stream)
    }
}

fn c_abi_work(s: &Soak, rng: &mut Rng, owned: CumemStream, foreign: CumemStream) -> Res {
    let n = rng.range(64, s.max_values());
    let bytes = n * 4;
    let (seed1, seed2) = (rng.next() as u32, rng.next() as u32);
    let device = s.mm.config().device as i32;
    // SAFETY: both raw streams belong to the device's primary context and
    // outlive the wrappers, which never destroy them.
    let co = unsafe { s.ctx.wrap_borrowed_stream(owned as sys::CUstream) };
    // SAFETY: as above.
    let cf = unsafe { s.ctx.wrap_borrowed_stream(foreign as sys::CUstream) };
    let mut host: *mut c_void = std::ptr::null_mut();
    // SAFETY: `host` is valid for a write.
    c(unsafe { cumem_c::cumem_allocate_pinned(bytes, &mut host) }, "cumem_allocate_pinned")?;
    // SAFETY: cumem handed out `bytes` bytes of pinned host memory, 256-byte
    // aligned, that only this task uses.
    let staging = unsafe { std::slice::from_raw_parts_mut(host.cast::<u32>(), n) };
    staging.iter_mut().enumerate().for_each(|(i, v)| *v = pattern(seed1, i));
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: `p` is valid for a write; `owned` lives until destroyed later.
    c(unsafe { cumem_c::cumem_allocate_device_on(bytes, owned, &mut p) }, "cumem_allocate_device_on")?;
    // SAFETY: `staging` and `p` hold `bytes`; `staging` is not written until
    // the stream is synchronised below.
    c(unsafe { cumem_c::cumem_copy_to_device_async(p, host, bytes, owned) }, "cumem_copy_to_device_async")?;
    // The foreign stream takes the block over: an event orders it.
    let ev = co.record_event(None).map_err(err("record_event"))?;
    cf.wait(&ev).map_err(err("stream wait"))?;
    // SAFETY: PyTorch's entry point, with a stream of the device.
    let q = unsafe { cumem_c::cumem_torch_alloc(bytes, device, foreign) };
    if q.is_null() {
        return Err("cumem_torch_alloc returned NULL".into());
    }
    add_copy(&s.add_copy, &cf, q as u64, p as u64, 7, n)?;
    // SAFETY: `p` was allocated above; its last use is queued on `foreign`.
    c(unsafe { cumem_c::cumem_free_device_on(p, foreign) }, "cumem_free_device_on")?;
    let mut r: *mut c_void = std::ptr::null_mut();
    // SAFETY: `r` is valid for a write.
    c(unsafe { cumem_c::cumem_allocate_device_on(bytes, owned, &mut r) }, "cumem_allocate_device_on")?;
    fill(s, &co, r as u64, seed2, n)?;
    // Read back both through the C ABI into the pinned staging memory.
    c(cumem_c::cumem_stream_synchronize(owned), "cumem_stream_synchronize")?;
    // SAFETY: `q` holds `bytes`, written by work on `foreign`; `host` is not
    // read until the stream is synchronised.
    c(unsafe { cumem_c::cumem_copy_to_host_async(host, q, bytes, foreign) }, "cumem_copy_to_host_async")?;
    c(cumem_c::cumem_stream_synchronize(foreign), "cumem_stream_synchronize")?;
    check(s, "a C-ABI block copied on a foreign stream", staging, seed1, 7);
    // SAFETY: as above, for `r` on `owned`.
    c(unsafe { cumem_c::cumem_copy_to_host_async(host, r, bytes, owned) }, "cumem_copy_to_host_async")?;
    c(cumem_c::cumem_stream_synchronize(owned), "cumem_stream_synchronize")?;
    check(s, "a C-ABI block reused across streams", staging, seed2, 0);
    // SAFETY: PyTorch's free of `q` (its size and stream as allocated).
    unsafe { cumem_c::cumem_torch_free(q, bytes, device, foreign) };
    // SAFETY: `r` was allocated above.
    c(unsafe { cumem_c::cumem_free_device_on(r, owned) }, "cumem_free_device_on")?;
    c(cumem_c::cumem_free_pinned(host), "cumem_free_pinned")?;
    Ok(())
}

/// A growable buffer grown in steps, checked, shrunk, checked.
fn growable(s: &Soak, rng: &mut Rng) -> Res {
    let stream = Stream::new().map_err(err("Stream::new"))?;
    s.streams_made.fetch_add(1, Ordering::Relaxed);
    let seed = rng.next() as u32;
    let mut g = GrowableBuffer::<u32>::with_capacity_for(&stream, rng.range(1, 1 << 16)).map_err(err("growable"))?;
    let total = rng.range(1024, s.max_values() * 2);
    let mut expect: Vec<u32> = Vec::with_capacity(total);
    while expect.len() < total {
        let step = rng.range(1, (total - expect.len()).min(1 << 20) + 1);
        let part: Vec<u32> = (expect.len()..expect.len() + step).map(|i| pattern(seed, i)).collect();
        g.extend_from_host(&part).map_err(err("extend_from_host"))?;
        expect.extend_from_slice(&part);
    }
    let seen = g.to_vec().map_err(err("growable to_vec"))?;
    check(s, "a growable buffer", &seen, seed, 0);
    if seen.len() != total {
        s.wrong_values("a growable buffer's length", 1);
    }
    let keep = rng.range(1, total);
    g.truncate(keep);
    g.shrink_to_fit().map_err(err("shrink_to_fit"))?;
    let seen = g.to_vec().map_err(err("growable to_vec"))?;
    check(s, "a shrunk growable buffer", &seen, seed, 0);
    if seen.len() != keep {
        s.wrong_values("a shrunk growable buffer's length", 1);
    }
    Ok(())
}

/// Pinned vectors grown by pushes (the allocator's grow), and a device
/// round trip through them.
fn pinned(s: &Soak, rng: &mut Rng) -> Res {
    let seed = rng.next() as u32;
    let n = rng.range(16, s.max_values());
    let mut v: PinnedVec<u32> = PinnedVec::new_in(PinnedAlloc);
    for i in 0..n {
        v.push(pattern(seed, i));
    }
    check(s, "a pinned vector", &v, seed, 0);
    let stream = Stream::new().map_err(err("Stream::new"))?;
    s.streams_made.fetch_add(1, Ordering::Relaxed);
    let d = s.mm.allocate_device_on(n * 4, &stream).map_err(err("allocate_device_on"))?;
    // SAFETY: `v` holds `n` values and is not written until the stream is
    // synchronised (in `read`); `d` holds `n` values.
    unsafe { s.mm.copy_to_device_async(d, v.as_ptr().cast(), n * 4, &stream) }.map_err(err("copy_to_device_async"))?;
    let back = read(s, &stream, d, n)?;
    check(s, "a pinned round trip", &back, seed, 0);
    s.mm.free_device_on(d, &stream).map_err(err("free_device_on"))?;
    v.truncate(n / 2);
    v.shrink_to_fit();
    check(s, "a shrunk pinned vector", &v, seed, 0);
    Ok(())
}

/// Buffers without a stream (the legacy stream) through both interfaces.
fn legacy(s: &Soak, rng: &mut Rng) -> Res {
    let seed = rng.next() as u32;
    let n = rng.range(16, s.max_values() / 4);
    let data: Vec<u32> = (0..n).map(|i| pattern(seed, i)).collect();
    let b = DeviceBuffer::from_host(&data).map_err(err("DeviceBuffer::from_host"))?;
    check(s, "a device buffer", &b.to_vec().map_err(err("DeviceBuffer::to_vec"))?, seed, 0);
    drop(b);
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: `p` is valid for a write.
    c(unsafe { cumem_c::cumem_allocate_device(n * 4, &mut p) }, "cumem_allocate_device")?;
    // SAFETY: `p` holds `n * 4` bytes; `data` as many.
    unsafe { sys::cuMemcpyHtoD_v2(p as u64, data.as_ptr().cast(), n * 4) }.result().map_err(err("cuMemcpyHtoD"))?;
    let mut back = vec![0u32; n];
    // SAFETY: as above.
    unsafe { sys::cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), p as u64, n * 4) }.result().map_err(err("cuMemcpyDtoH"))?;
    check(s, "a C-ABI block on the legacy stream", &back, seed, 0);
    c(cumem_c::cumem_free_device(p), "cumem_free_device")
}
