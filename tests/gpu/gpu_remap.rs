//! GPU test of page remapping (issue 14): a device pool over CUDA VMM
//! moves physical pages from free space to where allocations land, while
//! kernels write every live block and check it after each move. Skips with
//! a printed reason without a GPU; fails instead under
//! `CUMEM_REQUIRE_GPU=1`.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use cumem::device::gpu_for_test;
use cumem::pool::{Pool, PoolConfig, StreamTag};
use cumem::upstream::{Chunk, CudaVmm, Queued, Upstream};
use cumem::PoolKind;

const KERNELS: &str = r#"
extern "C" __global__ void fill(unsigned int* p, unsigned int v, unsigned long long n, long long cycles) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) p[i] = v + (unsigned int)i;
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
extern "C" __global__ void check(const unsigned int* p, unsigned int v, unsigned long long n,
                                 unsigned long long* bad) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n && p[i] != v + (unsigned int)i) atomicAdd(bad, 1ULL);
}
"#;

struct Kernels {
    stream: Arc<CudaStream>,
    fill: CudaFunction,
    check: CudaFunction,
}

impl Kernels {
    fn new(ctx: &Arc<CudaContext>) -> Self {
        let ptx = cudarc::nvrtc::compile_ptx(KERNELS).expect("NVRTC compiles the test kernels");
        let m = ctx.load_module(ptx).expect("the module loads");
        Kernels {
            stream: ctx.new_stream().expect("a stream"),
            fill: m.load_function("fill").expect("fill"),
            check: m.load_function("check").expect("check"),
        }
    }

    fn cfg(words: usize) -> LaunchConfig {
        LaunchConfig::for_num_elems(words as u32)
    }

    /// Queues a write of `v + i` into every word of the block; the kernel
    /// then spins for `cycles` so that later frees race with it.
    fn fill(&self, addr: usize, size: usize, v: u32, cycles: i64) {
        let (p, n) = (addr as u64, (size / 4) as u64);
        let mut launch = self.stream.launch_builder(&self.fill);
        launch.arg(&p).arg(&v).arg(&n).arg(&cycles);
        // SAFETY: the kernel's signature matches; the block holds `n` words
        // and stays allocated until the work on the stream is done (frees
        // carry the stream's tag, so its pages move only after it).
        unsafe { launch.launch(Self::cfg(size / 4)) }.expect("fill launches");
    }

    /// The number of words of every block that do not hold their value.
    fn mismatches(&self, blocks: &[(usize, usize, u32)]) -> u64 {
        let mut bad = self.stream.alloc_zeros::<u64>(1).expect("a counter");
        for &(addr, size, v) in blocks {
            let (p, n) = (addr as u64, (size / 4) as u64);
            let mut launch = self.stream.launch_builder(&self.check);
            launch.arg(&p).arg(&v).arg(&n).arg(&mut bad);
            // SAFETY: as in `fill`; `bad` is one u64 on this device.
            unsafe { launch.launch(Self::cfg(size / 4)) }.expect("check launches");
        }
        self.stream.clone_dtoh(&bad).expect("the count comes back")[0]
    }
}

#[test]
fn every_block_keeps_its_contents_across_remaps() {
    let Some(ctx) = gpu_for_test("every_block_keeps_its_contents_across_remaps") else { return };
    let s = waves(&ctx, Mode::Plain);
    assert!(s.unmap_calls > 0, "no page moved: the test checked nothing");
}

