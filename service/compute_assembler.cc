// SPDX-License-Identifier: Apache-2.0
#include "service/compute_assembler.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "service/wire_convert.h"

namespace lossd {

ComputeAssembler::ComputeAssembler(std::shared_ptr<const ComputePlan> plan,
                                   uint64_t max_part_bytes, uint64_t max_parts, bool check_finite)
    : plan_(std::move(plan)),
      max_part_bytes_(max_part_bytes),
      max_parts_(max_parts),
      check_finite_(check_finite),
      buffers_(std::make_shared<Engine::InputBuffers>()) {
  for (int i = 0; i < static_cast<int>(InputSlot::kCount); ++i) {
    if (plan_->input_bytes[i] > 0) (*buffers_)[i] = NewHostBuffer(plan_->input_bytes[i]);
  }
}

absl::Status ComputeAssembler::Accept(const v1::TensorPart& part) {
  const Piece piece(reinterpret_cast<const uint8_t*>(part.data().data()), part.data().size());
  return Accept(part.tensor(), part.offset(), absl::MakeConstSpan(&piece, 1), piece.second);
}

absl::Status ComputeAssembler::Accept(int32_t tensor, uint64_t offset,
                                      absl::Span<const Piece> pieces, uint64_t size) {
  if (++parts_ > max_parts_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the stream sent more than --max_parts_per_request=", max_parts_,
        " parts; send larger parts"));
  }
  auto slot = InputSlotFromWire(static_cast<v1::TensorId>(tensor));
  if (!slot.ok()) return slot.status();
  const int i = static_cast<int>(*slot);
  const char* name = InputSlotName(*slot);
  const uint64_t expected = plan_->input_bytes[i];
  if (expected == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a part of ", name, " arrived but the header does not send ", name,
        *slot == InputSlot::kW || *slot == InputSlot::kBias || *slot == InputSlot::kTeacherW ||
                *slot == InputSlot::kTeacherBias
            ? " inline"
            : ""));
  }
  if (size > max_part_bytes_) {
    return absl::InvalidArgumentError(absl::StrCat("a part of ", name, " carries ", size,
                                                   " bytes, more than --max_part_bytes=",
                                                   max_part_bytes_));
  }
  if (offset != received_[i]) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a part of ", name, " starts at byte offset ", offset, " but ", received_[i],
        " bytes of it were received: parts must arrive in order, without gaps or overlaps"));
  }
  if (size > expected - offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a part of ", name, " at offset ", offset, " with ", size,
        " bytes runs past the ", expected, " bytes that its shape and dtype give"));
  }
  uint8_t* dst = (*buffers_)[i].get() + offset;
  for (const Piece& p : pieces) {
    std::memcpy(dst, p.first, p.second);
    dst += p.second;
  }
  received_[i] += size;
  bytes_received_ += size;
  return check_finite_ ? CheckNewElements(i) : absl::OkStatus();
}

absl::Status ComputeAssembler::CheckNewElements(int i) {
  const InputSlot slot = static_cast<InputSlot>(i);
  DType dtype = plan_->dtype;
  int64_t cols = 0;  // row width for the message's [row, col]
  switch (slot) {
    case InputSlot::kX:
    case InputSlot::kW:
      cols = plan_->h;
      break;
    case InputSlot::kTeacherX:
    case InputSlot::kTeacherW:
      cols = plan_->teacher_h;
      break;
    case InputSlot::kBias:
    case InputSlot::kTeacherBias:
      break;
    case InputSlot::kClassWeights:
    case InputSlot::kGradOutput:
    case InputSlot::kDlogp:
    case InputSlot::kDentropy:
    case InputSlot::kAdvantages:
    case InputSlot::kOldLogp:
    case InputSlot::kRefLogp:
    case InputSlot::kIsRatio:
    case InputSlot::kTeacherTopkLogp:
      dtype = DType::kF32;
      break;
    default:
      return absl::OkStatus();  // targets: not floats
  }
  // Only whole elements: a part may end inside one; the rest of it comes with the next part.
  const uint64_t whole = received_[i] / DTypeSize(dtype);
  const uint64_t first = checked_[i];
  checked_[i] = whole;
  return CheckFiniteElements((*buffers_)[i].get(), dtype, first, whole - first,
                             InputSlotName(slot), cols);
}

bool ComputeAssembler::AllButXComplete() const {
  for (int i = 0; i < static_cast<int>(InputSlot::kCount); ++i) {
    if (i != static_cast<int>(InputSlot::kX) && received_[i] != plan_->input_bytes[i]) {
      return false;
    }
  }
  return true;
}

int64_t ComputeAssembler::XRowsReady() const {
  const uint64_t row_bytes = static_cast<uint64_t>(plan_->h) * DTypeSize(plan_->dtype);
  if (row_bytes == 0) return plan_->bt;
  return static_cast<int64_t>(received_[static_cast<int>(InputSlot::kX)] / row_bytes);
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
