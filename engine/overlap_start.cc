// SPDX-License-Identifier: Apache-2.0
#include "engine/overlap_start.h"

namespace lossd {

bool OverlapMayStart(const OverlapProgress& p, bool start_when_busy, bool executor_idle) {
  if (!p.all_but_x_complete) return false;
  return p.x_rows_ready >= p.bt || start_when_busy || executor_idle;
}

}  // namespace lossd
