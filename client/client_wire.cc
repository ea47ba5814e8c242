// SPDX-License-Identifier: Apache-2.0
#include "client/client_wire.h"

#include <algorithm>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace lossd {
namespace client {

namespace {

// The one table of DType <-> v1::DType that both directions read.
constexpr std::pair<DType, v1::DType> kDTypes[] = {
    {DType::kBF16, v1::DTYPE_BF16}, {DType::kF16, v1::DTYPE_FP16},
    {DType::kF32, v1::DTYPE_FP32},  {DType::kI32, v1::DTYPE_INT32},
    {DType::kI64, v1::DTYPE_INT64},
};

}  // namespace

v1::DType ToProto(DType t) {
  for (const auto& [dtype, wire] : kDTypes) {
    if (dtype == t) return wire;
  }
  return v1::DTYPE_UNSPECIFIED;
}

absl::StatusOr<DType> FromProto(v1::DType t) {
  for (const auto& [dtype, wire] : kDTypes) {
    if (wire == t) return dtype;
  }
  return absl::InternalError(absl::StrCat("server sent an unknown dtype ", t));
}

v1::Reduction ToProto(Reduction r) {
  switch (r) {
    case Reduction::kMean:
      return v1::REDUCTION_MEAN;
    case Reduction::kSum:
      return v1::REDUCTION_SUM;
    case Reduction::kNone:
      return v1::REDUCTION_NONE;
  }
  return v1::REDUCTION_MEAN;
}

v1::LossKind ToProto(LossKind k) {
  switch (k) {
    case LossKind::kCrossEntropy:
      return v1::LOSS_KIND_CROSS_ENTROPY;
    case LossKind::kLogprob:
      return v1::LOSS_KIND_LOGPROB;
    case LossKind::kPolicy:
      return v1::LOSS_KIND_POLICY;
    case LossKind::kDistill:
      return v1::LOSS_KIND_DISTILL;
  }
  // Out of range: sent as it is, for the server to refuse naming the value.
  return static_cast<v1::LossKind>(static_cast<int>(k));
}

v1::PolicyLossType ToProto(PolicyLossType t) {
  switch (t) {
    case PolicyLossType::kDapo:
      return v1::POLICY_LOSS_DAPO;
    case PolicyLossType::kGrpo:
      return v1::POLICY_LOSS_GRPO;
    case PolicyLossType::kBnpo:
      return v1::POLICY_LOSS_BNPO;
    case PolicyLossType::kDrGrpo:
      return v1::POLICY_LOSS_DR_GRPO;
    case PolicyLossType::kCispo:
      return v1::POLICY_LOSS_CISPO;
    case PolicyLossType::kSapo:
      return v1::POLICY_LOSS_SAPO;
    case PolicyLossType::kLuspo:
      return v1::POLICY_LOSS_LUSPO;
    case PolicyLossType::kGpg:
      return v1::POLICY_LOSS_GPG;
    case PolicyLossType::kGeoMean:
      return v1::POLICY_LOSS_GEO_MEAN;
    case PolicyLossType::kKlCov:
      return v1::POLICY_LOSS_KL_COV;
    case PolicyLossType::kVespo:
      return v1::POLICY_LOSS_VESPO;
    case PolicyLossType::kCispoClamp:
      return v1::POLICY_LOSS_CISPO_CLAMP;
  }
  return static_cast<v1::PolicyLossType>(static_cast<int>(t));
}

void FillSpec(const HostTensor& t, v1::TensorSpec* spec) {
  spec->set_dtype(ToProto(t.dtype()));
  for (int64_t d : t.shape()) spec->add_shape(d);
}

std::string TensorIdName(int32_t id) {
  if (id >= static_cast<int32_t>(OutputTensor::kLoss) &&
      id <= static_cast<int32_t>(kLastOutputTensor)) {
    return OutputTensorName(static_cast<OutputTensor>(id));
  }
  return absl::StrCat("tensor#", id);
}

std::vector<int64_t> ShapeOf(const v1::TensorSpec& spec) {
  return std::vector<int64_t>(spec.shape().begin(), spec.shape().end());
}

ServerInfoResult ServerInfoFromProto(const v1::ServerInfoResponse& resp) {
  ServerInfoResult info;
  info.version = resp.version();
  info.instance = resp.instance();
  info.backend = resp.backend();
  info.device = resp.device();
  info.memory_total_bytes = resp.memory_total_bytes();
  info.memory_budget_bytes = resp.memory_budget_bytes();
  info.memory_in_use_bytes = resp.memory_in_use_bytes();
  info.weight_cache_budget_bytes = resp.weight_cache_budget_bytes();
  info.weight_cache_bytes = resp.weight_cache_bytes();
  info.max_part_bytes = resp.max_part_bytes();
  info.max_bt = resp.max_bt();
  info.max_h = resp.max_h();
  info.max_v = resp.max_v();
  info.max_in_flight = resp.max_in_flight();
  info.accumulators = resp.accumulators();
  info.features.assign(resp.features().begin(), resp.features().end());
  info.compute_path = resp.compute_path();
  return info;
}

std::string RandomUploadId() {
  std::random_device rd;
  uint64_t half[2];
  for (uint64_t& h : half) h = (static_cast<uint64_t>(rd()) << 32) | rd();
  return absl::StrFormat("%016x%016x", half[0], half[1]);
}

void AppendRange(v1::TensorId id, const HostTensor& t, size_t begin, size_t end,
                 size_t part_bytes, wire::SliceTracker* tracker, std::vector<grpc::ByteBuffer>* out,
                 uint64_t* bytes) {
  const size_t elem = DTypeSize(t.dtype());
  const size_t step = std::max(elem, part_bytes - part_bytes % elem);
  for (size_t off = begin; off < end; off += step) {
    out->push_back(wire::EncodePart(id, off, t.data() + off, std::min(step, end - off), tracker));
  }
  *bytes += end - begin;
}

void AppendParts(v1::TensorId id, const HostTensor& t, size_t part_bytes,
                 wire::SliceTracker* tracker,
                 std::vector<grpc::ByteBuffer>* out, uint64_t* bytes) {
  AppendRange(id, t, 0, t.num_bytes(), part_bytes, tracker, out, bytes);
}

}  // namespace client
}  // namespace lossd
