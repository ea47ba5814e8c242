// SPDX-License-Identifier: Apache-2.0
// Assembles the tensor parts of one Compute stream into host buffers: checks that each part
// names an input the header sends, fits its size limit, continues its tensor exactly where
// the last part ended, and does not run past the shape; then that every tensor is complete.
// With check_finite it also runs the engine's NaN/Inf test on each float input as its parts
// arrive, so the compute need not scan them again. Pure logic on parts, no RPC state: the
// reactor feeds it, the fuzzer drives it. Never parses protobuf payloads itself.
#ifndef LOSSD_SERVICE_COMPUTE_ASSEMBLER_H_
#define LOSSD_SERVICE_COMPUTE_ASSEMBLER_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "lossd/v1/lossd.pb.h"
#include "engine/compute_plan.h"
#include "engine/engine.h"

namespace lossd {

class ComputeAssembler {
 public:
  // A piece of a part's data: a pointer into a received message and its length.
  using Piece = std::pair<const uint8_t*, size_t>;

  // check_finite: refuse NaN/Inf in the float inputs (x, w, bias, class_weights,
  // grad_output, the loss kinds' per-row inputs and inline teacher) part by part, with the
  // engine's message (then finite_checked() is true and Engine::Run may skip its own scan).
  ComputeAssembler(std::shared_ptr<const ComputePlan> plan, uint64_t max_part_bytes,
                   uint64_t max_parts = UINT64_MAX, bool check_finite = false);

  // Copies one part into place; INVALID_ARGUMENT naming the tensor, offset and sizes.
  absl::Status Accept(const v1::TensorPart& part);
  // The same for a part parsed in place: `pieces` hold its `size` data bytes, in order.
  absl::Status Accept(int32_t tensor, uint64_t offset, absl::Span<const Piece> pieces,
                      uint64_t size);
  // OK when every input of the plan has all its bytes.
  absl::Status CheckComplete() const;

  // Overlapped Computes: every input but X has all its bytes (the compute can start).
  bool AllButXComplete() const;
  // Whole rows of X received (and, with check_finite, checked) after the last OK Accept.
  int64_t XRowsReady() const;

  std::shared_ptr<Engine::InputBuffers> buffers() { return buffers_; }
  uint64_t bytes_received() const { return bytes_received_; }
  bool finite_checked() const { return check_finite_; }

 private:
  // Runs the finiteness test on the whole elements of slot i received since the last call.
  absl::Status CheckNewElements(int i);

  std::shared_ptr<const ComputePlan> plan_;
  const uint64_t max_part_bytes_;
  const uint64_t max_parts_;
  const bool check_finite_;
  uint64_t parts_ = 0;
  std::shared_ptr<Engine::InputBuffers> buffers_;
  std::array<uint64_t, static_cast<int>(InputSlot::kCount)> received_{};
  std::array<uint64_t, static_cast<int>(InputSlot::kCount)> checked_{};  // elements
  uint64_t bytes_received_ = 0;
};

}  // namespace lossd

#endif  // LOSSD_SERVICE_COMPUTE_ASSEMBLER_H_
