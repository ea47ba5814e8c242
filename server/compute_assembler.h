// Assembles the tensor parts of one Compute stream into host buffers: checks that each part
// names an input the header sends, fits its size limit, continues its tensor exactly where
// the last part ended, and does not run past the shape; then that every tensor is complete.
// Pure logic on messages, no RPC state: the reactor feeds it, the fuzzer drives it.
#ifndef LOSSD_SERVER_COMPUTE_ASSEMBLER_H_
#define LOSSD_SERVER_COMPUTE_ASSEMBLER_H_

#include <array>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "lossd/v1/lossd.pb.h"
#include "server/engine/compute_plan.h"
#include "server/engine/engine.h"

namespace lossd {

class ComputeAssembler {
 public:
  ComputeAssembler(std::shared_ptr<const ComputePlan> plan, uint64_t max_part_bytes,
                   uint64_t max_parts = UINT64_MAX);

  // Copies one part into place; INVALID_ARGUMENT naming the tensor, offset and sizes.
  absl::Status Accept(const v1::TensorPart& part);
  // OK when every input of the plan has all its bytes.
  absl::Status CheckComplete() const;

  std::shared_ptr<Engine::InputBuffers> buffers() { return buffers_; }
  uint64_t bytes_received() const { return bytes_received_; }

 private:
  std::shared_ptr<const ComputePlan> plan_;
  const uint64_t max_part_bytes_;
  const uint64_t max_parts_;
  uint64_t parts_ = 0;
  std::shared_ptr<Engine::InputBuffers> buffers_;
  std::array<uint64_t, static_cast<int>(InputSlot::kCount)> received_{};
  uint64_t bytes_received_ = 0;
};

}  // namespace lossd

#endif  // LOSSD_SERVER_COMPUTE_ASSEMBLER_H_