/// The default configuration with the pool told which frees' work
/// completed: a move lends such memory (mapped at its new place while
/// its old place is still mapped) and the mapper thread unmaps the old
/// places, while kernels write and check the live blocks.
#[test]
fn lent_memory_moves_and_live_blocks_keep_their_contents() {
    let Some(ctx) = gpu_for_test("lent_memory_moves_and_live_blocks_keep_their_contents") else { return };
    let before = cumem::cuda::vmm::driver_calls();
    let s = waves(&ctx, Mode::Lend);
    let calls = cumem::cuda::vmm::driver_calls().since(&before);
    println!("lent moves: allocating thread {:?}, behind it {:?}", calls.allocating, calls.background);
    assert!(s.unmap_calls > 0, "no page moved: the test checked nothing");
    assert!(calls.background.unmap > 0, "no old mapping was unmapped behind the allocating thread");
    // The time spent in those calls is counted by kind on the thread
    // that made them.
    let (map, unmap) = (cumem::cuda::vmm::CallKind::Map as usize, cumem::cuda::vmm::CallKind::Unmap as usize);
    assert!(calls.allocating.ns[map] > 0, "the allocating thread's maps took no time: {:?}", calls.allocating);
    assert!(calls.background.ns[unmap] > 0, "the mapper's unmaps took no time: {:?}", calls.background);
    assert!(calls.allocating.total_ns() >= calls.allocating.ns[map]);
}

/// How [`waves`] runs the pool.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    /// The default configuration, no word on which frees' work completed:
    /// memory moves after the device is waited for.
    Plain,
    /// The default configuration with no slack and an oracle: moves lend
    /// memory whose work completed.
    Lend,
}

/// Waves of blocks written by kernels and checked after every wave (see
/// the tests); but for [`Mode::Plain`], an oracle says which frees' work
/// completed (the waves synchronise the stream before each check).
fn waves(ctx: &Arc<CudaContext>, mode: Mode) -> cumem::pool::PoolStats {
    let oracle = mode != Mode::Plain;
    let vmm = CudaVmm::with_reservation(ctx.ordinal(), 16 << 30).expect("a VMM reservation");
    let page = cumem::upstream::Upstream::granularity(&vmm);
    let mut pc = PoolConfig::new(PoolKind::Device);
    pc.thread_cache = false;
    if oracle {
        pc.remap_slack_ppm = 0;
    }
    let pool = Pool::new(vmm, pc);
    let done = Arc::new(std::sync::atomic::AtomicU64::new(0));
    if oracle {
        let d = done.clone();
        pool.set_tag_oracle(Arc::new(move |t: StreamTag| t.seq <= d.load(std::sync::atomic::Ordering::Acquire)));
    }
    let k = Kernels::new(ctx);
    let tag_stream = 7u64;
    let mut seq = 0u64;
    let mut live: Vec<(usize, usize, u32)> = Vec::new();
    let mut value = 1u32;
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    for wave in 0..24usize {
        // Each wave's large block is larger than any free block before it
        // (the range grows), a small block after it pins the top, and small
        // random blocks come and go around them.
        let big = pool.allocate((wave + 1) * 3 * page + 4096, 256).expect("big block");
        k.fill(big.addr, big.size, value, 200_000);
        live.push((big.addr, big.size, value));
        value += 1;
        for _ in 0..8 {
            let size = 256usize << (next() % 14);
            let a = pool.allocate(size, 256).expect("small block");
            k.fill(a.addr, a.size, value, 0);
            live.push((a.addr, a.size, value));
            value += 1;
        }
        // Free the large block and some small ones on the stream, while the
        // kernels that wrote them may still run: their pages may move only
        // after that work.
        let mut keep = Vec::new();
        for (i, b) in live.drain(..).enumerate() {
            if b.0 == big.addr || (i % 3 == 0 && b.1 < page) {
                seq += 1;
                pool.deallocate(b.0, StreamTag { stream: tag_stream, seq }).expect("free");
            } else {
                keep.push(b);
            }
        }
        live = keep;
        let bad = k.mismatches(&live);
        assert_eq!(bad, 0, "wave {wave}: {bad} words of live blocks changed across remaps");
        // The check synchronised the stream: every free so far is settled.
        done.store(seq, std::sync::atomic::Ordering::Release);
    }
    if mode == Mode::Lend {
        // The old mappings go behind the allocating thread: wait for them,
        // write every live block anew and check it.
        let start = std::time::Instant::now();
        while cumem::upstream::Upstream::has_stale(pool.upstream())
            && start.elapsed() < std::time::Duration::from_secs(2)
        {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(!cumem::upstream::Upstream::has_stale(pool.upstream()), "old mappings stayed for 2 s");
        for &(addr, size, v) in &live {
            k.fill(addr, size, v, 0);
        }
        let bad = k.mismatches(&live);
        assert_eq!(bad, 0, "after the old mappings went: {bad} words of live blocks changed");
    }
    let s = pool.stats();
    println!(
        "remap test ({mode:?}): physical peak {} MiB, address space {} MiB, {} map and {} unmap calls",
        s.peak_mapped >> 20,
        s.reserved >> 20,
        s.map_calls,
        s.unmap_calls
    );
    assert!(s.peak_mapped < s.reserved, "physical memory should stay below the address space");
    for (addr, _, _) in live {
        pool.deallocate(addr, StreamTag::NONE).expect("free");
    }
    k.stream.synchronize().expect("the stream finishes");
    drop(pool);
    s
}

const HOLD: &str = r#"
extern "C" __global__ void hold(const volatile unsigned int* flag, unsigned long long limit_ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (*flag == 0 && now - start < limit_ns);
}
extern "C" __global__ void fill(unsigned int* p, unsigned int v, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) p[i] = v + (unsigned int)i;
}
"#;

