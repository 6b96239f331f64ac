/* Every entry point of cumem's C ABI, bad input included. Built and run by
 * tests/c_abi.rs against libcumem_c.so; passes on a GPU and on the host
 * fallback. Prints "cumem C test: all N checks passed" at the end. */

#include "cumem.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static int checks = 0;

#define CHECK(cond)                                                                          \
  do {                                                                                       \
    checks++;                                                                                \
    if (!(cond)) {                                                                           \
      fprintf(stderr, "%s:%d: check failed: %s (last error: %s)\n", __FILE__, __LINE__, #cond, \
              cumem_last_error());                                                           \
      exit(1);                                                                               \
    }                                                                                        \
  } while (0)

#define EXPECT(call, status) CHECK((call) == (status))

static void names_and_errors(void) {
  CHECK(strcmp(cumem_last_error(), "") == 0);
  CHECK(strcmp(cumem_status_name(CUMEM_STATUS_OK), "CUMEM_STATUS_OK") == 0);
  CHECK(strcmp(cumem_status_name(CUMEM_STATUS_DOUBLE_FREE), "CUMEM_STATUS_DOUBLE_FREE") == 0);
  CHECK(strcmp(cumem_status_name(CUMEM_STATUS_OTHER), "CUMEM_STATUS_OTHER") == 0);
  CHECK(strcmp(cumem_status_name(-1), "CUMEM_STATUS_UNKNOWN") == 0);
  CHECK(strcmp(cumem_status_name(1000), "CUMEM_STATUS_UNKNOWN") == 0);
  /* This copy of the library: not 0, the same at every call. */
  CHECK(cumem_instance_id() != 0 && cumem_instance_id() == cumem_instance_id());
}

static void init(void) {
  EXPECT(cumem_init("no_such_key=1"), CUMEM_STATUS_CONFIG);
  CHECK(strstr(cumem_last_error(), "no_such_key") != NULL);
  EXPECT(cumem_init("device_pool_size=lots"), CUMEM_STATUS_CONFIG);
  EXPECT(cumem_init("not key value"), CUMEM_STATUS_CONFIG);
  /* A failed init creates nothing: this one succeeds. */
  EXPECT(cumem_init("pinned_thread_cache=false"), CUMEM_STATUS_OK);
  EXPECT(cumem_init(NULL), CUMEM_STATUS_ALREADY_INITIALIZED);
  EXPECT(cumem_init(""), CUMEM_STATUS_ALREADY_INITIALIZED);
}

static void backend(void) {
  size_t needed = 0;
  char buf[256];
  int host = -1;
  EXPECT(cumem_backend(NULL, 0, &needed), CUMEM_STATUS_BUFFER_TOO_SMALL);
  CHECK(needed > 1);
  EXPECT(cumem_backend(NULL, 10, &needed), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_backend(buf, sizeof buf, &needed), CUMEM_STATUS_OK);
  CHECK(strlen(buf) + 1 == needed);
  EXPECT(cumem_backend(buf, 4, NULL), CUMEM_STATUS_BUFFER_TOO_SMALL);
  CHECK(strlen(buf) == 3); /* truncated, NUL-terminated */
  EXPECT(cumem_is_host_fallback(NULL), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_is_host_fallback(&host), CUMEM_STATUS_OK);
  CHECK(host == 0 || host == 1);
  cumem_backend(buf, sizeof buf, NULL);
  printf("cumem C test: running on %s\n", buf);
}

static void pool_sizes_before_use(void) {
  /* Before the first allocation the sizes can be set... */
  EXPECT(cumem_set_pinned_pool_size(1 << 20), CUMEM_STATUS_OK);
  EXPECT(cumem_set_device_pool_size(4 << 20), CUMEM_STATUS_OK);
}

