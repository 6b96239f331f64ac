/* cumem's C ABI. Generated from cumem-c/src by cbindgen; do not edit (CUMEM_BLESS=1 cargo test -p cumem-c --test header rewrites it). */

#ifndef CUMEM_H
#define CUMEM_H

#include <stddef.h>
#include <stdint.h>

// The longest tag name in bytes, without its NUL.
#define CUMEM_MAX_TAG_LEN 128

// Bytes of `CumemTagUsage::name`: the longest name and its NUL.
#define CUMEM_TAG_NAME_CAP (CUMEM_MAX_TAG_LEN + 1)

// What a cumem call returned. `CUMEM_STATUS_OK` is 0; every other value
// is a failure whose message [`cumem_last_error`] gives, and which left
// the pools as they were.
typedef enum {
  // Success.
  CUMEM_STATUS_OK = 0,
  // A null pointer where one is required, a zero or absurd size, a bad
  // alignment, a mode or device number out of range.
  CUMEM_STATUS_INVALID_ARGUMENT = 1,
  // The pool could not serve the request, even after releasing its cache.
  CUMEM_STATUS_OUT_OF_MEMORY = 2,
  // A pointer cumem never handed out (or a pinned pointer given to a
  // device call, and the reverse).
  CUMEM_STATUS_UNKNOWN_POINTER = 3,
  // A pointer inside a block rather than at its start.
  CUMEM_STATUS_INTERIOR_POINTER = 4,
  // A block freed a second time.
  CUMEM_STATUS_DOUBLE_FREE = 5,
  // `cumem_init` after the manager was created (by `cumem_init` or by
  // any other call, which configures it from `CUMEM_CONF`).
  CUMEM_STATUS_ALREADY_INITIALIZED = 6,
  // A setting changed too late (pool sizes after the first allocation).
  CUMEM_STATUS_CONFIG_TOO_LATE = 7,
  // A bad configuration string (`cumem_init`'s or `CUMEM_CONF`).
  CUMEM_STATUS_CONFIG = 8,
  // A call after `cumem_shutdown`.
  CUMEM_STATUS_SHUT_DOWN = 9,
  // A CUDA driver call failed.
  CUMEM_STATUS_DRIVER = 10,
  // No device with that number.
  CUMEM_STATUS_NO_SUCH_DEVICE = 11,
  // A request that graph capture rules forbid now.
  CUMEM_STATUS_CAPTURE = 12,
  // The caller's buffer is too small (the size needed is reported).
  CUMEM_STATUS_BUFFER_TOO_SMALL = 13,
  // A call that needs a GPU on the host fallback.
  CUMEM_STATUS_NEEDS_GPU = 14,
  // cumem panicked inside the call (a bug in cumem): the call did
  // nothing that can be relied on, and the message says where.
  CUMEM_STATUS_PANIC = 15,
  // Any other failure; the message says what.
  CUMEM_STATUS_OTHER = 16,
  // Sharing memory with another process failed: memory that can't be
  // exported, a malformed handle, an unknown export, a closed socket.
  CUMEM_STATUS_IPC = 17,
  // A memory tag's state forbids the request (allocating in a tag that
  // sleeps, sleeping twice, waking a tag that is awake), or its memory
  // can't sleep; nothing changed.
  CUMEM_STATUS_TAG = 18,
} CumemStatus;

// A device allocator mode (an `int` for `cumem_set_device_allocator_mode`).
typedef enum {
  // cumem's own pool, stream-ordered reuse through events.
  CUMEM_MODE_SYNC_POOL = 0,
  // `cuMemAllocAsync` on the device's default memory pool.
  CUMEM_MODE_ASYNC_STREAM_ORDERED = 1,
  // A dedicated native CUDA memory pool (`cuMemPoolCreate`).
  CUMEM_MODE_CUDA_ASYNC_POOL = 2,
} CumemMode;

// Where a tag's memory is (`CumemTagUsage::state`).
typedef enum {
  // Mapped and usable: allocations are served.
  CUMEM_TAG_STATE_AWAKE = 0,
  // Being put to sleep (contents being copied out).
  CUMEM_TAG_STATE_SLEEPING = 1,
  // Its pages are given back; its addresses stay reserved.
  CUMEM_TAG_STATE_ASLEEP = 2,
  // Getting pages again (contents being copied back).
  CUMEM_TAG_STATE_WAKING = 3,
} CumemTagState;

// A graph-private pool (opaque), from `cumem_graph_pool_create`.
typedef struct CumemGraphPool CumemGraphPool;

// A raw CUDA stream (`cudaStream_t`, `CUstream`); NULL is the device's
// legacy default stream. On the host fallback, any value is a host queue.
typedef void *CumemStream;

