//! Device memory shared between processes ([`cumem::ipc`]): this test
//! process is the producer; the consumer is the same test binary run again
//! with `CUMEM_IPC_SOCKET` set, running only `ipc_consumer`. Each test
//! skips with a reason without a GPU (two GPUs for the cross-GPU one) and
//! fails instead under `CUMEM_REQUIRE_GPU=1` (with `CUMEM_GPUS=2`).
//!
//! Every mechanism goes through two rounds with one consumer:
//! 1. **Shared, not copied.** The producer fills a block with a kernel and
//!    exports it; the consumer opens it, checks every value, overwrites it
//!    with `cuMemsetD32`, closes it and says so; the producer then reads
//!    the consumer's value in its own block.
//! 2. **Pinned until released.** The producer exports a filled block and
//!    frees it at once, then allocates blocks of the same size, fills them
//!    and releases cached memory while the consumer still reads: none of
//!    them may be the exported block. After the consumer's "closed", the
//!    next allocation of that size (sync pool) is the block again: without
//!    the pin it would have been the first of them.

use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaContext, CudaFunction, LaunchConfig, PushKernelArg};
use cumem::device::{gpu_for_test, gpus_for_test};
use cumem::ipc::{ImportedMemory, IpcHandle};
use cumem::{Config, DeviceAllocatorMode, Error, MemoryManager, Stream};

const KERNEL: &str = r#"
extern "C" __global__ void ramp(unsigned int* p, unsigned int first, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) p[i] = first + 3u * (unsigned int)i;
}
"#;

/// What the consumer writes over each block it opened.
const CONSUMER_MARK: u32 = 0xC0FF_EE00;
/// What the producer writes into the blocks it allocates while one is pinned.
const PRODUCER_MARK: u32 = 0x0BAD_0BAD;
/// Odd on purpose: blocks neither start nor end on a page.
const BLOCK: usize = (3 << 20) + 4096;
/// How long either side waits for the other.
const PATIENCE: Duration = Duration::from_secs(120);

fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn config() -> Config {
    Config::new().device(0)
}

fn read(ctx: &Arc<CudaContext>, ptr: u64, n: usize) -> Vec<u32> {
    ctx.bind_to_thread().unwrap();
    let mut v = vec![0u32; n];
    // SAFETY: `v` holds `n` values; `ptr` is `n * 4` bytes of device memory
    // this process may read, and no work is queued on it.
    unsafe { sys::cuMemcpyDtoH_v2(v.as_mut_ptr().cast(), ptr, n * 4) }.result().unwrap();
    v
}

fn memset(ctx: &Arc<CudaContext>, ptr: u64, value: u32, n: usize) {
    ctx.bind_to_thread().unwrap();
    // SAFETY: `ptr` is `n * 4` bytes of device memory this process may write.
    unsafe { sys::cuMemsetD32_v2(ptr, value, n) }.result().unwrap();
    ctx.synchronize().unwrap();
}

/// The consumer's half: not a test of its own (it returns at once unless
/// the producer started this process to be its consumer).
#[test]
fn ipc_consumer() {
    let Ok(path) = std::env::var("CUMEM_IPC_SOCKET") else { return };
    let device: Option<usize> = std::env::var("CUMEM_IPC_DEVICE").ok().map(|d| d.parse().unwrap());
    let socket = UnixStream::connect(&path).unwrap();
    socket.set_read_timeout(Some(PATIENCE)).unwrap();
    loop {
        let handle = match IpcHandle::recv(&socket) {
            Ok(h) => h,
            // The producer hung up: every round is done.
            Err(Error::Os { .. }) => return,
            Err(e) => panic!("consumer: {e}"),
        };
        assert_ne!(handle.exporter_pid(), std::process::id(), "the handle comes from another process");
        let memory = ImportedMemory::open(handle, device).unwrap();
        if let Some(d) = device {
            assert_eq!(memory.device(), d);
        }
        let ctx = cumem::device::device_context(memory.device()).unwrap().unwrap();
        let n = memory.size() / 4;
        let seen = read(&ctx, memory.ptr(), n);
        let first = seen[0];
        let wrong = (0..n).filter(|&i| seen[i] != first.wrapping_add(3 * i as u32)).count();
        assert_eq!(wrong, 0, "consumer: {wrong} of {n} values differ from the producer's ramp from {first:#x}");
        if std::env::var_os("CUMEM_IPC_DIE").is_some() {
            // Dies holding the memory: no close, no message.
            std::process::exit(0);
        }
        memset(&ctx, memory.ptr(), CONSUMER_MARK, n);
        memory.close_and_notify(&socket).unwrap();
    }
}

