#include "server/compute_assembler.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/wire_convert.h"

namespace lossd {

ComputeAssembler::ComputeAssembler(std::shared_ptr<const ComputePlan> plan,
                                   uint64_t max_part_bytes, uint64_t max_parts)
    : plan_(std::move(plan)),
      max_part_bytes_(max_part_bytes),
      max_parts_(max_parts),
      buffers_(std::make_shared<Engine::InputBuffers>()) {
  for (int i = 0; i < static_cast<int>(InputSlot::kCount); ++i) {
    if (plan_->input_bytes[i] > 0) (*buffers_)[i] = NewHostBuffer(plan_->input_bytes[i]);
  }
}

absl::Status ComputeAssembler::Accept(const v1::TensorPart& part) {
  if (++parts_ > max_parts_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the stream sent more than --max_parts_per_request=", max_parts_,
        " parts; send larger parts"));
  }
  auto slot = InputSlotFromWire(part.tensor());
  if (!slot.ok()) return slot.status();
  const int i = static_cast<int>(*slot);
  const char* name = InputSlotName(*slot);
  const uint64_t expected = plan_->input_bytes[i];
  const uint64_t size = part.data().size();
  if (expected == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a part of ", name, " arrived but the header does not send ", name,
        *slot == InputSlot::kW || *slot == InputSlot::kBias ? " inline" : ""));
  }
  if (size > max_part_bytes_) {
    return absl::InvalidArgumentError(absl::StrCat("a part of ", name, " carries ", size,
                                                   " bytes, more than --max_part_bytes=",
                                                   max_part_bytes_));
  }
  if (part.offset() != received_[i]) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a part of ", name, " starts at byte offset ", part.offset(), " but ", received_[i],
        " bytes of it were received: parts must arrive in order, without gaps or overlaps"));
  }
  if (size > expected - part.offset()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a part of ", name, " at offset ", part.offset(), " with ", size,
        " bytes runs past the ", expected, " bytes that its shape and dtype give"));
  }
  std::memcpy((*buffers_)[i].get() + part.offset(), part.data().data(), size);
  received_[i] += size;
  bytes_received_ += size;
  return absl::OkStatus();
}

absl::Status ComputeAssembler::CheckComplete() const {
  for (int i = 0; i < static_cast<int>(InputSlot::kCount); ++i) {
    if (received_[i] != plan_->input_bytes[i]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the Compute stream closed early: ", InputSlotName(static_cast<InputSlot>(i)),
          " has ", received_[i], " of its ", plan_->input_bytes[i], " bytes"));
    }
  }
  return absl::OkStatus();
}

}  // namespace lossd
