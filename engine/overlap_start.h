// SPDX-License-Identifier: Apache-2.0
// When an overlapped Compute (ComputeHeader.overlap) may start: the policy alone, as a pure
// function of what has arrived and how busy the executor is. Never starts anything itself.
#ifndef LOSSD_ENGINE_OVERLAP_START_H_
#define LOSSD_ENGINE_OVERLAP_START_H_

#include <cstdint>

namespace lossd {

struct OverlapProgress {
  bool all_but_x_complete = false;  // every input but X has all its bytes
  int64_t x_rows_ready = 0;         // leading rows of X complete (and checked)
  int64_t bt = 0;                   // rows of X in all
};

// True once every input but X is in, and then: at once when all of X is in too, or when
// `start_when_busy` (--overlap_start_when_busy), else only while the executor is idle.
// Overlap is for hiding the wire from a device that would otherwise wait; with other
// computes queued or running, an early start would hold the executor on this stream's rows
// while theirs are all in, so such a Compute starts once its X is complete.
bool OverlapMayStart(const OverlapProgress& p, bool start_when_busy, bool executor_idle);

}  // namespace lossd

#endif  // LOSSD_ENGINE_OVERLAP_START_H_
