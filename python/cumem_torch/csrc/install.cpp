// The library's C entry points, called from Python with ctypes (no
// Python.h: one build serves every Python version of a PyTorch build).
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "backend.h"
#include "cumem.h"

namespace {

std::shared_ptr<cumem_torch::CumemAllocator>& installed() {
  static std::shared_ptr<cumem_torch::CumemAllocator> a;
  return a;
}

void put_message(const std::string& m, char* buf, size_t len) {
  if (!buf || len == 0) return;
  size_t n = std::min(m.size(), len - 1);
  std::memcpy(buf, m.data(), n);
  buf[n] = '\0';
}

} // namespace

extern "C" {

// Makes cumem's allocator PyTorch's CUDA allocator. Returns 0, or 1 with
// the reason in `err` (PyTorch refuses once its own has served memory).
__attribute__((visibility("default"))) int cumem_torch_native_install(char* err, size_t len) {
  try {
    if (installed()) return 0;
    // Never destroyed: PyTorch frees tensors (cuBLAS workspaces, globals)
    // during static destruction at exit, after this library's statics and
    // PyTorch's own shared_ptr to the allocator may be gone.
    std::shared_ptr<cumem_torch::CumemAllocator> a(new cumem_torch::CumemAllocator(),
                                                   [](cumem_torch::CumemAllocator*) {});
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(a);
    installed() = a;
    return 0;
  } catch (const std::exception& e) {
    put_message(e.what(), err, len);
    return 1;
  }
}

// Whether cumem's allocator is PyTorch's current CUDA allocator.
__attribute__((visibility("default"))) int cumem_torch_native_active() {
  auto& a = installed();
  return a && c10::cuda::CUDACachingAllocator::get() == a.get() ? 1 : 0;
}

// Completes the frees waiting for record_stream's events (waiting for
// them), so that a memory tag about to sleep offloads no block the program
// freed already. Returns 0, or 1 with the reason in `err`.
__attribute__((visibility("default"))) int cumem_torch_native_drain_frees(char* err, size_t len) {
  try {
    auto& a = installed();
    if (a) a->drain_pending_frees();
    return 0;
  } catch (const std::exception& e) {
    put_message(e.what(), err, len);
    return 1;
  }
}

// The copy of cumem's library this backend allocates from, as this
// library's calls reach it (cumem_instance_id): install() compares it with
// the copy Python's calls reach and refuses two (two cumem managers).
__attribute__((visibility("default"))) uint64_t cumem_torch_native_instance_id() {
  return cumem_instance_id();
}

} // extern "C"
