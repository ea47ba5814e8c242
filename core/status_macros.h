// Early-return helpers for absl::Status code (this Abseil has no status_macros.h): the one
// header for them in the tree. They only return the error they were given; they never log,
// wrap or change it. (CUDA and cuBLAS return codes have their own macros inside kernels/cuda.)
#ifndef LOSSD_CORE_STATUS_MACROS_H_
#define LOSSD_CORE_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

// Returns the absl::Status `expr` evaluates to, unless it is OK.
#define LOSSD_RETURN_IF_ERROR(expr)            \
  do {                                         \
    ::absl::Status lossd_status_ = (expr);     \
    if (!lossd_status_.ok()) return lossd_status_; \
  } while (0)

// LOSSD_ASSIGN_OR_RETURN(auto x, F()); or LOSSD_ASSIGN_OR_RETURN(x, F()); for an existing x:
// evaluates the absl::StatusOr `expr`, returns its status unless it is OK, else moves its value
// into `lhs`. Expands to more than one statement: give it braces inside an if or a loop.
#define LOSSD_ASSIGN_OR_RETURN(lhs, expr) \
  LOSSD_ASSIGN_OR_RETURN_IMPL_(LOSSD_STATUS_MACROS_CONCAT_(lossd_statusor_, __LINE__), lhs, expr)

#define LOSSD_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                                 \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()

#define LOSSD_STATUS_MACROS_CONCAT_INNER_(a, b) a##b
#define LOSSD_STATUS_MACROS_CONCAT_(a, b) LOSSD_STATUS_MACROS_CONCAT_INNER_(a, b)

#endif  // LOSSD_CORE_STATUS_MACROS_H_
