// What RMM's build generates as <rmm/logger_macros.hpp>, for a replay
// that logs nothing: the levels, the active level (off), and macros that
// compile to nothing.
#pragma once

#define RMM_LOG_LEVEL_TRACE 0
#define RMM_LOG_LEVEL_DEBUG 1
#define RMM_LOG_LEVEL_INFO 2
#define RMM_LOG_LEVEL_WARN 3
#define RMM_LOG_LEVEL_ERROR 4
#define RMM_LOG_LEVEL_CRITICAL 5
#define RMM_LOG_LEVEL_OFF 6

#ifndef RMM_LOG_ACTIVE_LEVEL
#define RMM_LOG_ACTIVE_LEVEL RMM_LOG_LEVEL_OFF
#endif

#define RMM_LOG_TRACE(...) (void)0
#define RMM_LOG_DEBUG(...) (void)0
#define RMM_LOG_INFO(...) (void)0
#define RMM_LOG_WARN(...) (void)0
#define RMM_LOG_ERROR(...) (void)0
#define RMM_LOG_CRITICAL(...) (void)0
