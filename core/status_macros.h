// SPDX-License-Identifier: Apache-2.0
// The one set of early-return helpers for absl::Status code in lossd (this Abseil has no
// status_macros.h). Used by every layer; adds nothing to a status it passes on. The CUDA and
// cuBLAS error macros, which turn runtime codes into a Status, stay in kernels/cuda.
#ifndef LOSSD_CORE_STATUS_MACROS_H_
#define LOSSD_CORE_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

// Returns the status of `expr` (an absl::Status) from the enclosing function unless it is OK.
#define LOSSD_RETURN_IF_ERROR(expr)                \
  do {                                             \
    ::absl::Status lossd_status_ = (expr);         \
    if (!lossd_status_.ok()) return lossd_status_; \
  } while (0)

// Evaluates `expr` (an absl::StatusOr<T>); returns its status unless it is OK, else moves its
// value into `lhs`, a declaration (`auto x`) or an lvalue. Expands to several statements: not
// for the body of an unbraced if or loop.
#define LOSSD_ASSIGN_OR_RETURN(lhs, expr) \
  LOSSD_ASSIGN_OR_RETURN_IMPL_(LOSSD_STATUS_CONCAT_(lossd_statusor_, __LINE__), lhs, expr)

#define LOSSD_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                                 \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(*statusor)

#define LOSSD_STATUS_CONCAT_(a, b) LOSSD_STATUS_CONCAT_INNER_(a, b)
#define LOSSD_STATUS_CONCAT_INNER_(a, b) a##b

#endif  // LOSSD_CORE_STATUS_MACROS_H_
