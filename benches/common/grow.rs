//! Growing a buffer by doubling: cumem's GrowableBuffer (no copy) against
//! allocate-bigger-and-copy (`cuMemAlloc` + `cuMemcpyDtoD` + `cuMemFree`;
//! on the host fallback a heap allocation, `memcpy` and a free). Shared by
//! the bench and the example.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaContext};
use cumem::{GrowPath, GrowableBuffer, VmBackend};

pub const MIB: usize = 1 << 20;

/// Where the comparison runs.
pub struct Env {
    pub backend: VmBackend,
    pub ctx: Option<Arc<CudaContext>>,
    /// The largest size the doubling reaches.
    pub max_size: usize,
}

impl Env {
    /// The automatic backend; the largest size is 16 GiB on the GPU (or
    /// less, so the copying method's old + new buffers fit in 80% of free
    /// memory) and 1 GiB on the host.
    pub fn new() -> Env {
        let backend = VmBackend::auto();
        let ctx = match backend {
            VmBackend::Cuda(ordinal) => cumem::cuda::device_context(ordinal).ok().flatten(),
            VmBackend::Host => None,
        };
        let max_size = match &ctx {
            Some(ctx) => {
                let (free, _) = cumem::cuda::vmm::memory_info(ctx).expect("cuMemGetInfo");
                let mut max = 2 * MIB;
                while max * 2 <= 16 << 30 && max * 2 * 3 / 2 <= free / 10 * 8 {
                    max *= 2;
                }
                max
            }
            None => 1 << 30,
        };
        Env { backend, ctx, max_size }
    }

    /// Grows a GrowableBuffer from the first size to each next one in
    /// turn; returns the time of each growth and its path. On the host the
    /// new part is written after each growth, so the next one moves real
    /// pages, as the copying method copies real bytes.
    pub fn doubling_cumem(&self, sizes: &[usize]) -> Vec<(Duration, GrowPath)> {
        let mut buf = GrowableBuffer::<u8>::with_capacity_on(self.backend.clone(), sizes[0]).expect("with_capacity");
        let touch = |buf: &GrowableBuffer<u8>, from: usize, to: usize| {
            if self.ctx.is_none() {
                // SAFETY: on the host backend the buffer's first `to` bytes
                // are committed memory that nothing else references.
                unsafe { std::ptr::write_bytes((buf.device_ptr() as usize + from) as *mut u8, 1, to - from) };
            }
        };
        touch(&buf, 0, sizes[0]);
        let grow = |w: &[usize]| {
            let t = Instant::now();
            let path = buf.grow(w[1]).expect("GrowableBuffer::grow");
            if let Some(ctx) = &self.ctx {
                ctx.synchronize().expect("cuCtxSynchronize");
            }
            let took = (t.elapsed(), path);
            touch(&buf, w[0], w[1]);
            took
        };
        sizes.windows(2).map(grow).collect()
    }

    /// The same growths by allocating a new buffer, copying the old
    /// contents and freeing the old buffer; the time of each.
    pub fn doubling_copy(&self, sizes: &[usize]) -> Vec<Duration> {
        let Some(ctx) = &self.ctx else {
            let mut cur = vec![1u8; sizes[0]];
            let grow = |w: &[usize]| {
                let t = Instant::now();
                let mut next = Vec::with_capacity(w[1]);
                next.extend_from_slice(&cur);
                cur = next;
                let took = t.elapsed();
                cur.resize(w[1], 1);
                took
            };
            return sizes.windows(2).map(grow).collect();
        };
        ctx.bind_to_thread().expect("bind");
        let alloc = |size| {
            let mut p = 0;
            // SAFETY: `p` is a valid out-pointer; the context is current.
            unsafe { sys::cuMemAlloc_v2(&mut p, size) }.result().expect("cuMemAlloc");
            p
        };
        let mut cur = alloc(sizes[0]);
        let grow = |w: &[usize]| {
            let t = Instant::now();
            let next = alloc(w[1]);
            // SAFETY: both are live allocations of at least `w[0]` bytes;
            // `cur` came from cuMemAlloc and is freed once.
            unsafe { sys::cuMemcpyDtoD_v2(next, cur, w[0]).result().and_then(|_| sys::cuMemFree_v2(cur).result()) }
                .expect("cuMemcpyDtoD, cuMemFree");
            ctx.synchronize().expect("cuCtxSynchronize");
            cur = next;
            t.elapsed()
        };
        let out = sizes.windows(2).map(grow).collect();
        // SAFETY: `cur` came from cuMemAlloc and is freed once.
        unsafe { sys::cuMemFree_v2(cur) }.result().expect("cuMemFree");
        out
    }

    /// Runs both methods `reps` times from 2 MiB to the largest size; prints
    /// per size the median time of the growth that reached it, and the ratio.
    pub fn print_table(&self, reps: usize) {
        let sizes: Vec<usize> =
            std::iter::successors(Some(2 * MIB), |s| Some(s * 2)).take_while(|s| *s <= self.max_size).collect();
        println!(
            "growing by doubling on {} (2 MiB .. {} MiB), median of {reps} runs",
            self.backend,
            self.max_size / MIB
        );
        let copy_name = if self.ctx.is_some() { "cuMemAlloc+DtoD+Free" } else { "alloc+memcpy+free" };
        let mut cumem: Vec<Vec<(Duration, GrowPath)>> = vec![Vec::new(); sizes.len() - 1];
        let mut copy: Vec<Vec<Duration>> = vec![Vec::new(); sizes.len() - 1];
        for _ in 0..reps {
            for (i, r) in self.doubling_cumem(&sizes).into_iter().enumerate() {
                cumem[i].push(r);
            }
            for (i, d) in self.doubling_copy(&sizes).into_iter().enumerate() {
                copy[i].push(d);
            }
        }
        println!(
            "{:>10} {:>16} {:>22} {:>8}  cumem path",
            "size MiB",
            "cumem ns/grow",
            format!("{copy_name} ns"),
            "ratio"
        );
        for (i, size) in sizes[1..].iter().enumerate() {
            let mut c: Vec<Duration> = cumem[i].iter().map(|r| r.0).collect();
            let mut k = copy[i].clone();
            c.sort();
            k.sort();
            let (c, k) = (c[c.len() / 2].as_nanos(), k[k.len() / 2].as_nanos());
            let paths: Vec<GrowPath> = cumem[i].iter().map(|r| r.1).collect();
            println!("{:>10} {:>16} {:>22} {:>8.2}  {:?}", size / MIB, c, k, k as f64 / c.max(1) as f64, paths);
        }
    }
}