static void pinned(void) {
  void *p = NULL, *q = NULL;
  CumemPoolStats s;
  EXPECT(cumem_allocate_pinned(0, &p), CUMEM_STATUS_INVALID_ARGUMENT);
  CHECK(p == NULL);
  EXPECT(cumem_allocate_pinned(64, NULL), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_allocate_pinned(SIZE_MAX, &p), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_allocate_pinned(1000, &p), CUMEM_STATUS_OK);
  CHECK(p != NULL && (uintptr_t)p % 256 == 0);
  memset(p, 0xab, 1000); /* pinned memory is host memory */
  EXPECT(cumem_pinned_stats(&s), CUMEM_STATUS_OK);
  CHECK(s.in_use >= 1000 && s.live_blocks >= 1 && s.reserved >= s.in_use);
  EXPECT(cumem_pinned_stats(NULL), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_free_pinned((char *)p + 16), CUMEM_STATUS_INTERIOR_POINTER);
  EXPECT(cumem_free_pinned(NULL), CUMEM_STATUS_UNKNOWN_POINTER);
  EXPECT(cumem_free_pinned(&s), CUMEM_STATUS_UNKNOWN_POINTER); /* a stack address */
  EXPECT(cumem_free_pinned(p), CUMEM_STATUS_OK);
  EXPECT(cumem_free_pinned(p), CUMEM_STATUS_DOUBLE_FREE);
  CHECK(strstr(cumem_last_error(), "double free") != NULL);
  /* The pool is intact after the bad frees. */
  EXPECT(cumem_allocate_pinned(1000, &q), CUMEM_STATUS_OK);
  EXPECT(cumem_free_pinned(q), CUMEM_STATUS_OK);
  EXPECT(cumem_pinned_stats(&s), CUMEM_STATUS_OK);
  CHECK(s.in_use == 0 && s.live_blocks == 0);
  /* ...and no longer after it. */
  EXPECT(cumem_set_pinned_pool_size(1 << 20), CUMEM_STATUS_CONFIG_TOO_LATE);
}

static void device(void) {
  void *d = NULL, *h = NULL;
  CumemDeviceStats s;
  EXPECT(cumem_allocate_device(0, &d), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_allocate_device(256, NULL), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_allocate_device(SIZE_MAX / 2, &d), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_allocate_device(3000, &d), CUMEM_STATUS_OK);
  CHECK(d != NULL && (uintptr_t)d % 256 == 0);
  EXPECT(cumem_device_stats(0, &s), CUMEM_STATUS_OK);
  CHECK(s.pool.in_use >= 3000 && s.pool.live_blocks == 1);
  /* The pool size set before use is memory the pool holds (mapped). */
  CHECK(s.pool.reserved >= (4 << 20));
  EXPECT(cumem_device_stats(-1, &s), CUMEM_STATUS_INVALID_ARGUMENT);
  {
    int dev = -1;
    EXPECT(cumem_default_device(&dev), CUMEM_STATUS_OK);
    CHECK(dev == 0); /* no device= in the test's configuration */
    EXPECT(cumem_default_device(NULL), CUMEM_STATUS_INVALID_ARGUMENT);
  }
  EXPECT(cumem_device_stats(99, &s), CUMEM_STATUS_NO_SUCH_DEVICE);
  EXPECT(cumem_device_stats(0, NULL), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_set_device_pool_size(8 << 20), CUMEM_STATUS_CONFIG_TOO_LATE);
  /* A pinned pointer is not a device pointer, and the reverse. */
  EXPECT(cumem_allocate_pinned(512, &h), CUMEM_STATUS_OK);
  EXPECT(cumem_free_device(h), CUMEM_STATUS_UNKNOWN_POINTER);
  EXPECT(cumem_free_pinned(d), CUMEM_STATUS_UNKNOWN_POINTER);
  EXPECT(cumem_free_pinned(h), CUMEM_STATUS_OK);
  EXPECT(cumem_free_device((char *)d + 256), CUMEM_STATUS_INTERIOR_POINTER);
  EXPECT(cumem_free_device(NULL), CUMEM_STATUS_UNKNOWN_POINTER);
  EXPECT(cumem_free_device(d), CUMEM_STATUS_OK);
  EXPECT(cumem_free_device(d), CUMEM_STATUS_DOUBLE_FREE);
  EXPECT(cumem_device_stats(0, &s), CUMEM_STATUS_OK);
  CHECK(s.pool.in_use == 0 && s.pool.peak_in_use >= 3000);
  EXPECT(cumem_reset_peak_stats(), CUMEM_STATUS_OK);
  EXPECT(cumem_device_stats(0, &s), CUMEM_STATUS_OK);
  CHECK(s.pool.peak_in_use == 0);
}

