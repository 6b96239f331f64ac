// A stand-in for the rapids_logger library that RMM's headers include: the
// replay needs no logging, and the library (built with its own CMake
// project) is not on the GPU machines. Every call is accepted and does
// nothing. Only what RMM's headers use is here.
#pragma once

#include <memory>
#include <string>
#include <vector>

namespace rapids_logger {

enum class level_enum { trace, debug, info, warn, error, critical, off };

struct sink {
  virtual ~sink() = default;
};
using sink_ptr = std::shared_ptr<sink>;

struct basic_file_sink_mt : sink {
  basic_file_sink_mt(std::string const&, bool = false) {}
};
struct stderr_sink_mt : sink {};

class logger {
 public:
  logger(std::string, std::vector<sink_ptr>) {}
  logger(std::string, std::string) {}
  void set_pattern(std::string const&) {}
  void set_level(level_enum) {}
  void flush_on(level_enum) {}
  void flush() {}
  template <typename... Args>
  void log(level_enum, Args&&...)
  {
  }

// One method per level, each accepting anything and doing nothing.
#define RAPIDS_LOGGER_STUB_LEVEL(name) \
  template <typename... Args>          \
  void name(Args&&...)                 \
  {                                    \
  }
  RAPIDS_LOGGER_STUB_LEVEL(trace)
  RAPIDS_LOGGER_STUB_LEVEL(debug)
  RAPIDS_LOGGER_STUB_LEVEL(info)
  RAPIDS_LOGGER_STUB_LEVEL(warn)
  RAPIDS_LOGGER_STUB_LEVEL(error)
  RAPIDS_LOGGER_STUB_LEVEL(critical)
#undef RAPIDS_LOGGER_STUB_LEVEL
};

}  // namespace rapids_logger