/// A flag in pinned host memory that a kernel reads (unified addressing:
/// its host address is its device address).
struct Flag(*mut u32);

impl Flag {
    fn new() -> Self {
        let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: `p` is a valid out-pointer; 4 bytes of mapped pinned memory.
        unsafe { cudarc::driver::sys::cuMemHostAlloc(&mut p, 4, cudarc::driver::sys::CU_MEMHOSTALLOC_DEVICEMAP) }
            .result()
            .expect("pinned memory for the flag");
        // SAFETY: the allocation holds 4 bytes, suitably aligned.
        unsafe { std::ptr::write_volatile(p.cast::<u32>(), 0) };
        Flag(p.cast())
    }
    fn set(&self) {
        // SAFETY: the allocation is live until drop; the kernel only reads it.
        unsafe { std::ptr::write_volatile(self.0, 1) };
    }
}

impl Drop for Flag {
    fn drop(&mut self) {
        // SAFETY: allocated by `cuMemHostAlloc` above; the kernels that
        // read it finished (the stream was synchronised).
        let _ = unsafe { cudarc::driver::sys::cuMemFreeHost(self.0.cast()) };
    }
}

/// Whether work is still queued on `s` (`cuStreamQuery`).
fn busy(s: &cumem::Stream) -> bool {
    let cu = s.cudarc().expect("a CUDA stream").cu_stream();
    // SAFETY: the stream is alive (held by `s`); the call only asks.
    let rc = unsafe { cudarc::driver::sys::cuStreamQuery(cu) };
    rc == cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY
}

/// A move of memory freed on the requesting stream, through a manager
/// built from `CUMEM_CONF` as a program builds it: a kernel holds the
/// stream (until the host sets a flag, 2 s at most), the blocks freed
/// behind it are still written through their old addresses, and a large
/// request on the same stream takes their memory. The move waits for no
/// device (the pool counts no wait; the stream is normally still busy
/// when the allocation returns, which is printed). Then the old writes
/// run, then a fill of the new block; the new block holds the fill, the
/// blocks that stayed hold theirs, and the mapper thread unmaps the old
/// places once the fence passed.
#[test]
fn memory_freed_on_the_requesting_stream_moves_with_no_device_wait() {
    let Some(ctx) = gpu_for_test("memory_freed_on_the_requesting_stream_moves_with_no_device_wait") else { return };
    fenced_move(&ctx, Request::Same);
}

/// The same with the blocks freed on one stream (held by the kernel) and
/// the request on another: the fence is on the freeing stream, and the
/// requesting stream waits for it on the device, so its fill of the new
/// block runs after the old writes through the old addresses (a fill run
/// before them would be overwritten: the check sees it).
#[test]
fn memory_freed_on_another_stream_moves_behind_a_fence_there() {
    let Some(ctx) = gpu_for_test("memory_freed_on_another_stream_moves_behind_a_fence_there") else { return };
    fenced_move(&ctx, Request::Other);
}