/* Peer grants: bad ordinals are refused; a device granted to itself is a
 * no-op (the two-GPU grants are tests/multi_gpu.rs). */
static void peers(void) {
  EXPECT(cumem_enable_peer_access(-1, 0), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_enable_peer_access(0, -1), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_enable_peer_access(0, 99), CUMEM_STATUS_NO_SUCH_DEVICE);
  EXPECT(cumem_enable_peer_access(99, 0), CUMEM_STATUS_NO_SUCH_DEVICE);
  EXPECT(cumem_enable_peer_access(0, 0), CUMEM_STATUS_OK);
}

/* Sharing with other processes: bad input everywhere; the host fallback
 * refuses to export (the two-process GPU test is tests/gpu_ipc.rs). */
static void ipc(void) {
  int host = 0, sv[2];
  void *d = NULL, *p = NULL;
  uint64_t id = 0;
  size_t n = 0;
  EXPECT(cumem_is_host_fallback(&host), CUMEM_STATUS_OK);
  CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
  EXPECT(cumem_allocate_device(4096, &d), CUMEM_STATUS_OK);
  EXPECT(cumem_ipc_export(d, sv[0], NULL), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_ipc_export(d, -1, &id), CUMEM_STATUS_INVALID_ARGUMENT);
  if (host) {
    EXPECT(cumem_ipc_export(d, sv[0], &id), CUMEM_STATUS_NEEDS_GPU);
  } else {
    EXPECT(cumem_ipc_export((char *)d + 256, sv[0], &id), CUMEM_STATUS_INTERIOR_POINTER);
  }
  EXPECT(cumem_ipc_release(12345), CUMEM_STATUS_IPC);
  EXPECT(cumem_ipc_wait_closed(sv[0], 12345), CUMEM_STATUS_IPC);
  EXPECT(cumem_ipc_close(d, -1), CUMEM_STATUS_UNKNOWN_POINTER);
  EXPECT(cumem_ipc_import(sv[1], -1, NULL, &n, &id), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_ipc_import(sv[1], -2, &p, &n, &id), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_ipc_import(-1, -1, &p, &n, &id), CUMEM_STATUS_INVALID_ARGUMENT);
  /* A message that is not a handle is refused, and nothing is opened. */
  CHECK(write(sv[0], "\x08\0\0\0junkjunk", 12) == 12);
  EXPECT(cumem_ipc_import(sv[1], -1, &p, &n, &id), CUMEM_STATUS_IPC);
  CHECK(strstr(cumem_last_error(), "magic") != NULL);
  /* The peer hung up. */
  close(sv[0]);
  EXPECT(cumem_ipc_import(sv[1], -1, &p, &n, &id), CUMEM_STATUS_IPC);
  close(sv[1]);
  CHECK(strcmp(cumem_status_name(CUMEM_STATUS_IPC), "CUMEM_STATUS_IPC") == 0);
  EXPECT(cumem_free_device(d), CUMEM_STATUS_OK);
}

