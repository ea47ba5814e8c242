// SPDX-License-Identifier: Apache-2.0
#include "service/overlap_sends.h"

#include <algorithm>
#include <utility>

namespace lossd {

OverlapSends::OverlapSends(std::vector<uint64_t> output_bytes, int dx_output, int64_t bt,
                           uint32_t part_bytes)
    : output_bytes_(std::move(output_bytes)),
      dx_output_(dx_output),
      bt_(bt),
      part_bytes_(part_bytes) {}

void OverlapSends::ComputeEnded(const absl::Status& s) {
  computing_ = false;
  if (!s.ok()) {
    Fail(s);
    return;
  }
  computed_ = true;
}

OverlapSends::Step OverlapSends::Next(int64_t dx_rows_final) {
  Step step;
  if (writing_ || tail_ == Tail::kFinished) return step;
  if (!error_.ok()) {
    if (computing_ || handling_read_) return step;  // they call Next when they end
    tail_ = Tail::kFinished;
    step.kind = Step::Kind::kFinish;
    step.status = error_;
    return step;
  }
  if (NextPart(dx_rows_final, &step)) {
    writing_ = true;
    return step;
  }
  if (!computed_ || !reads_done_ || handling_read_) return step;
  if (tail_ == Tail::kOpen) {
    tail_ = Tail::kFinalSummarySent;
    writing_ = true;
    step.kind = Step::Kind::kFinalSummary;
    return step;
  }
  tail_ = Tail::kFinished;
  step.kind = Step::Kind::kFinish;
  return step;
}

bool OverlapSends::NextPart(int64_t dx_rows_final, Step* step) {
  if (dx_output_ >= 0) {
    const uint64_t row_bytes = bt_ > 0 ? output_bytes_[dx_output_] / bt_ : 0;
    // Once the compute is done every row is final, reported or not.
    const int64_t rows = computed_ ? bt_ : dx_rows_final;
    const uint64_t ready = static_cast<uint64_t>(rows) * row_bytes;
    if (dx_sent_ < ready) {
      step->kind = Step::Kind::kPart;
      step->output = static_cast<size_t>(dx_output_);
      step->offset = dx_sent_;
      step->bytes = std::min<uint64_t>(part_bytes_, ready - dx_sent_);
      dx_sent_ += step->bytes;
      return true;
    }
  }
  if (!computed_) return false;
  while (output_ < output_bytes_.size() &&
         (static_cast<int>(output_) == dx_output_ || offset_ >= output_bytes_[output_])) {
    ++output_;
    offset_ = 0;
  }
  if (output_ == output_bytes_.size()) return false;
  step->kind = Step::Kind::kPart;
  step->output = output_;
  step->offset = offset_;
  step->bytes = std::min<uint64_t>(part_bytes_, output_bytes_[output_] - offset_);
  offset_ += step->bytes;
  return true;
}

}  // namespace lossd