/// The consumer process and the producer's end of its socket.
struct Consumer {
    child: Child,
    socket: UnixStream,
    path: std::path::PathBuf,
}

impl Consumer {
    fn start(device: Option<usize>) -> Consumer {
        Self::start_with(device, false)
    }

    /// `dies`: the consumer exits right after opening the first block.
    fn start_with(device: Option<usize>, dies: bool) -> Consumer {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("cumem-ipc-{}-{n}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap();
        listener.set_nonblocking(true).unwrap();
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        let test = crate::common::test_name(module_path!(), "ipc_consumer");
        cmd.args([test.as_str(), "--exact", "--nocapture", "--test-threads=1"]).env("CUMEM_IPC_SOCKET", &path);
        if let Some(d) = device {
            cmd.env("CUMEM_IPC_DEVICE", d.to_string());
        }
        if dies {
            cmd.env("CUMEM_IPC_DIE", "1");
        }
        let mut child = cmd.spawn().unwrap();
        let start = Instant::now();
        let socket = loop {
            match listener.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if let Some(status) = child.try_wait().unwrap() {
                        panic!("the consumer exited before connecting: {status}");
                    }
                    assert!(start.elapsed() < PATIENCE, "the consumer never connected");
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => panic!("accept: {e}"),
            }
        };
        socket.set_nonblocking(false).unwrap();
        socket.set_read_timeout(Some(PATIENCE)).unwrap();
        Consumer { child, socket, path }
    }

    /// Hangs up and checks that the consumer passed.
    fn finish(self) {
        let Consumer { mut child, socket, path } = self;
        drop(socket);
        let status = child.wait().unwrap();
        let _ = std::fs::remove_file(path);
        assert!(status.success(), "the consumer failed: {status}");
    }
}

/// Fills `n` values at `ptr` with a ramp from `first`, on `stream`, and waits.
fn ramp(f: &CudaFunction, stream: &Stream, ptr: u64, first: u32, n: usize) {
    let s = stream.cudarc().unwrap();
    let nn = n as u64;
    let mut launch = s.launch_builder(f);
    launch.arg(&ptr).arg(&first).arg(&nn);
    // SAFETY: the kernel's signature matches; `ptr` holds `n` values.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n as u32)) }.unwrap();
    stream.synchronize().unwrap();
}