static void streams_and_copies(void) {
  CumemStream st = NULL;
  void *d = NULL, *h = NULL, *back = NULL;
  size_t n = 1 << 16, i, tn = 0, tn2 = 0;
  int host = 0;
  EXPECT(cumem_stream_create(NULL), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_stream_create(&st), CUMEM_STATUS_OK);
  CHECK(st != NULL);
  EXPECT(cumem_allocate_device_on(n, st, NULL), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_allocate_device_on(0, st, &d), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_allocate_device_on(n, st, &d), CUMEM_STATUS_OK);
  EXPECT(cumem_allocate_pinned(n, &h), CUMEM_STATUS_OK);
  EXPECT(cumem_allocate_pinned(n, &back), CUMEM_STATUS_OK);
  for (i = 0; i < n; i++) ((unsigned char *)h)[i] = (unsigned char)(i * 7);
  memset(back, 0, n);
  EXPECT(cumem_copy_to_device_async(NULL, h, n, st), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_copy_to_device_async(d, NULL, n, st), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_copy_to_host_async(NULL, d, n, st), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_copy_to_host_async(back, NULL, n, st), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_copy_to_device_async(NULL, NULL, 0, st), CUMEM_STATUS_OK); /* nothing to copy */
  EXPECT(cumem_copy_to_device_async(d, h, n, st), CUMEM_STATUS_OK);
  EXPECT(cumem_copy_to_host_async(back, d, n, st), CUMEM_STATUS_OK);
  EXPECT(cumem_stream_synchronize(st), CUMEM_STATUS_OK);
  CHECK(memcmp(h, back, n) == 0);
  EXPECT(cumem_free_device_on((char *)d + 512, st), CUMEM_STATUS_INTERIOR_POINTER);
  EXPECT(cumem_free_device_on(d, st), CUMEM_STATUS_OK);
  EXPECT(cumem_free_device_on(d, st), CUMEM_STATUS_DOUBLE_FREE);
  /* The default (NULL) stream works too. */
  EXPECT(cumem_allocate_device_on(n, NULL, &d), CUMEM_STATUS_OK);
  EXPECT(cumem_free_device_on(d, NULL), CUMEM_STATUS_OK);
  EXPECT(cumem_stream_synchronize(NULL), CUMEM_STATUS_OK);
  EXPECT(cumem_free_pinned(h), CUMEM_STATUS_OK);
  EXPECT(cumem_free_pinned(back), CUMEM_STATUS_OK);
  EXPECT(cumem_stream_synchronize(st), CUMEM_STATUS_OK);
  /* The raw stream table: its size, and streams forgotten before the
   * program destroys them (not cumem's own, nor the default stream). */
  EXPECT(cumem_stream_table_size(NULL), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_stream_table_size(&tn), CUMEM_STATUS_OK);
  CHECK(tn >= 1);
  EXPECT(cumem_stream_forget(st), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_stream_forget(NULL), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_is_host_fallback(&host), CUMEM_STATUS_OK);
  if (host) { /* any value names a host queue there */
    CumemStream foreign = (CumemStream)(uintptr_t)0x4243000;
    EXPECT(cumem_allocate_device_on(n, foreign, &d), CUMEM_STATUS_OK);
    EXPECT(cumem_free_device_on(d, foreign), CUMEM_STATUS_OK);
    EXPECT(cumem_stream_table_size(&tn2), CUMEM_STATUS_OK);
    EXPECT(cumem_stream_forget(foreign), CUMEM_STATUS_OK);
    EXPECT(cumem_stream_table_size(&tn), CUMEM_STATUS_OK);
    CHECK(tn + 1 == tn2);
    EXPECT(cumem_stream_forget(foreign), CUMEM_STATUS_OK); /* unknown now: nothing to do */
  }
  EXPECT(cumem_stream_destroy(st), CUMEM_STATUS_OK);
  EXPECT(cumem_stream_destroy(st), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_stream_destroy(NULL), CUMEM_STATUS_INVALID_ARGUMENT);
}

