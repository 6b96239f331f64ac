//! The workers' tasks: a failed call is an error; wrong values are counted.

use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use cudarc::driver::sys;
use cumem::{DeviceBuffer, GrowableBuffer, PinnedAlloc, PinnedVec, Stream};
use cumem_c::CumemStream;

use crate::work::{add_copy, c, check, err, fill, read, Res};
use crate::{pattern, Rng, Soak};

/// A worker: weighted random tasks until its life ends or the soak stops.
pub fn worker(s: &Soak, seed: u64, life: Duration) {
    type TaskFn = fn(&Soak, &mut Rng) -> Res;
    // The last two synchronise the device or the legacy stream: they run
    // apart from captures. (Reports name tasks by their index here.)
    const TASKS: [(TaskFn, usize); 6] = [
        (rust_cross_stream, 22),
        (c_abi_streams, 22),
        (crate::graphs::capture, 18),
        (pinned, 14),
        (growable, 12),
        (legacy, 12),
    ];
    let mut rng = Rng::new(seed);
    if let Err(e) = s.ctx.bind_to_thread() {
        return s.error(&format!("bind_to_thread: {e}"));
    }
    let end = Instant::now() + life;
    while Instant::now() < end && !s.stop.load(Ordering::Relaxed) {
        let mut x = rng.range(0, 100);
        let i = TASKS
            .iter()
            .position(|&(_, w)| {
                let hit = x < w;
                x = x.saturating_sub(w);
                hit
            })
            .unwrap_or(0);
        let r = if i == 2 {
            // Takes the exclusive lock itself (global captures run alone).
            TASKS[i].0(s, &mut rng)
        } else {
            let _g = s.exclusive.read().unwrap_or_else(|e| e.into_inner());
            let _apart = (i >= 4).then(|| s.capture_gate.write().unwrap_or_else(|e| e.into_inner()));
            TASKS[i].0(s, &mut rng)
        };
        match r {
            Ok(()) => drop(s.ops.fetch_add(1, Ordering::Relaxed)),
            Err(e) => s.error(&e),
        }
        // A driver error that cudarc recorded (a drop that failed) is
        // reported by whichever call binds the context next, far from its
        // cause: look after every task, so that a report names the task
        // this thread ran (another thread's may have recorded it).
        if let Err(e) = s.ctx.check_err() {
            s.error(&format!("a driver error recorded during task {i} (or beside it): {e}"));
        }
    }
}

/// A block handed from one cumem stream to another and freed there; the
/// next block of its size on the first stream must wait for the second.
fn rust_cross_stream(s: &Soak, rng: &mut Rng) -> Res {
    let s1 = Stream::new().map_err(err("Stream::new"))?;
    let s2 = Stream::new().map_err(err("Stream::new"))?;
    let (c1, c2) = (s1.cudarc().unwrap().clone(), s2.cudarc().unwrap().clone());
    let mm = s.mm;
    for _ in 0..rng.range(1, 4) {
        let n = rng.range(64, s.max_values);
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
    if rng.next() % 2 == 0 {
        s1.synchronize().map_err(err("synchronize"))?;
    }
    Ok(())
}

/// The C ABI with a stream of `cumem_stream_create` and a raw stream made
/// outside cumem (`cuStreamCreate`), destroyed after `cumem_stream_forget`.
fn c_abi_streams(s: &Soak, rng: &mut Rng) -> Res {
    let mut owned: CumemStream = std::ptr::null_mut();
    // SAFETY: `owned` is valid for a write.
    c(unsafe { cumem_c::cumem_stream_create(&mut owned) }, "cumem_stream_create")?;
    let mut raw: sys::CUstream = std::ptr::null_mut();
    // SAFETY: `raw` is valid for a write; the context is current.
    unsafe { sys::cuStreamCreate(&mut raw, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) }
        .result()
        .map_err(err("cuStreamCreate"))?;
    let r = c_abi_work(s, rng, owned, raw as CumemStream);
    // Both streams go: synchronised first (their frees' work is done).
    let done = c(cumem_c::cumem_stream_synchronize(owned), "cumem_stream_synchronize")
        .and_then(|_| c(cumem_c::cumem_stream_destroy(owned), "cumem_stream_destroy"));
    // SAFETY: `raw` is a stream this task made; nothing else uses it.
    let gone = unsafe { sys::cuStreamSynchronize(raw) }
        .result()
        .map_err(err("cuStreamSynchronize"))
        .and_then(|_| c(cumem_c::cumem_stream_forget(raw as CumemStream), "cumem_stream_forget"))
        // SAFETY: as above; cumem was told it is gone.
        .and_then(|_| unsafe { sys::cuStreamDestroy_v2(raw) }.result().map_err(err("cuStreamDestroy")));
    r.and(done).and(gone)
}

fn c_abi_work(s: &Soak, rng: &mut Rng, owned: CumemStream, foreign: CumemStream) -> Res {
    let n = rng.range(64, s.max_values);
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
    // SAFETY: cumem handed out `bytes` pinned, 256-aligned bytes; ours alone.
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
    let seed = rng.next() as u32;
    let mut g = GrowableBuffer::<u32>::with_capacity_for(&stream, rng.range(1, 1 << 16)).map_err(err("growable"))?;
    let total = rng.range(1024, s.max_values * 2);
    let mut written = 0;
    while written < total {
        let step = rng.range(1, (total - written).min(1 << 20) + 1);
        let part: Vec<u32> = (written..written + step).map(|i| pattern(seed, i)).collect();
        g.extend_from_host(&part).map_err(err("extend_from_host"))?;
        written += step;
    }
    // Every value and the length.
    let verify = |g: &GrowableBuffer<u32>, what: &str, len: usize| -> Res {
        let seen = g.to_vec().map_err(err("growable to_vec"))?;
        check(s, what, &seen, seed, 0);
        s.wrong_values(&format!("{what}'s length"), usize::from(seen.len() != len));
        Ok(())
    };
    verify(&g, "a growable buffer", total)?;
    let keep = rng.range(1, total);
    g.truncate(keep);
    g.shrink_to_fit().map_err(err("shrink_to_fit"))?;
    verify(&g, "a shrunk growable buffer", keep)
}

/// Pinned vectors grown by pushes, and a device round trip through them.
fn pinned(s: &Soak, rng: &mut Rng) -> Res {
    let seed = rng.next() as u32;
    let n = rng.range(16, s.max_values);
    let mut v: PinnedVec<u32> = PinnedVec::new_in(PinnedAlloc);
    for i in 0..n {
        v.push(pattern(seed, i));
    }
    check(s, "a pinned vector", &v, seed, 0);
    let stream = Stream::new().map_err(err("Stream::new"))?;
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
    let n = rng.range(16, s.max_values / 4);
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
