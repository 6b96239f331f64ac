//! Many threads hammer one pinned pool (host fallback: mmap'd memory the
//! test can write) and its per-thread caches: random sizes, random frees,
//! some blocks freed by another thread (so into another thread's cache or
//! the pool). Every block carries a pattern unique to it, checked before
//! it is freed, so overlapping blocks are caught; at the end the
//! statistics must balance and every chunk go back.
//!
//! `CUMEM_STRESS_OPS` sets the operations per thread (default 100,000).

use std::ptr::NonNull;
use std::sync::{Arc, Barrier};

use crossbeam::channel::{unbounded, Receiver, Sender};
use cumem::{BackendChoice, Config, MemoryManager};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const THREADS: usize = 16;
const MAX_LIVE: usize = 64;
/// Largest request (log-uniform sizes from 1 B).
const MAX_SIZE: f64 = (256 << 10) as f64;

/// A live block and what it must hold.
struct Block {
    ptr: NonNull<u8>,
    size: usize,
    /// Owner thread and serial number: unique per block.
    tag: u64,
}

// SAFETY: a block is plain memory owned by whoever holds this handle; the
// handle moves to the thread that frees it.
unsafe impl Send for Block {}

fn fill_byte(tag: u64) -> u8 {
    (tag.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8 | 1
}

impl Block {
    fn fill(&self) {
        let p = self.ptr.as_ptr();
        // SAFETY: the pool handed out `size` bytes at `ptr` to this block
        // alone; the host fallback's pinned memory is ordinary memory.
        unsafe {
            p.write_bytes(fill_byte(self.tag), self.size);
            if self.size >= 16 {
                p.cast::<u64>().write_unaligned(self.tag);
                p.add(self.size - 8).cast::<u64>().write_unaligned(!self.tag);
            }
        }
    }

    fn check(&self) {
        let p = self.ptr.as_ptr();
        // SAFETY: as in `fill`: the block is still ours.
        let bytes = unsafe { std::slice::from_raw_parts(p, self.size) };
        let (lo, hi) = if self.size >= 16 { (8, self.size - 8) } else { (0, self.size) };
        let want = fill_byte(self.tag);
        // Every byte of small blocks, every 61st of larger ones.
        let stride = if self.size <= 4096 { 1 } else { 61 };
        for i in (lo..hi).step_by(stride).chain((hi > lo).then(|| hi - 1)) {
            assert_eq!(
                bytes[i], want,
                "block {:#x}+{} (tag {:#x}) overwritten at {i}",
                p as usize, self.size, self.tag
            );
        }
        if self.size >= 16 {
            // SAFETY: as above; 16 bytes or more.
            let (head, tail) =
                unsafe { (p.cast::<u64>().read_unaligned(), p.add(self.size - 8).cast::<u64>().read_unaligned()) };
            assert_eq!(
                (head, tail),
                (self.tag, !self.tag),
                "block {:#x}+{} header/trailer overwritten",
                p as usize,
                self.size
            );
        }
    }
}

fn free(mm: &MemoryManager, b: Block) {
    b.check();
    mm.free_pinned(b.ptr.as_ptr()).expect("free of a live block");
}

fn worker(mm: &MemoryManager, id: usize, ops: usize, inbox: Receiver<Block>, peers: &[Sender<Block>], done: &Barrier) {
    let mut rng = SmallRng::seed_from_u64(0x5EED + id as u64);
    let mut live: Vec<Block> = Vec::new();
    let mut serial = 0u64;
    for _ in 0..ops {
        while let Ok(b) = inbox.try_recv() {
            free(mm, b);
        }
        if live.is_empty() || (live.len() < MAX_LIVE && rng.gen_bool(0.5)) {
            let size = (rng.gen_range(0.0..MAX_SIZE.ln()).exp() as usize).max(1);
            let ptr = mm.allocate_pinned(size).expect("allocation");
            assert_eq!(ptr.as_ptr() as usize % 256, 0);
            serial += 1;
            let b = Block { ptr, size, tag: (id as u64) << 48 | serial };
            b.fill();
            live.push(b);
        } else {
            let b = live.swap_remove(rng.gen_range(0..live.len()));
            if rng.gen_bool(0.1) {
                // Cross-thread free: another thread checks and frees it.
                let to = rng.gen_range(0..peers.len());
                peers[to].send(b).expect("peer alive");
            } else {
                free(mm, b);
            }
        }
    }
    for b in live {
        free(mm, b);
    }
    // Nobody sends after this barrier: drain what was sent here.
    done.wait();
    while let Ok(b) = inbox.try_recv() {
        free(mm, b);
    }
}

#[test]
fn sixteen_threads_random_operations_on_the_pinned_pool() {
    let ops: usize = std::env::var("CUMEM_STRESS_OPS").ok().and_then(|v| v.parse().ok()).unwrap_or(100_000);
    let mm = Arc::new(MemoryManager::new(Config::new().backend(BackendChoice::Host)).unwrap());
    let (senders, receivers): (Vec<_>, Vec<_>) = (0..THREADS).map(|_| unbounded::<Block>()).unzip();
    let senders = Arc::new(senders);
    let done = Arc::new(Barrier::new(THREADS));
    // Plain threads, joined: `join` returns after the thread-local
    // destructors (which flush the thread caches) ran; a scope may not.
    let threads: Vec<_> = receivers
        .into_iter()
        .enumerate()
        .map(|(id, inbox)| {
            let (mm, senders, done) = (mm.clone(), senders.clone(), done.clone());
            std::thread::spawn(move || worker(&mm, id, ops, inbox, &senders, &done))
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let st = mm.pinned_stats();
    assert_eq!((st.in_use, st.requested, st.live_blocks), (0, 0, 0), "{st:?}");
    assert_eq!(st.allocations, st.frees, "{st:?}");
    mm.pinned_pool().check_invariants().unwrap();
    mm.release_cached().unwrap();
    let st = mm.pinned_stats();
    assert_eq!((st.reserved, st.cached, st.chunks), (0, 0, 0), "{st:?}");
}