static void modes(void) {
  CumemMode m = CUMEM_MODE_CUDA_ASYNC_POOL, eff = CUMEM_MODE_CUDA_ASYNC_POOL;
  int async = -1;
  void *d = NULL;
  EXPECT(cumem_supports_async_device_allocator(NULL), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_supports_async_device_allocator(&async), CUMEM_STATUS_OK);
  CHECK(async == 0 || async == 1);
  EXPECT(cumem_requested_device_allocator_mode(&m), CUMEM_STATUS_OK);
  CHECK(m == CUMEM_MODE_SYNC_POOL);
  EXPECT(cumem_set_device_allocator_mode(7, &eff), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_set_device_allocator_mode(-1, NULL), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_set_device_allocator_mode(CUMEM_MODE_ASYNC_STREAM_ORDERED, &eff), CUMEM_STATUS_OK);
  CHECK(eff == (async ? CUMEM_MODE_ASYNC_STREAM_ORDERED : CUMEM_MODE_SYNC_POOL));
  EXPECT(cumem_requested_device_allocator_mode(&m), CUMEM_STATUS_OK);
  CHECK(m == CUMEM_MODE_ASYNC_STREAM_ORDERED);
  EXPECT(cumem_effective_device_allocator_mode(&m), CUMEM_STATUS_OK);
  CHECK(m == eff);
  EXPECT(cumem_requested_device_allocator_mode(NULL), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_effective_device_allocator_mode(NULL), CUMEM_STATUS_INVALID_ARGUMENT);
  /* An allocation made in one mode is freed by it after a switch. */
  EXPECT(cumem_allocate_device_on(4096, NULL, &d), CUMEM_STATUS_OK);
  EXPECT(cumem_set_device_allocator_mode(CUMEM_MODE_SYNC_POOL, NULL), CUMEM_STATUS_OK);
  EXPECT(cumem_free_device_on(d, NULL), CUMEM_STATUS_OK);
  EXPECT(cumem_free_device_on(d, NULL), CUMEM_STATUS_DOUBLE_FREE);
  EXPECT(cumem_effective_device_allocator_mode(&m), CUMEM_STATUS_OK);
  CHECK(m == CUMEM_MODE_SYNC_POOL);
}

static void torch_entry_points(void) {
  CumemTorchCounters c0, c1;
  CumemStream a = NULL, b = NULL;
  void *p, *q;
  EXPECT(cumem_torch_counters(NULL), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_torch_counters(&c0), CUMEM_STATUS_OK);
  CHECK(cumem_torch_alloc(0, 0, NULL) == NULL); /* size 0: no memory, no failure */
  p = cumem_torch_alloc(1 << 20, 0, NULL);
  CHECK(p != NULL && (uintptr_t)p % 256 == 0);
  cumem_torch_free(p, 1 << 20, 0, NULL);
  cumem_torch_free(p, 1 << 20, 0, NULL); /* a double free: counted, nothing changes */
  cumem_torch_free(NULL, 0, 0, NULL);   /* ignored */
  CHECK(cumem_torch_alloc(256, -1, NULL) == NULL);
  CHECK(cumem_torch_alloc(256, 99, NULL) == NULL);
  EXPECT(cumem_torch_counters(&c1), CUMEM_STATUS_OK);
  CHECK(c1.free_failures == c0.free_failures + 1);
  CHECK(c1.alloc_failures == c0.alloc_failures + 2);
  /* record_stream: the free on `a` first waits for `b`. */
  EXPECT(cumem_stream_create(&a), CUMEM_STATUS_OK);
  EXPECT(cumem_stream_create(&b), CUMEM_STATUS_OK);
  q = cumem_torch_alloc(4096, 0, a);
  CHECK(q != NULL);
  EXPECT(cumem_record_stream(NULL, 0, b), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_record_stream(q, -3, b), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_record_stream(q, 0, b), CUMEM_STATUS_OK);
  EXPECT(cumem_record_stream(q, 0, b), CUMEM_STATUS_OK); /* noted once */
  cumem_torch_free(q, 4096, 0, a);
  EXPECT(cumem_torch_counters(&c0), CUMEM_STATUS_OK);
  CHECK(c0.recorded_stream_waits == c1.recorded_stream_waits + 1);
  CHECK(c0.free_failures == c1.free_failures);
  EXPECT(cumem_stream_synchronize(a), CUMEM_STATUS_OK);
  EXPECT(cumem_stream_destroy(a), CUMEM_STATUS_OK);
  EXPECT(cumem_stream_destroy(b), CUMEM_STATUS_OK);
}

