// SPDX-License-Identifier: Apache-2.0
// The send order of an overlapped Compute (ComputeHeader.overlap) and when it may finish:
// dX parts as the backend reports its rows final; once the compute is done the rest of dX,
// every other output in plan order, then the final summary; and the finish only when no
// compute job, no write and no read handling is in flight, so nothing still running can
// touch a finished call. Bookkeeping only: it never writes, never touches gRPC, and is not
// thread-safe (the reactor calls it under its lock).
#ifndef LOSSD_SERVICE_OVERLAP_SENDS_H_
#define LOSSD_SERVICE_OVERLAP_SENDS_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"

namespace lossd {

class OverlapSends {
 public:
  // `output_bytes`: each output's size, in the plan's order; `dx_output`: the index of dX
  // among them (-1: none); `bt`: rows of dX; `part_bytes`: the most bytes a part carries.
  OverlapSends(std::vector<uint64_t> output_bytes, int dx_output, int64_t bt,
               uint32_t part_bytes);

  // What is in flight; each end is followed by a Next.
  void WriteStarted() { writing_ = true; }  // the preliminary summary, before any Next
  void WriteDone() { writing_ = false; }
  void SetHandlingRead(bool handling) { handling_read_ = handling; }
  void ComputeStarted() { computing_ = true; }
  // The compute job ended: OK makes every output final; an error fails the call.
  void ComputeEnded(const absl::Status& s);
  // The client closed its side with every input complete.
  void ReadsDone() { reads_done_ = true; }
  // The call failed; the first failure wins.
  void Fail(const absl::Status& s) {
    if (error_.ok()) error_ = s;
  }
  const absl::Status& error() const { return error_; }
  bool computed() const { return computed_; }

  struct Step {
    enum class Kind {
      kWait,          // nothing may go now; a later event calls Next again
      kPart,          // bytes [offset, offset + bytes) of output `output`
      kFinalSummary,  // the final summary
      kFinish,        // finish the call with `status` (returned once)
    };
    Kind kind = Kind::kWait;
    size_t output = 0;
    uint64_t offset = 0, bytes = 0;
    absl::Status status;
  };
  // The next step, given how many rows of dX the backend has reported final. A part and the
  // final summary each put a write in flight (WriteDone ends it).
  Step Next(int64_t dx_rows_final);

 private:
  // The next output part that may go now; false: none yet.
  bool NextPart(int64_t dx_rows_final, Step* step);

  const std::vector<uint64_t> output_bytes_;
  const int dx_output_;
  const int64_t bt_;
  const uint32_t part_bytes_;

  bool writing_ = false;
  bool handling_read_ = false;
  bool computing_ = false;
  bool computed_ = false;
  bool reads_done_ = false;
  // The end of the call: the final summary, then the finish.
  enum class Tail { kOpen, kFinalSummarySent, kFinished };
  Tail tail_ = Tail::kOpen;
  absl::Status error_;
  uint64_t dx_sent_ = 0;  // bytes of dX handed out
  size_t output_ = 0;     // the other outputs: the one being sent, and how far
  uint64_t offset_ = 0;
};

}  // namespace lossd

#endif  // LOSSD_SERVICE_OVERLAP_SENDS_H_