// One free block of a graph pool.
typedef struct {
  // Its first address.
  uint64_t addr;
  // Its size in bytes.
  size_t size;
} CumemFreeBlock;

// One pool's figures, in bytes or counts.
typedef struct {
  // Bytes in live blocks.
  size_t in_use;
  // The largest `in_use` since the last peak reset.
  size_t peak_in_use;
  // Bytes the live allocations asked for.
  size_t requested;
  // The largest `requested` since the last peak reset.
  size_t peak_requested;
  // Physical bytes the pool holds from the driver: its mapped pages
  // where it remaps pages, else its chunks.
  size_t reserved;
  // The largest `reserved` since the last peak reset.
  size_t peak_reserved;
  // Bytes in blocks parked in per-thread caches.
  size_t cached;
  // Live blocks.
  size_t live_blocks;
  // Free blocks.
  size_t free_blocks;
  // Chunks taken from the driver.
  size_t chunks;
  // The largest free block.
  size_t largest_free;
} CumemPoolStats;

// One device's figures across its modes.
typedef struct {
  // The sync pool.
  CumemPoolStats pool;
  // Bytes in live stream-ordered allocations (the two async modes).
  size_t stream_ordered_in_use;
  // The largest `stream_ordered_in_use` since the last peak reset.
  size_t stream_ordered_peak_in_use;
  // Live stream-ordered allocations.
  size_t stream_ordered_live;
  // Bytes the driver's pools (the default, the dedicated) reserve now.
  uint64_t native_reserved;
  // Their largest reservation (the driver's high-water attribute).
  uint64_t native_peak_reserved;
  // Bytes the graph-private pools hold from the driver.
  size_t graph_reserved;
  // The largest `graph_reserved`.
  size_t graph_peak_reserved;
  // Sync-pool reuses of a block freed on another stream that waited.
  uint64_t stream_waits;
  // Cross-stream reuses that needed no new wait.
  uint64_t stream_waits_elided;
  // Bytes in live blocks of the memory tags (not in `pool`; per tag:
  // `cumem_tag_usage`).
  size_t tagged_in_use;
  // Physical bytes mapped for the memory tags (none while asleep).
  size_t tagged_mapped;
  // The sum of the tags' largest `mapped` since the last peak reset.
  size_t tagged_peak_mapped;
  // Page moves of the sync pool that waited for the device (a request
  // on no stream, or no fence on the freeing streams could be made).
  uint64_t move_waits;
} CumemDeviceStats;

// What `cumem_shutdown` found.
typedef struct {
  // Allocations still live (they stay valid).
  size_t live_count;
  // Their bytes.
  size_t live_bytes;
  // Bytes returned to the driver.
  size_t released_bytes;
} CumemShutdownReport;

// What `cumem_sleep` did.
typedef struct {
  // How many tags were put to sleep.
  size_t tags;
  // Bytes of live blocks copied to pinned host memory.
  size_t offloaded;
  // Bytes of live blocks whose contents were discarded.
  size_t discarded;
  // Bytes of physical device memory given back.
  size_t released;
  // Seconds spent copying.
  double copy_seconds;
  // Seconds the whole call took.
  double seconds;
} CumemSleepReport;

// What `cumem_wake` did.
typedef struct {
  // How many tags were woken.
  size_t tags;
  // Bytes of contents copied back.
  size_t restored;
  // Bytes of physical device memory mapped under live blocks.
  size_t mapped;
  // Seconds spent copying.
  double copy_seconds;
  // Seconds the whole call took.
  double seconds;
} CumemWakeReport;

// One tag on one device (`cumem_tag_usage`).
typedef struct {
  // The tag, NUL-terminated.
  char name[CUMEM_TAG_NAME_CAP];
  // The device.
  int device;
  // Where its memory is.
  CumemTagState state;
  // Bytes in its live blocks.
  size_t in_use;
  // Bytes its live allocations asked for.
  size_t requested;
  // Bytes of physical device memory mapped for it now (0 while asleep).
  size_t mapped;
  // Bytes of address space reserved for it (kept while asleep).
  size_t reserved;
  // Its live blocks.
  size_t live_blocks;
  // Bytes of its contents held in pinned host memory while it sleeps.
  size_t offloaded;
} CumemTagUsage;

// Counters of the PyTorch entry points, which can't return a status.
typedef struct {
  // `cumem_torch_alloc` calls that returned NULL for a non-zero size.
  uint64_t alloc_failures;
  // `cumem_torch_free` calls that failed (the block stayed as it was).
  uint64_t free_failures;
  // Frees first ordered after streams noted by `cumem_record_stream`.
  uint64_t recorded_stream_waits;
} CumemTorchCounters;