/* The native PyTorch backend's entry points: statuses instead of NULL. */
static void torch_native_entry_points(void) {
  CumemTorchFigures f0, f1;
  CumemStream a = NULL;
  void *p = NULL, *q = NULL;
  EXPECT(cumem_torch_figures(0, NULL), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_torch_figures(-1, &f0), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_torch_figures(99, &f0), CUMEM_STATUS_NO_SUCH_DEVICE);
  EXPECT(cumem_torch_figures(0, &f0), CUMEM_STATUS_OK);
  EXPECT(cumem_stream_create(&a), CUMEM_STATUS_OK);
  EXPECT(cumem_torch_allocate(1 << 20, 0, a, NULL), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_torch_allocate(0, 0, a, &p), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_torch_allocate(256, 99, a, &p), CUMEM_STATUS_NO_SUCH_DEVICE);
  EXPECT(cumem_torch_allocate((size_t)1 << 62, 0, a, &p), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_torch_allocate(1 << 20, 0, a, &p), CUMEM_STATUS_OK);
  CHECK(p != NULL && (uintptr_t)p % 256 == 0);
  /* A private pool of its own (PyTorch's graphs and MemPool). */
  CumemGraphPool *g = NULL;
  CumemFreeBlock fb[4];
  size_t n = 0;
  EXPECT(cumem_graph_pool_create(0, NULL), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_graph_pool_create(-2, &g), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_graph_pool_create(0, &g), CUMEM_STATUS_OK);
  EXPECT(cumem_graph_pool_allocate(NULL, 4096, &q), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_graph_pool_allocate(g, 4096, NULL), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_graph_pool_allocate(g, 4096, &q), CUMEM_STATUS_OK);
  CHECK(q != NULL && q != p);
  EXPECT(cumem_graph_pool_free(g, (char *)q + 256), CUMEM_STATUS_INTERIOR_POINTER);
  EXPECT(cumem_graph_pool_free(g, q), CUMEM_STATUS_OK);
  EXPECT(cumem_graph_pool_free(g, q), CUMEM_STATUS_DOUBLE_FREE);
  EXPECT(cumem_graph_pool_free_blocks(g, NULL, 1, &n), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_graph_pool_free_blocks(g, fb, 4, &n), CUMEM_STATUS_OK);
  CHECK(n >= 1 && fb[0].addr == (uint64_t)(uintptr_t)q);
  EXPECT(cumem_graph_pool_allocate_at(g, q, 4096), CUMEM_STATUS_OK);
  EXPECT(cumem_graph_pool_allocate_at(g, q, 4096), CUMEM_STATUS_OTHER);
  EXPECT(cumem_torch_figures(0, &f1), CUMEM_STATUS_OK);
  CHECK(f1.reserved >= (1 << 20) && f1.peak_reserved >= f1.reserved && f1.chunks >= 1);
  CHECK(f1.device_allocs >= f1.device_frees);
  EXPECT(cumem_torch_release(NULL, 0, a), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_torch_release((char *)p + 256, 0, a), CUMEM_STATUS_INTERIOR_POINTER);
  EXPECT(cumem_torch_release(p, -1, a), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_torch_release(p, 0, a), CUMEM_STATUS_OK);
  EXPECT(cumem_torch_release(p, 0, a), CUMEM_STATUS_DOUBLE_FREE); /* nothing changes */
  EXPECT(cumem_graph_pool_free(g, q), CUMEM_STATUS_OK);
  EXPECT(cumem_graph_pool_destroy(NULL), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_graph_pool_destroy(g), CUMEM_STATUS_OK);
  EXPECT(cumem_stream_synchronize(a), CUMEM_STATUS_OK);
  EXPECT(cumem_stream_destroy(a), CUMEM_STATUS_OK);
}

