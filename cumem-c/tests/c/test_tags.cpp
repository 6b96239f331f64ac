// cumem.hpp's memory tags: TagScope nests and restores the thread's tag,
// MemoryManager::sleep / wake / tagUsage, a refusal as cumem::Error. Built
// and run by tests/c_abi.rs against libcumem_c.so; passes on a GPU and on
// the host fallback. Prints "cumem C++ tags test: ok" at the end.
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cumem.hpp"

#define CHECK(cond)                                                               \
  do {                                                                            \
    if (!(cond)) {                                                                \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      std::exit(1);                                                               \
    }                                                                             \
  } while (0)

int main() {
  auto& mm = cumem::MemoryManager::getInstance();
  void* p = nullptr;
  {
    cumem::TagScope weights("cpp_weights");
    {
      cumem::TagScope kv("cpp_kv");
      CHECK(cumem::TagScope::current() == "cpp_kv");
    }
    CHECK(cumem::TagScope::current() == "cpp_weights");
    p = mm.allocateDevice(1 << 20);
  }
  CHECK(cumem::TagScope::current().empty());
  try {
    cumem::TagScope bad("");
    CHECK(false);
  } catch (const cumem::Error& e) {
    CHECK(e.status() == CUMEM_STATUS_CONFIG);
  }
  CHECK(cumem::TagScope::current().empty());

  CumemSleepReport r = mm.sleep({"cpp_weights"}, {});
  CHECK(r.tags == 1 && r.offloaded >= (1 << 20) && r.released > 0);
  std::vector<CumemTagUsage> u = mm.tagUsage();
  CHECK(u.size() == 1 && std::strcmp(u[0].name, "cpp_weights") == 0);
  CHECK(u[0].state == CUMEM_TAG_STATE_ASLEEP && u[0].mapped == 0 && u[0].offloaded == r.offloaded);
  CumemWakeReport w = mm.wake();
  CHECK(w.tags == 1 && w.restored == r.offloaded);
  try {
    mm.wake({"cpp_weights"});
    CHECK(false);
  } catch (const cumem::Error& e) {
    CHECK(e.status() == CUMEM_STATUS_TAG);
  }
  mm.freeDevice(p);
  std::printf("cumem C++ tags test: ok\n");
  return 0;
}