/// Both rounds (module docs) with a consumer on `consumer_device`.
fn share(mm: &MemoryManager, ctx: &Arc<CudaContext>, mechanism: &str, consumer_device: Option<usize>) {
    let ptx = cudarc::nvrtc::compile_ptx(KERNEL).expect("NVRTC compiles the kernel");
    let f = ctx.load_module(ptx).unwrap().load_function("ramp").unwrap();
    let stream = Stream::new().unwrap();
    let n = BLOCK / 4;
    let consumer = Consumer::start(consumer_device);
    // A block first, so the shared ones don't start a chunk.
    let before = mm.allocate_device_on(4096, &stream).unwrap();

    // Round 1: shared, not copied.
    let p = mm.allocate_device_on(BLOCK, &stream).unwrap();
    ramp(&f, &stream, p, 0x1000, n);
    let mut export = mm.export_device(p).unwrap();
    assert_eq!(export.handle().mechanism(), mechanism);
    assert_eq!(export.handle().size(), BLOCK);
    assert_eq!(mm.device(0).unwrap().exported_blocks(), 1);
    export.send(&consumer.socket).unwrap();
    export.wait_closed(&consumer.socket).unwrap();
    assert_eq!(mm.device(0).unwrap().exported_blocks(), 0);
    let seen = read(ctx, p, n);
    assert!(seen.iter().all(|&v| v == CONSUMER_MARK), "the consumer's writes reach the producer's block");
    mm.free_device_on(p, &stream).unwrap();

    // Round 2: pinned until released.
    let p = mm.allocate_device_on(BLOCK, &stream).unwrap();
    ramp(&f, &stream, p, 0x7000_0000, n);
    let mut export = mm.export_device(p).unwrap();
    export.send(&consumer.socket).unwrap();
    mm.free_device_on(p, &stream).unwrap(); // deferred: the consumer may be reading
    assert!(matches!(mm.free_device_on(p, &stream), Err(Error::DoubleFree { .. })));
    let mut others = Vec::new();
    for _ in 0..8 {
        let q = mm.allocate_device_on(BLOCK, &stream).unwrap();
        assert_ne!(q, p, "the exported block was handed out again before its release");
        stream.synchronize().unwrap();
        memset(ctx, q, PRODUCER_MARK, n);
        others.push(q);
    }
    for q in others {
        mm.free_device_on(q, &stream).unwrap();
    }
    stream.synchronize().unwrap();
    // Unmaps every free page: the pinned block's pages stay.
    mm.release_cached().unwrap();
    export.wait_closed(&consumer.socket).unwrap();
    if mm.effective_device_allocator_mode() == DeviceAllocatorMode::SyncPool {
        handed_out_again(mm, &stream, p);
    }
    mm.free_device_on(before, &stream).unwrap();
    stream.synchronize().unwrap();
    consumer.finish();
}

/// The control of the pinning checks: once released, the block is the
/// next allocation of its size (best fit), so a block handed out before
/// its release would have been seen.
fn handed_out_again(mm: &MemoryManager, stream: &Stream, p: u64) {
    let again = mm.allocate_device_on(BLOCK, stream).unwrap();
    assert_eq!(again, p, "after the release best fit hands the block out again");
    mm.free_device_on(again, stream).unwrap();
}

#[test]
fn a_sync_pool_block_is_shared_through_vmm_pieces() {
    let Some(ctx) = gpu_for_test("a_sync_pool_block_is_shared_through_vmm_pieces") else { return };
    let _serial = serial();
    let mm = MemoryManager::new(config()).unwrap();
    share(&mm, &ctx, "vmm", None);
}

#[test]
fn a_block_of_cumemalloc_chunks_is_shared_through_an_ipc_handle() {
    let Some(ctx) = gpu_for_test("a_block_of_cumemalloc_chunks_is_shared_through_an_ipc_handle") else { return };
    let _serial = serial();
    let mm = MemoryManager::new(config().expandable(false)).unwrap();
    share(&mm, &ctx, "cuIpcMemHandle", None);
}

#[test]
fn a_native_pool_block_is_shared_through_the_pools_export() {
    let Some(ctx) = gpu_for_test("a_native_pool_block_is_shared_through_the_pools_export") else { return };
    let _serial = serial();
    let mm =
        MemoryManager::new(config().mode(DeviceAllocatorMode::CudaAsyncPool).exportable_native_pool(true)).unwrap();
    assert_eq!(mm.effective_device_allocator_mode(), DeviceAllocatorMode::CudaAsyncPool);
    share(&mm, &ctx, "native pool", None);
}