/* Memory tags: the thread's tag, a tagged block through sleep (offloaded)
 * and wake (same address, same bytes), the per-tag figures, bad input. */
static void tags(void) {
  const char *weights[] = {"c_weights"};
  const char *both[] = {"c_weights", "c_kv"};
  const char *with_null[] = {"c_weights", NULL};
  char name[CUMEM_TAG_NAME_CAP];
  unsigned char data[4096], back[4096];
  CumemTagUsage u[8];
  CumemSleepReport sr;
  CumemWakeReport wr;
  CumemTorchFigures f0, f1;
  CumemStream st = NULL;
  void *w = NULL, *kv = NULL, *x = NULL;
  size_t n = 0, i, needed = 0;
  int set = -1, found = 0;
  for (i = 0; i < sizeof data; i++) data[i] = (unsigned char)(i * 7 + 3);
  EXPECT(cumem_stream_create(&st), CUMEM_STATUS_OK);
  EXPECT(cumem_tag_get(name, sizeof name, &needed), CUMEM_STATUS_OK);
  CHECK(name[0] == '\0' && needed == 1);
  EXPECT(cumem_tag_set(""), CUMEM_STATUS_CONFIG);
  EXPECT(cumem_tag_set("c_kv"), CUMEM_STATUS_OK);
  EXPECT(cumem_allocate_device(1 << 20, &kv), CUMEM_STATUS_OK);
  EXPECT(cumem_tag_set("c_weights"), CUMEM_STATUS_OK);
  EXPECT(cumem_tag_is_set(&set), CUMEM_STATUS_OK);
  CHECK(set == 1);
  EXPECT(cumem_tag_get(name, sizeof name, NULL), CUMEM_STATUS_OK);
  CHECK(strcmp(name, "c_weights") == 0);
  EXPECT(cumem_allocate_device(sizeof data, &w), CUMEM_STATUS_OK);
  EXPECT(cumem_tag_set(NULL), CUMEM_STATUS_OK);
  EXPECT(cumem_tag_is_set(&set), CUMEM_STATUS_OK);
  CHECK(set == 0);
  EXPECT(cumem_copy_to_device_async(w, data, sizeof data, st), CUMEM_STATUS_OK);
  EXPECT(cumem_stream_synchronize(st), CUMEM_STATUS_OK);
  EXPECT(cumem_torch_figures(0, &f0), CUMEM_STATUS_OK);
  CHECK(f0.tagged_in_use >= sizeof data + (1 << 20) && f0.reserved >= f0.tagged_mapped);

  EXPECT(cumem_sleep(NULL, 1, NULL, 0, NULL), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_sleep(with_null, 2, NULL, 0, NULL), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_sleep(both, 2, weights, 1, NULL), CUMEM_STATUS_CONFIG);
  EXPECT(cumem_wake(weights, 1, NULL), CUMEM_STATUS_TAG); /* awake */
  EXPECT(cumem_sleep(weights, 1, both + 1, 1, &sr), CUMEM_STATUS_OK);
  CHECK(sr.tags == 2 && sr.offloaded >= sizeof data && sr.discarded >= (1 << 20));
  EXPECT(cumem_sleep(weights, 1, NULL, 0, NULL), CUMEM_STATUS_TAG); /* twice */
  EXPECT(cumem_torch_figures(0, &f1), CUMEM_STATUS_OK);
  CHECK(f1.tagged_mapped == 0 && f1.reserved + f0.tagged_mapped == f0.reserved);
  EXPECT(cumem_tag_usage(NULL, 0, NULL), CUMEM_STATUS_INVALID_ARGUMENT);
  EXPECT(cumem_tag_usage(u, 8, &n), CUMEM_STATUS_OK);
  CHECK(n == 2);
  for (i = 0; i < n; i++) {
    CHECK(u[i].state == CUMEM_TAG_STATE_ASLEEP && u[i].mapped == 0 && u[i].device == 0);
    if (strcmp(u[i].name, "c_weights") == 0) {
      found = 1;
      CHECK(u[i].offloaded == sr.offloaded && u[i].live_blocks == 1 && u[i].reserved > 0);
    }
  }
  CHECK(found);
  EXPECT(cumem_tag_set("c_weights"), CUMEM_STATUS_OK);
  EXPECT(cumem_allocate_device(256, &x), CUMEM_STATUS_TAG);
  EXPECT(cumem_tag_set(NULL), CUMEM_STATUS_OK);

  EXPECT(cumem_wake(NULL, 0, &wr), CUMEM_STATUS_OK); /* every sleeping tag */
  CHECK(wr.tags == 2 && wr.restored == sr.offloaded && wr.mapped >= sizeof data + (1 << 20));
  memset(back, 0, sizeof back);
  EXPECT(cumem_copy_to_host_async(back, w, sizeof back, st), CUMEM_STATUS_OK);
  EXPECT(cumem_stream_synchronize(st), CUMEM_STATUS_OK);
  CHECK(memcmp(back, data, sizeof data) == 0);
  EXPECT(cumem_free_device(w), CUMEM_STATUS_OK);
  EXPECT(cumem_free_device(kv), CUMEM_STATUS_OK);
  EXPECT(cumem_stream_destroy(st), CUMEM_STATUS_OK);
}