// One device's figures for PyTorch's statistics.
typedef struct {
  // Physical bytes held from the driver: the sync pool's mapped pages,
  // the memory tags' mapped pages (0 for a tag while it sleeps), the
  // driver pools' reservation and the graph pools' chunks.
  uint64_t reserved;
  // The largest `reserved` since the last peak reset (the parts' peaks).
  uint64_t peak_reserved;
  // The sync pool's driver allocations (page maps, or chunks).
  uint64_t device_allocs;
  // The sync pool's driver frees (page unmaps, or chunk frees).
  uint64_t device_frees;
  // Allocations that failed at the driver, released the cache, retried.
  uint64_t alloc_retries;
  // Chunks the sync pool holds.
  uint64_t chunks;
  // The sync pool's largest free block.
  uint64_t largest_free;
  // Physical bytes free in the sync pool (mapped, not in use, not
  // parked in thread caches).
  uint64_t free_bytes;
  // Bytes in live blocks of the memory tags' arenas (counted in
  // neither the sync pool's figures nor `free_bytes`; asleep or not).
  uint64_t tagged_in_use;
  // Bytes the live allocations of the memory tags asked for.
  uint64_t tagged_requested;
  // Physical bytes mapped for the memory tags (part of `reserved`).
  uint64_t tagged_mapped;
} CumemTorchFigures;