/// The same with neighbouring blocks freed on two held streams (their
/// free blocks merge and name no one stream) and the request on a third:
/// the fence covers both streams.
#[test]
fn memory_of_blocks_freed_on_two_streams_moves_behind_fences_on_both() {
    let Some(ctx) = gpu_for_test("memory_of_blocks_freed_on_two_streams_moves_behind_fences_on_both") else { return };
    fenced_move(&ctx, Request::TwoStreams);
}

/// The same with the request on a stream that has never freed (a
/// program's new stream whose first allocation must move memory): the
/// fence still orders it, with no wait for the device.
#[test]
fn memory_moves_behind_a_fence_for_a_stream_that_never_freed() {
    let Some(ctx) = gpu_for_test("memory_moves_behind_a_fence_for_a_stream_that_never_freed") else { return };
    fenced_move(&ctx, Request::Fresh);
}

/// Where [`fenced_move`] frees and requests.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Request {
    /// Freed on one stream, requested on it.
    Same,
    /// Freed on one stream, requested on another.
    Other,
    /// Freed on one stream, requested on another that has never freed.
    Fresh,
    /// Neighbours freed on two streams, requested on a third.
    TwoStreams,
}

/// The tests above.
fn fenced_move(ctx: &Arc<CudaContext>, request: Request) {
    let ordinal = ctx.ordinal();
    let config = cumem::Config::from_env().expect("CUMEM_CONF parses").device(ordinal).remap_slack_ppm(0);
    let mm = cumem::MemoryManager::new(config).expect("a manager");
    let new_stream = || cumem::Stream::from_cudarc(ctx.new_stream().expect("a stream"));
    let stream = new_stream();
    let second = new_stream();
    let user = if request == Request::Same { stream.clone() } else { new_stream() };
    let ptx = cudarc::nvrtc::compile_ptx(HOLD).expect("NVRTC compiles the test kernels");
    let m = ctx.load_module(ptx).expect("the module loads");
    let (hold, fill) = (m.load_function("hold").unwrap(), m.load_function("fill").unwrap());
    let launch_fill = |s: &cumem::Stream, p: u64, bytes: usize, v: u32| {
        let n = (bytes / 4) as u64;
        let mut l = s.cudarc().expect("a CUDA stream").launch_builder(&fill);
        l.arg(&p).arg(&v).arg(&n);
        // SAFETY: the arguments match the kernel; `p` holds `n` words
        // while the work on the stream runs (frees are ordered on it).
        unsafe { l.launch(LaunchConfig::for_num_elems(n as u32)) }.expect("fill launches");
    };
    const PIECE: usize = 32 << 20;
    // The requesting stream has freed before, as in a program that has
    // run a while on it (but for `Fresh`).
    if request != Request::Fresh {
        let first = mm.allocate_device_on(4096, &user).expect("a small block");
        mm.free_device_on(first, &user).expect("its free");
        user.synchronize().unwrap();
    }
    let blocks: Vec<u64> = (0..16).map(|_| mm.allocate_device_on(PIECE, &stream).expect("a block")).collect();
    for (i, &b) in blocks.iter().enumerate() {
        launch_fill(&stream, b, PIECE, 1000 * i as u32);
    }
    stream.synchronize().unwrap();
    // The freeing streams are held; the freed blocks are written after the
    // hold (through the addresses they have now) and freed there: the odd
    // ones on the first stream, or with two streams the second and third
    // of every four, one on each.
    let flag = Flag::new();
    let (fp, limit) = (flag.0 as u64, 2_000_000_000u64);
    let freeing: Vec<&cumem::Stream> =
        if request == Request::TwoStreams { vec![&stream, &second] } else { vec![&stream] };
    for s in &freeing {
        let mut l = s.cudarc().expect("a CUDA stream").launch_builder(&hold);
        l.arg(&fp).arg(&limit);
        // SAFETY: the arguments match the kernel; the flag outlives the work.
        unsafe { l.launch(LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 }) }
            .expect("hold launches");
    }
    let freed = |i: usize| match request {
        Request::TwoStreams => matches!(i % 4, 1 | 2).then(|| freeing[i % 4 - 1]),
        _ => (i % 2 == 1).then_some(freeing[0]),
    };
    for (i, &b) in blocks.iter().enumerate() {
        if let Some(s) = freed(i) {
            launch_fill(s, b, PIECE, 7);
            mm.free_device_on(b, s).expect("a free on the stream");
        }
    }
    let before = mm.device_stats(ordinal).expect("stats").pool;
    let calls = cumem::cuda::vmm::driver_calls();
    // No free block holds 8 pieces, and with no slack the memory moves.
    let big = mm.allocate_device_on(8 * PIECE, &user).expect("the large block");
    let still_held = freeing.iter().all(|s| busy(s));
    // Queued before the flag is set: on another stream it must wait for
    // the holds and the old writes all the same.
    launch_fill(&user, big, 8 * PIECE, 55);
    flag.set();
    let after = mm.device_stats(ordinal).expect("stats").pool;
    for s in [&user, &stream, &second] {
        s.synchronize().expect("the streams' work completes");
    }
    assert!(after.unmap_calls > before.unmap_calls, "no memory moved: the test checked nothing");
    assert!(after.peak_mapped <= 16 * PIECE + PIECE, "memory grew instead of moving: {} MiB", after.peak_mapped >> 20);
    assert_eq!(after.move_waits, before.move_waits, "the move waited for the device");
    println!(
        "the freeing streams were {} when the allocation returned",
        if still_held { "still busy" } else { "idle" }
    );
    // Every word of the new block holds the fill queued after the old writes.
    let mut host = vec![0u32; 8 * PIECE / 4];
    // SAFETY: `host` holds the block's bytes; the streams were synchronised.
    unsafe { cudarc::driver::sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), big, 8 * PIECE) }.result().unwrap();
    let bad = host.iter().enumerate().filter(|&(i, &w)| w != 55u32.wrapping_add(i as u32)).count();
    assert_eq!(bad, 0, "{bad} words of the new block lost the fill");
    for (i, &b) in blocks.iter().enumerate().filter(|&(i, _)| freed(i).is_none()) {
        let mut w = vec![0u32; PIECE / 4];
        // SAFETY: as above, for a live block.
        unsafe { cudarc::driver::sys::cuMemcpyDtoH_v2(w.as_mut_ptr().cast(), b, PIECE) }.result().unwrap();
        let v = 1000 * i as u32;
        let bad = w.iter().enumerate().filter(|&(j, &x)| x != v.wrapping_add(j as u32)).count();
        assert_eq!(bad, 0, "block {i}: {bad} words changed");
    }
    // The old places go behind the allocating thread once the work passed.
    let start = std::time::Instant::now();
    while cumem::cuda::vmm::driver_calls().since(&calls).background.unmap == 0
        && start.elapsed() < std::time::Duration::from_secs(2)
    {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let c = cumem::cuda::vmm::driver_calls().since(&calls);
    println!("fenced move: allocating thread {:?}, behind it {:?}", c.allocating, c.background);
    assert!(c.background.unmap > 0, "the old places were never unmapped behind the allocating thread");
    mm.free_device_on(big, &user).unwrap();
    for (_, &b) in blocks.iter().enumerate().filter(|&(i, _)| freed(i).is_none()) {
        mm.free_device_on(b, &stream).unwrap();
    }
    for s in [&user, &stream, &second] {
        s.synchronize().unwrap();
    }
}