static void summary_and_release(void) {
  size_t needed = 0, released = 0;
  char small[8];
  char *buf;
  EXPECT(cumem_memory_summary(NULL, 0, &needed), CUMEM_STATUS_BUFFER_TOO_SMALL);
  CHECK(needed > 1);
  buf = malloc(needed);
  EXPECT(cumem_memory_summary(buf, needed, NULL), CUMEM_STATUS_OK);
  CHECK(strlen(buf) + 1 == needed);
  free(buf);
  EXPECT(cumem_memory_summary(small, sizeof small, &needed), CUMEM_STATUS_BUFFER_TOO_SMALL);
  CHECK(strlen(small) == sizeof small - 1);
  EXPECT(cumem_release_cached(NULL), CUMEM_STATUS_OK);
  EXPECT(cumem_release_cached(&released), CUMEM_STATUS_OK);
}

static void shut_down(void) {
  void *live = NULL, *d = NULL;
  CumemShutdownReport r;
  CumemStatus s;
  EXPECT(cumem_allocate_device(10000, &live), CUMEM_STATUS_OK);
  EXPECT(cumem_shutdown(&r), CUMEM_STATUS_OK);
  CHECK(r.live_count == 1 && r.live_bytes >= 10000);
  EXPECT(cumem_allocate_device(256, &d), CUMEM_STATUS_SHUT_DOWN);
  EXPECT(cumem_allocate_pinned(256, &d), CUMEM_STATUS_SHUT_DOWN);
  CHECK(cumem_torch_alloc(256, 0, NULL) == NULL);
  /* Live memory stays valid and can still be freed, once (its chunk then
   * goes back to the driver, so a second free names an unknown pointer). */
  EXPECT(cumem_free_device(live), CUMEM_STATUS_OK);
  s = cumem_free_device(live);
  CHECK(s == CUMEM_STATUS_DOUBLE_FREE || s == CUMEM_STATUS_UNKNOWN_POINTER);
  EXPECT(cumem_shutdown(NULL), CUMEM_STATUS_OK);
}

int main(void) {
  names_and_errors();
  init();
  backend();
  pool_sizes_before_use();
  pinned();
  device();
  peers();
  ipc();
  streams_and_copies();
  modes();
  torch_entry_points();
  torch_native_entry_points();
  tags();
  summary_and_release();
  shut_down();
  printf("cumem C test: all %d checks passed\n", checks);
  return 0;
}