#ifdef __cplusplus
extern "C" {
#endif // __cplusplus

// Creates the process-wide manager from a configuration string in
// `CUMEM_CONF`'s syntax (`"device_pool_size=1GiB,mode=sync_pool"`), or
// from `CUMEM_CONF` itself when `conf` is NULL. Optional: any other call
// creates the manager from `CUMEM_CONF` on first use.
//
// # Errors
// `CUMEM_STATUS_CONFIG` (a bad key or value, named in the message),
// `CUMEM_STATUS_ALREADY_INITIALIZED`, `CUMEM_STATUS_NO_SUCH_DEVICE`,
// `CUMEM_STATUS_DRIVER`.
//
// # Safety
// `conf` must be NULL or a NUL-terminated string.
CumemStatus cumem_init(const char *conf);

// Writes what the manager runs on ("CUDA (1 device(s))", "host fallback,
// no GPU in use (why)") into `buf`, as `cumem_memory_summary` does.
//
// # Safety
// As `cumem_memory_summary`.
CumemStatus cumem_backend(char *buf, size_t len, size_t *needed);

// Stores 1 in `*out` on the host fallback (host memory stands in for
// device memory), 0 on CUDA.
//
// # Safety
// `out` must be NULL (an error) or valid for a write.
CumemStatus cumem_is_host_fallback(int *out);

// Allocates `size` bytes of pinned (page-locked) host memory, 256-byte
// aligned, and stores the pointer in `*out` (left unchanged on failure).
//
// # Errors
// `CUMEM_STATUS_INVALID_ARGUMENT` (size 0 or absurd, `out` NULL),
// `CUMEM_STATUS_OUT_OF_MEMORY`, `CUMEM_STATUS_SHUT_DOWN`.
//
// # Safety
// `out` must be NULL (an error) or valid for a write.
CumemStatus cumem_allocate_pinned(size_t size, void **out);

// Returns pinned memory to the pool; no host code or copy may use it now.
//
// # Errors
// `CUMEM_STATUS_DOUBLE_FREE`, `CUMEM_STATUS_INTERIOR_POINTER`,
// `CUMEM_STATUS_UNKNOWN_POINTER` (NULL, a device pointer, anything cumem's
// pinned pool did not hand out); the pool is unchanged then.
CumemStatus cumem_free_pinned(void *ptr);

// Allocates `size` bytes on the default device, usable at once by any
// stream, into `*out` (a device pointer, never dereferenced on the host).
//
// # Errors
// `CUMEM_STATUS_INVALID_ARGUMENT`, `CUMEM_STATUS_OUT_OF_MEMORY`,
// `CUMEM_STATUS_SHUT_DOWN`, `CUMEM_STATUS_DRIVER`.
//
// # Safety
// `out` must be NULL (an error) or valid for a write.
CumemStatus cumem_allocate_device(size_t size, void **out);

// Allocates device memory for work on `stream` (a stream of the default
// device): safe to use by work queued on `stream` from now on.
//
// # Errors
// As `cumem_allocate_device`.
//
// # Safety
// `out` must be NULL (an error) or valid for a write; `stream` must be a
// stream of the default device's primary context that lives until the
// memory is freed and the frees queued on it have run.
CumemStatus cumem_allocate_device_on(size_t size, CumemStream stream, void **out);

// Frees device memory at once: no queued work may still use it
// (synchronise first, or use `cumem_free_device_on`).
//
// # Errors
// `CUMEM_STATUS_DOUBLE_FREE`, `CUMEM_STATUS_INTERIOR_POINTER`,
// `CUMEM_STATUS_UNKNOWN_POINTER` (also NULL and pinned pointers); nothing
// changes then.
CumemStatus cumem_free_device(void *ptr);

// Frees device memory in stream order: work queued on `stream` before
// this call may still use it; other streams reuse it only after that work.
//
// # Errors
// As `cumem_free_device`.
//
// # Safety
// `stream` as in `cumem_allocate_device_on`.
CumemStatus cumem_free_device_on(void *ptr, CumemStream stream);

// Queues a copy of `size` bytes from host memory `src` to device memory
// `dst` on `stream` (`cuMemcpyHtoDAsync`; asynchronous from pinned
// memory). On the host fallback it happens at once.
//
// # Errors
// `CUMEM_STATUS_INVALID_ARGUMENT` (NULL pointers), `CUMEM_STATUS_DRIVER`.
//
// # Safety
// As `cudaMemcpyAsync`: `src` readable and `dst` a device allocation
// writable for `size` bytes until the copy is done (synchronise
// `stream`), neither written meanwhile; `stream` as in
// `cumem_allocate_device_on`.
CumemStatus cumem_copy_to_device_async(void *dst, const void *src, size_t size, CumemStream stream);

// Queues a copy of `size` bytes from device memory `src` to host memory
// `dst` on `stream` (`cuMemcpyDtoHAsync`).
//
// # Errors
// As `cumem_copy_to_device_async`.
//
// # Safety
// As `cumem_copy_to_device_async`, with the roles swapped: `dst` must
// not be read or written until the copy is done.
CumemStatus cumem_copy_to_host_async(void *dst, const void *src, size_t size, CumemStream stream);

// Sets the bytes the first pinned allocation reserves.
//
// # Errors
// `CUMEM_STATUS_CONFIG_TOO_LATE` after the first pinned allocation.
CumemStatus cumem_set_pinned_pool_size(size_t size);

// Sets the bytes the first device allocation of the sync pool reserves.
//
// # Errors
// `CUMEM_STATUS_CONFIG_TOO_LATE` after the first device allocation.
CumemStatus cumem_set_device_pool_size(size_t size);

// Lets kernels on device `accessor` use all memory of device `owner` that
// cumem hands out, now and later (`MemoryManager::enable_peer_access`;
// one-way; twice, or `accessor == owner`, is harmless). Needed even after
// `cudaDeviceEnablePeerAccess` for memory mapped before the accessor's
// context existed, with no cumem allocation since.
//
// # Errors
// `CUMEM_STATUS_INVALID_ARGUMENT` for a negative device;
// `CUMEM_STATUS_NO_SUCH_DEVICE`; `CUMEM_STATUS_OTHER` when the devices
// have no peer path; `CUMEM_STATUS_DRIVER`.
CumemStatus cumem_enable_peer_access(int accessor, int owner);

// Requests device allocator mode `mode` (a `CumemMode`) for every device;
// stores the default device's mode in effect (`CUMEM_MODE_SYNC_POOL`
// without stream-ordered allocation) in `*effective` unless NULL. Live
// allocations stay valid.
//
// # Errors
// `CUMEM_STATUS_INVALID_ARGUMENT` for a value that is not a mode.
//
// # Safety
// `effective` must be NULL or valid for a write.
CumemStatus cumem_set_device_allocator_mode(int mode, CumemMode *effective);

// Stores the requested device allocator mode in `*out`.
//
// # Safety
// `out` must be NULL (an error) or valid for a write.
CumemStatus cumem_requested_device_allocator_mode(CumemMode *out);

// Stores the default device's device allocator mode in effect in `*out`.
//
// # Safety
// `out` must be NULL (an error) or valid for a write.
CumemStatus cumem_effective_device_allocator_mode(CumemMode *out);

// Stores 1 in `*out` when the default device supports stream-ordered
// allocation (`CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED`), else 0.
//
// # Safety
// `out` must be NULL (an error) or valid for a write.
CumemStatus cumem_supports_async_device_allocator(int *out);

// Makes a graph-private pool on device `device` in `*out`.
//
// # Errors
// `CUMEM_STATUS_INVALID_ARGUMENT`, `CUMEM_STATUS_NO_SUCH_DEVICE`,
// `CUMEM_STATUS_SHUT_DOWN`, `CUMEM_STATUS_DRIVER`.
//
// # Safety
// `out` is NULL (an error) or valid for a write.
CumemStatus cumem_graph_pool_create(int device, CumemGraphPool **out);

// Allocates `size` bytes from `pool` into `*out`, growing the pool when
// no free block holds them. The caller orders the block's reuse.
//
// # Errors
// `CUMEM_STATUS_INVALID_ARGUMENT`, `CUMEM_STATUS_OUT_OF_MEMORY`,
// `CUMEM_STATUS_DRIVER`.
//
// # Safety
// `pool` is NULL (an error) or a live handle; `out` NULL (an error) or
// valid for a write.
CumemStatus cumem_graph_pool_allocate(const CumemGraphPool *pool, size_t size, void **out);

// Takes `size` bytes at `ptr` out of `pool`'s free memory (all of it in
// one free block), as a checkpoint restores a block where it was.
//
// # Errors
// `CUMEM_STATUS_INVALID_ARGUMENT`; `CUMEM_STATUS_OTHER` when the range
// is not free in one block (nothing changes).
//
// # Safety
// `pool` is NULL (an error) or a live handle.
CumemStatus cumem_graph_pool_allocate_at(const CumemGraphPool *pool, void *ptr, size_t size);

// Frees a block of `pool` into it, for the pool's later allocations.
//
// # Errors
// `CUMEM_STATUS_DOUBLE_FREE`, `CUMEM_STATUS_INTERIOR_POINTER`,
// `CUMEM_STATUS_UNKNOWN_POINTER` (nothing changes).
//
// # Safety
// `pool` is NULL (an error) or a live handle.
CumemStatus cumem_graph_pool_free(const CumemGraphPool *pool, void *ptr);

// Stores up to `cap` of `pool`'s free blocks, in address order, in
// `out`, and how many there are in `*count`.
//
// # Errors
// `CUMEM_STATUS_INVALID_ARGUMENT` (NULL `pool` or `count`, NULL `out`
// with `cap` > 0).
//
// # Safety
// `pool` is NULL (an error) or a live handle; `out` valid for `cap`
// writes; `count` NULL (an error) or valid for a write.
CumemStatus cumem_graph_pool_free_blocks(const CumemGraphPool *pool,
                                         CumemFreeBlock *out,
                                         size_t cap,
                                         size_t *count);

// Destroys the handle; the pool's memory goes back once none of its
// blocks is live. The caller first waits for the work that used it.
//
// # Errors
// `CUMEM_STATUS_INVALID_ARGUMENT` (NULL `pool`).
//
// # Safety
// `pool` is NULL (an error) or a live handle, never used after this.
CumemStatus cumem_graph_pool_destroy(CumemGraphPool *pool);

// An identity of the loaded copy of cumem's library, and so of the
// manager the calls reach: equal for every caller of this copy, different
// for another copy. It is a private static's address, inside the
// library's own mapping (`/proc/self/maps` names the file). Never 0;
// creates no manager, cannot fail.
uint64_t cumem_instance_id(void);

// Exports the live device block at `ptr` (its start) over the connected
// Unix stream socket `socket`, storing the export's id in `*export_id`.
// The block stays until the export is released (`cumem_ipc_wait_closed`,
// `cumem_ipc_release`); a free meanwhile takes effect then.
//
// # Errors
// `CUMEM_STATUS_INVALID_ARGUMENT` (NULL `export_id`, a negative socket),
// `CUMEM_STATUS_UNKNOWN_POINTER` / `INTERIOR_POINTER` / `DOUBLE_FREE`,
// `CUMEM_STATUS_NEEDS_GPU` on the host fallback, `CUMEM_STATUS_IPC`
// (memory that can't be exported, the socket failed), `CUMEM_STATUS_DRIVER`.
// Nothing is pinned after a failure.
//
// # Safety
// `export_id` must be NULL or valid for a write; `socket` an open Unix
// stream socket.
CumemStatus cumem_ipc_export(void *ptr, int socket, uint64_t *export_id);

// Waits on `socket` for the importer's "closed" for `export_id`; releases it.
//
// # Errors
// `CUMEM_STATUS_IPC` for an unknown export, a message about another
// export, or a socket that failed; the export then stays open (release it
// with `cumem_ipc_release` once the importer is known to be gone).
CumemStatus cumem_ipc_wait_closed(int socket, uint64_t export_id);

// Releases `export_id` with no message (the importer's close known otherwise).
//
// # Errors
// `CUMEM_STATUS_IPC` for an unknown export; the deferred free's error.
CumemStatus cumem_ipc_release(uint64_t export_id);

// Receives a handle on `socket` and opens the block for device `device`
// (-1: the device the memory lives on); stores its address here in
// `*ptr` (device memory: never dereferenced on the host), its size in
// `*size` and the export's id in `*export_id` (each may be NULL).
//
// # Errors
// `CUMEM_STATUS_INVALID_ARGUMENT` (NULL `ptr`, a negative socket, a device
// below -1), `CUMEM_STATUS_IPC` (malformed message, socket failed),
// `CUMEM_STATUS_NEEDS_GPU`, `CUMEM_STATUS_DRIVER`.
//
// # Safety
// `ptr` must be valid for a write; `size` and `export_id` NULL or valid
// for a write; `socket` an open Unix stream socket.
CumemStatus cumem_ipc_import(int socket, int device, void **ptr, size_t *size, uint64_t *export_id);

// Closes imported memory (after the device's work on it is done) and,
// when `socket` is not -1, tells the exporter on it.
//
// # Errors
// `CUMEM_STATUS_UNKNOWN_POINTER` for an address that is not open imported
// memory; `CUMEM_STATUS_DRIVER` (nothing is sent then); `CUMEM_STATUS_IPC`
// when the message could not be sent (the memory is closed);
// `CUMEM_STATUS_INVALID_ARGUMENT` for a socket below -1 (the memory is
// closed, nothing is sent).
CumemStatus cumem_ipc_close(void *ptr, int socket);

// Stores the pinned pool's figures in `*out`.
//
// # Safety
// `out` must be NULL (an error) or valid for a write.
CumemStatus cumem_pinned_stats(CumemPoolStats *out);

// Stores `device`'s figures in `*out` (making its allocator if need be).
//
// # Errors
// `CUMEM_STATUS_NO_SUCH_DEVICE`, `CUMEM_STATUS_INVALID_ARGUMENT`.
//
// # Safety
// `out` must be NULL (an error) or valid for a write.
CumemStatus cumem_device_stats(int device, CumemDeviceStats *out);

// Stores cumem's default device in `*out`: the one calls without a device
// use (`device=` of the configuration, default 0).
//
// # Safety
// `out` must be NULL (an error) or valid for a write.
CumemStatus cumem_default_device(int *out);

// Sets every peak figure to its current value.
CumemStatus cumem_reset_peak_stats(void);

// Returns all cached free memory (pinned and device) to the driver;
// stores the bytes released in `*released` when it is not NULL.
//
// # Errors
// `CUMEM_STATUS_CAPTURE` while a graph capture cumem routes is under way;
// `CUMEM_STATUS_DRIVER`.
//
// # Safety
// `released` must be NULL or valid for a write.
CumemStatus cumem_release_cached(size_t *released);

// Writes a readable table of every pool's state into `buf` (`len`
// bytes), NUL-terminated; `*needed` (unless NULL) gets the bytes it needs
// with its NUL (`buf` NULL and `len` 0 to learn it). A buffer too small
// gets as much as fits and `CUMEM_STATUS_BUFFER_TOO_SMALL`.
//
// # Safety
// `buf` must be NULL or valid for writes of `len` bytes; `needed` NULL or
// valid for a write.
CumemStatus cumem_memory_summary(char *buf, size_t len, size_t *needed);

// Waits until every allocation and free recorded so far is in the event
// log (`log=`; nothing to do without one or before the manager exists).
// A program that exits without it loses what was still buffered.
//
// # Errors
// An error writing the log file (kept: later flushes report it too).
CumemStatus cumem_flush_log(void);

// Stops serving allocations, returns all free memory to the driver and
// stores what is still live (valid, and freeable) in `*report` unless
// NULL. Twice is harmless.
//
// # Errors
// `CUMEM_STATUS_DRIVER` (what could be released, was);
// `CUMEM_STATUS_CAPTURE` while a graph capture cumem routes is under way.
//
// # Safety
// `report` must be NULL or valid for a write.
CumemStatus cumem_shutdown(CumemShutdownReport *report);

// The message of the last failing cumem call on the calling thread ("" if
// none failed yet; successful calls leave it). The text stays valid until
// the next failing cumem call on this thread: copy it to keep it.
const char *cumem_last_error(void);

// The name of a status code as a static string ("CUMEM_STATUS_OK", ...);
// "CUMEM_STATUS_UNKNOWN" for a value that is not one.
const char *cumem_status_name(int32_t status);

// Creates a stream on the default device (`cuStreamCreate`,
// non-blocking), or a host queue on the host fallback, and stores its raw
// handle in `*out`. Destroy it with `cumem_stream_destroy`.
//
// # Safety
// `out` must be NULL (an error) or valid for a write of one `CumemStream`.
CumemStatus cumem_stream_create(CumemStream *out);

// Destroys a stream made by `cumem_stream_create` once cumem no longer
// orders work on it (`cuStreamDestroy`; work already queued still runs).
// Synchronize it first if memory was freed on it.
//
// # Errors
// `CUMEM_STATUS_INVALID_ARGUMENT` for a stream `cumem_stream_create` did
// not make (or one already destroyed).
CumemStatus cumem_stream_destroy(CumemStream stream);

// Waits until all work queued on `stream` (of the default device) is
// done (`cuStreamSynchronize`); returns at once on the host fallback.
CumemStatus cumem_stream_synchronize(CumemStream stream);

// Call before destroying `stream` (of the default device), one the
// program made itself, when cumem may have seen it (memory allocated or
// freed on it). cumem waits once for its queued work
// (`cuStreamSynchronize`), so every free on it is complete, and never
// touches the handle again (not even in `cumem_release_cached`); seen
// again later, the handle is a new stream. A stream cumem never saw, or
// one already forgotten, is nothing to do.
//
// # Errors
// `CUMEM_STATUS_INVALID_ARGUMENT` for NULL (the legacy default stream)
// or a stream of `cumem_stream_create` (use `cumem_stream_destroy`); a
// capture error while the stream captures (nothing changes); a driver
// error from the wait (the stream is then not forgotten).
CumemStatus cumem_stream_forget(CumemStream stream);

// Stores in `*out` how many raw streams cumem's table holds now (seen
// through the C ABI or made by `cumem_stream_create`).
//
// # Safety
// `out` must be NULL (an error) or valid for a write of one `size_t`.
CumemStatus cumem_stream_table_size(size_t *out);

// Sets `name` as the calling thread's memory tag (NULL clears it): the
// thread's device allocations now come from the tag's own address space,
// which `cumem_sleep` and `cumem_wake` put away and bring back as one
// (not those of a graph capture cumem routes into a private pool).
//
// # Errors
// `CUMEM_STATUS_CONFIG`: a name that is empty, longer than
// `CUMEM_MAX_TAG_LEN` bytes or not UTF-8 (the thread's tag is unchanged).
//
// # Safety
// `name` must be NULL or a NUL-terminated string.
CumemStatus cumem_tag_set(const char *name);

// Writes the calling thread's memory tag ("" when none is set) into
// `buf`, as `cumem_memory_summary` does (it needs at most
// `CUMEM_TAG_NAME_CAP` bytes).
//
// # Safety
// `buf` must be NULL or valid for writes of `len` bytes; `needed` NULL or
// valid for a write.
CumemStatus cumem_tag_get(char *buf, size_t len, size_t *needed);

// Stores 1 in `*out` when the calling thread has a memory tag set, else
// 0 (a thread-local read, cheap enough for every allocation).
//
// # Safety
// `out` must be NULL (an error) or valid for a write.
CumemStatus cumem_tag_is_set(int *out);

// Puts memory tags to sleep: the live blocks of the `n_offload` tags in
// `offload` are copied to pinned host memory, those of the `n_discard`
// tags in `discard` are not; then every physical page of these tags goes
// back to the driver, their addresses kept for `cumem_wake`. From the
// call (which waits for work queued before it) until `cumem_wake`
// returns, the tags' memory must not be used; allocating in them fails
// with `CUMEM_STATUS_TAG`, freeing is fine. Stores what was done in
// `*out` unless NULL.
//
// # Errors
// Nothing is released when the call fails:
// `CUMEM_STATUS_INVALID_ARGUMENT` (a NULL list with names, a NULL name);
// `CUMEM_STATUS_CONFIG` (a bad or repeated name, a tag in both lists);
// `CUMEM_STATUS_TAG` (a tag that never allocated, or that is not awake;
// too little pinned memory for the offloaded contents);
// `CUMEM_STATUS_CAPTURE` (a graph capture under way);
// `CUMEM_STATUS_SHUT_DOWN`, `CUMEM_STATUS_DRIVER`.
//
// # Safety
// `offload` must be NULL (only with `n_offload` 0) or valid for reads of
// `n_offload` pointers, each a NUL-terminated string; `discard` likewise;
// `out` NULL or valid for a write.
CumemStatus cumem_sleep(const char *const *offload,
                        size_t n_offload,
                        const char *const *discard,
                        size_t n_discard,
                        CumemSleepReport *out);

// Wakes the `n` sleeping tags in `tags` (`n` 0: all): new memory is
// mapped under their live blocks at the same addresses and the offloaded
// contents copied back (discarded ones are undefined); graphs captured
// before the sleep replay as before. Stores what was done in `*out`
// unless NULL.
//
// # Errors
// Nothing changes when the call fails (the tags stay asleep, their
// contents kept): `CUMEM_STATUS_INVALID_ARGUMENT`, `CUMEM_STATUS_CONFIG`
// as for `cumem_sleep`; `CUMEM_STATUS_TAG` (a tag that never allocated or
// is not asleep); `CUMEM_STATUS_OUT_OF_MEMORY`; `CUMEM_STATUS_CAPTURE`;
// `CUMEM_STATUS_SHUT_DOWN`; `CUMEM_STATUS_DRIVER`.
//
// # Safety
// `tags` must be NULL (only with `n` 0) or valid for reads of `n`
// pointers, each a NUL-terminated string; `out` NULL or valid for a
// write.
CumemStatus cumem_wake(const char *const *tags, size_t n, CumemWakeReport *out);

// Writes the figures of every memory tag on every device in use (one
// entry per tag and device, in the order made) into `out` (`cap`
// entries) and their number into `*count` (`out` NULL and `cap` 0 to
// learn it). Too small an array gets the first `cap` entries.
//
// # Errors
// `CUMEM_STATUS_INVALID_ARGUMENT` (`count` NULL, `out` NULL with `cap`
// above 0), `CUMEM_STATUS_BUFFER_TOO_SMALL`.
//
// # Safety
// `out` must be NULL or valid for writes of `cap` entries; `count` NULL
// (an error) or valid for a write.
CumemStatus cumem_tag_usage(CumemTagUsage *out, size_t cap, size_t *count);

// PyTorch's allocation entry point: `size` bytes on `device` for work on
// `stream`. NULL for size 0 and on failure (the thread's last error says
// why; the first few are printed, as PyTorch does not check).
//
// # Safety
// `stream` must be a stream of `device`'s primary context (PyTorch's
// streams are) that outlives the frees queued on it.
void *cumem_torch_alloc(size_t size, int device, CumemStream stream);

// PyTorch's free entry point: frees `ptr` in the order of `stream` (the
// allocation's). NULL is ignored; a failure (an unknown pointer, a double
// free) changes nothing, becomes the thread's last error and is counted.
//
// # Safety
// As `cumem_torch_alloc`.
void cumem_torch_free(void *ptr, size_t size, int device, CumemStream stream);

// Notes that allocation `ptr` is used by work on `stream` of `device`
// besides its own stream (`Tensor.record_stream`): its free first makes
// the freeing stream wait for the work queued on `stream` up to now.
//
// # Errors
// `CUMEM_STATUS_INVALID_ARGUMENT` (NULL, a negative device).
//
// # Safety
// `stream` as in `cumem_torch_alloc`.
CumemStatus cumem_record_stream(void *ptr, int device, CumemStream stream);

// Stores the PyTorch entry points' counters in `*out`.
//
// # Safety
// `out` must be NULL (an error) or valid for a write.
CumemStatus cumem_torch_counters(CumemTorchCounters *out);

// `cumem_torch_alloc` with a status: stores the pointer in `*out`.
//
// # Errors
// `CUMEM_STATUS_INVALID_ARGUMENT` (size 0, NULL `out`, a negative
// device), `CUMEM_STATUS_OUT_OF_MEMORY`, `CUMEM_STATUS_SHUT_DOWN`,
// `CUMEM_STATUS_NO_SUCH_DEVICE`, `CUMEM_STATUS_DRIVER`.
//
// # Safety
// `out` must be NULL (an error) or valid for a write; `stream` as in
// `cumem_torch_alloc`.
CumemStatus cumem_torch_allocate(size_t size, int device, CumemStream stream, void **out);

// `cumem_torch_free` with a status.
//
// # Errors
// `CUMEM_STATUS_DOUBLE_FREE`, `CUMEM_STATUS_INTERIOR_POINTER`,
// `CUMEM_STATUS_UNKNOWN_POINTER` (also NULL); nothing changes then.
//
// # Safety
// `stream` as in `cumem_torch_alloc`.
CumemStatus cumem_torch_release(void *ptr, int device, CumemStream stream);

// Stores device `device`'s figures for PyTorch's statistics in `*out`.
//
// # Errors
// `CUMEM_STATUS_NO_SUCH_DEVICE`, `CUMEM_STATUS_INVALID_ARGUMENT`.
//
// # Safety
// `out` must be NULL (an error) or valid for a write.
CumemStatus cumem_torch_figures(int device, CumemTorchFigures *out);

#ifdef __cplusplus
}  // extern "C"
#endif  // __cplusplus

#endif  /* CUMEM_H */
