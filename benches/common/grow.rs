//! Growing a buffer by doubling: cumem's GrowableBuffer (no copy) against
//! allocate-bigger-and-copy (`cuMemAlloc` + `cuMemcpyDtoD` + `cuMemFree`;
//! on the host fallback `mmap` + `memcpy` + `munmap`). Shared by the bench
//! and the example.

#![allow(dead_code)]

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

    /// 2 MiB, 4 MiB, ... up to `limit` (and `max_size`).
    pub fn sizes(&self, limit: usize) -> Vec<usize> {
        std::iter::successors(Some(2 * MIB), |s| Some(s * 2)).take_while(|s| *s <= self.max_size.min(limit)).collect()
    }

    fn sync(&self) {
        if let Some(ctx) = &self.ctx {
            ctx.synchronize().expect("cuCtxSynchronize");
        }
    }

    /// Grows a GrowableBuffer from 2 MiB to each size in turn; returns the
    /// time of each growth and its path.
    pub fn doubling_cumem(&self, sizes: &[usize]) -> Vec<(Duration, GrowPath)> {
        let mut buf = GrowableBuffer::<u8>::with_capacity_on(self.backend.clone(), sizes[0]).expect("with_capacity");
        self.touch_cumem(&buf, 0, sizes[0]);
        let mut out = Vec::new();
        let mut prev = sizes[0];
        for &size in &sizes[1..] {
            let t = Instant::now();
            let path = buf.grow(size).expect("GrowableBuffer::grow");
            self.sync();
            out.push((t.elapsed(), path));
            self.touch_cumem(&buf, prev, size);
            prev = size;
        }
        out
    }

    /// On the host, writes the new half so the next growth moves real
    /// pages, as the copying method must copy real bytes.
    fn touch_cumem(&self, buf: &GrowableBuffer<u8>, from: usize, to: usize) {
        if self.ctx.is_none() {
            // SAFETY: on the host backend the buffer's first `to` bytes are
            // committed memory that nothing else references.
            unsafe { std::ptr::write_bytes((buf.device_ptr() as usize + from) as *mut u8, 1, to - from) };
        }
    }

    /// The same growths by allocating a new buffer, copying the old
    /// contents and freeing the old buffer; the time of each.
    pub fn doubling_copy(&self, sizes: &[usize]) -> Vec<Duration> {
        let mut out = Vec::new();
        let mut cur = self.raw_alloc(sizes[0]);
        self.raw_touch(cur, 0, sizes[0]);
        let mut prev = sizes[0];
        for &size in &sizes[1..] {
            let t = Instant::now();
            let next = self.raw_alloc(size);
            self.raw_copy(next, cur, prev);
            self.raw_free(cur, prev);
            self.sync();
            out.push(t.elapsed());
            self.raw_touch(next, prev, size);
            cur = next;
            prev = size;
        }
        self.raw_free(cur, prev);
        out
    }

    fn raw_alloc(&self, size: usize) -> u64 {
        match &self.ctx {
            Some(ctx) => {
                ctx.bind_to_thread().expect("bind");
                let mut p = 0;
                // SAFETY: `p` is a valid out-pointer.
                unsafe { sys::cuMemAlloc_v2(&mut p, size) }.result().expect("cuMemAlloc");
                p
            }
            None => {
                // SAFETY: a fresh anonymous mapping aliases nothing.
                let p = unsafe {
                    libc::mmap(
                        std::ptr::null_mut(),
                        size,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                        -1,
                        0,
                    )
                };
                assert_ne!(p, libc::MAP_FAILED, "mmap");
                p as u64
            }
        }
    }

    fn raw_copy(&self, dst: u64, src: u64, bytes: usize) {
        match &self.ctx {
            // SAFETY: both are live allocations of at least `bytes` bytes.
            Some(_) => unsafe { sys::cuMemcpyDtoD_v2(dst, src, bytes) }.result().expect("cuMemcpyDtoD"),
            // SAFETY: both are live, distinct mappings of at least `bytes`.
            None => unsafe { std::ptr::copy_nonoverlapping(src as usize as *const u8, dst as usize as *mut u8, bytes) },
        }
    }

    fn raw_free(&self, p: u64, size: usize) {
        match &self.ctx {
            // SAFETY: `p` came from cuMemAlloc and is freed once.
            Some(_) => unsafe { sys::cuMemFree_v2(p) }.result().expect("cuMemFree"),
            None => {
                // SAFETY: `p` came from mmap of `size` bytes, unmapped once.
                assert_eq!(unsafe { libc::munmap(p as usize as *mut libc::c_void, size) }, 0);
            }
        }
    }

    fn raw_touch(&self, p: u64, from: usize, to: usize) {
        if self.ctx.is_none() {
            // SAFETY: a live mapping of at least `to` bytes.
            unsafe { std::ptr::write_bytes((p as usize + from) as *mut u8, 1, to - from) };
        }
    }

    /// Runs both methods `reps` times over all sizes and prints, per size,
    /// the median time of the growth that reached it and the ratio.
    pub fn print_table(&self, reps: usize) {
        let sizes = self.sizes(usize::MAX);
        println!(
            "growing by doubling on {} (2 MiB .. {} MiB), median of {reps} runs",
            self.backend,
            self.max_size / MIB
        );
        let copy_name = if self.ctx.is_some() { "cuMemAlloc+DtoD+Free" } else { "mmap+memcpy+munmap" };
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