/// A fence the test passes by hand.
#[derive(Default)]
struct HandFence(std::sync::atomic::AtomicBool);

impl cumem::pool::Fence for HandFence {
    fn passed(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
    fn wait(&self) -> cumem::Result<()> {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }
}

/// A VMM upstream with `pages` pages of address space, the first 32 mapped
/// as two runs of 16; the address space, and where `pages` pages from the
/// `first` lie in it. `None` (the reason printed) without a GPU.
type PagesAt = Box<dyn Fn(usize, usize) -> Chunk>;
fn two_mapped_runs(name: &str, pages: usize) -> Option<(CudaVmm, Chunk, PagesAt)> {
    let ctx = gpu_for_test(name)?;
    let vmm = CudaVmm::new(ctx.ordinal()).expect("a VMM upstream");
    let page = vmm.granularity();
    let chunk = vmm.reserve_chunk(pages * page).expect("address space");
    let at = move |first: usize, pages: usize| Chunk { addr: chunk.addr + first * page, size: pages * page };
    vmm.map_runs(&[at(0, 16), at(16, 16)]).expect("memory mapped");
    Some((vmm, chunk, Box::new(at)))
}

/// Lent memory that is then released stays on the device while its old
/// mapping stays: the mapping goes with the release where no queued work
/// may use it, and, behind a fence, not before the fence has passed and
/// then with the next map (not whenever the mapper thread gets to it).
#[test]
fn released_lent_memory_leaves_the_device_once_its_old_mapping_may_go() {
    let name = "released_lent_memory_leaves_the_device_once_its_old_mapping_may_go";
    let Some((vmm, chunk, at)) = two_mapped_runs(name, 64) else { return };
    let (a, b) = (at(0, 16), at(16, 16));

    // No queued work may use `a`'s memory.
    let lent = vmm.lend_within(&[a], a.size, Queued::Nothing).expect("lent");
    assert_eq!(lent.iter().map(|c| c.size).sum::<usize>(), a.size);
    assert!(vmm.has_stale() && vmm.kept() == a.size);
    vmm.trim_kept(0);
    assert_eq!(vmm.kept(), 0);
    assert!(!vmm.has_stale(), "the old mapping of released memory stayed");

    // Work queued before a fence may use `b`'s memory.
    let fence = Arc::new(HandFence::default());
    let lent = vmm.lend_within(&[b], b.size, Queued::Before(fence.clone())).expect("lent");
    assert_eq!(lent.iter().map(|c| c.size).sum::<usize>(), b.size);
    vmm.trim_kept(0);
    assert!(vmm.has_stale(), "an old mapping went before its fence had passed");
    vmm.map_runs(&[at(32, 1)]).expect("a page mapped");
    assert!(vmm.has_stale(), "an old mapping went before its fence had passed");
    fence.0.store(true, std::sync::atomic::Ordering::SeqCst);
    vmm.map_runs(&[at(33, 1)]).expect("a page mapped");
    assert!(!vmm.has_stale(), "the next map left the old mapping of released memory");
    vmm.deallocate_chunk(chunk).expect("the chunk goes back");
}

/// Memory lent behind a fence is mapped by the move that lent it (whose
/// stream waits for the fence on the device) with no wait, and by a later
/// map only once the fence has passed (waited for on the host if need
/// be): that map may be for another stream, whose work could otherwise
/// run beside the work still queued on the memory's old place.
#[test]
fn memory_lent_behind_a_fence_is_mapped_by_another_map_only_after_the_fence() {
    let passed = |f: &HandFence| f.0.load(std::sync::atomic::Ordering::SeqCst);
    let name = "memory_lent_behind_a_fence_is_mapped_by_another_map_only_after_the_fence";
    let Some((vmm, chunk, at)) = two_mapped_runs(name, 96) else { return };
    let (a, b) = (at(0, 16), at(16, 16));

    // The move's own map takes what it lent, with no wait.
    let fence = Arc::new(HandFence::default());
    vmm.lend_within(&[a], a.size, Queued::Before(fence.clone())).expect("lent");
    vmm.map_runs(&[at(32, 16)]).expect("the move's map");
    assert_eq!(vmm.kept(), 0, "the move did not map the memory it lent");
    assert!(!passed(&fence), "the move's own map waited for its fence");

    // What a move lent and did not map: a later map takes it only after
    // the fence.
    let fence = Arc::new(HandFence::default());
    vmm.lend_within(&[b], b.size, Queued::Before(fence.clone())).expect("lent");
    vmm.map_runs(&[at(48, 1)]).expect("the move's map");
    assert_eq!(vmm.kept(), b.size);
    assert!(!passed(&fence));
    vmm.map_runs(&[at(64, 16)]).expect("a later map");
    assert_eq!(vmm.kept(), 0, "the later map did not take the kept memory");
    assert!(passed(&fence), "a later map took memory lent behind a fence without waiting for it");
    vmm.deallocate_chunk(chunk).expect("the chunk goes back");
}