#[test]
fn an_importer_that_dies_leaves_the_block_pinned_until_released() {
    let Some(ctx) = gpu_for_test("an_importer_that_dies_leaves_the_block_pinned_until_released") else { return };
    let _serial = serial();
    let mm = MemoryManager::new(config()).unwrap();
    let ptx = cudarc::nvrtc::compile_ptx(KERNEL).expect("NVRTC compiles the kernel");
    let f = ctx.load_module(ptx).unwrap().load_function("ramp").unwrap();
    let stream = Stream::new().unwrap();
    let n = BLOCK / 4;
    let mut consumer = Consumer::start_with(None, true);
    let before = mm.allocate_device_on(4096, &stream).unwrap();
    let p = mm.allocate_device_on(BLOCK, &stream).unwrap();
    ramp(&f, &stream, p, 0x42, n);
    let mut export = mm.export_device(p).unwrap();
    export.send(&consumer.socket).unwrap();
    mm.free_device_on(p, &stream).unwrap();
    // The consumer exits without a word: waiting fails, the export stays open.
    assert!(matches!(export.wait_closed(&consumer.socket), Err(Error::Os { .. })));
    assert!(!export.is_released());
    assert_eq!(mm.device(0).unwrap().exported_blocks(), 1);
    let q = mm.allocate_device_on(BLOCK, &stream).unwrap();
    assert_ne!(q, p, "the block of a dead importer's export was handed out before its release");
    mm.free_device_on(q, &stream).unwrap();
    // Its process is gone (the driver dropped its mappings): release.
    assert!(consumer.child.wait().unwrap().success());
    export.release().unwrap();
    assert_eq!(mm.device(0).unwrap().exported_blocks(), 0);
    handed_out_again(&mm, &stream, p);
    mm.free_device_on(before, &stream).unwrap();
    stream.synchronize().unwrap();
    consumer.finish();
}

#[test]
fn the_default_pool_and_bad_pointers_are_refused_clearly() {
    let Some(_ctx) = gpu_for_test("the_default_pool_and_bad_pointers_are_refused_clearly") else { return };
    let _serial = serial();
    let mm = MemoryManager::new(config().mode(DeviceAllocatorMode::AsyncStreamOrdered)).unwrap();
    let p = mm.allocate_device(BLOCK).unwrap();
    let e = mm.export_device(p).unwrap_err();
    assert!(matches!(e, Error::Ipc(_)), "{e}");
    assert!(e.to_string().contains("cuda_async_pool"), "{e}");
    mm.free_device(p).unwrap();
    // The dedicated native pool is exportable only when asked.
    let mm = MemoryManager::new(config().mode(DeviceAllocatorMode::CudaAsyncPool)).unwrap();
    let p = mm.allocate_device(BLOCK).unwrap();
    let e = mm.export_device(p).unwrap_err();
    assert!(matches!(e, Error::Ipc(_)) && e.to_string().contains("exportable_native_pool"), "{e}");
    mm.free_device(p).unwrap();
    let mm = MemoryManager::new(config()).unwrap();
    let p = mm.allocate_device(BLOCK).unwrap();
    assert!(matches!(mm.export_device(p + 256), Err(Error::InteriorPointer { .. })));
    assert!(matches!(mm.export_device(0x10), Err(Error::UnknownPointer { .. })));
    mm.free_device(p).unwrap();
    assert!(matches!(mm.export_device(p), Err(Error::DoubleFree { .. })));
    assert_eq!(mm.device(0).unwrap().exported_blocks(), 0);
}

#[test]
fn a_block_of_one_gpu_is_shared_with_a_process_on_the_other() {
    let Some(ctxs) = gpus_for_test(2, "a_block_of_one_gpu_is_shared_with_a_process_on_the_other") else { return };
    let _serial = serial();
    for (config, mechanism) in [
        (config(), "vmm"),
        (config().expandable(false), "cuIpcMemHandle"),
        (config().mode(DeviceAllocatorMode::CudaAsyncPool).exportable_native_pool(true), "native pool"),
    ] {
        let mm = MemoryManager::new(config).unwrap();
        share(&mm, &ctxs[0], mechanism, Some(1));
    }
}
