// Early-return helpers for absl::Status (this Abseil has no status_macros.h).
#ifndef LOSSD_CORE_STATUS_MACROS_H_
#define LOSSD_CORE_STATUS_MACROS_H_

#include "absl/status/status.h"

#define LOSSD_RETURN_IF_ERROR(expr)            \
  do {                                         \
    ::absl::Status lossd_status_ = (expr);     \
    if (!lossd_status_.ok()) return lossd_status_; \
  } while (0)

#endif  // LOSSD_CORE_STATUS_MACROS_H_
