// SPDX-License-Identifier: Apache-2.0
#include "client/head_types.h"

#include <iterator>

namespace lossd {
namespace client {
namespace {

// Indexed from kMasterW: the head's tensor ids are consecutive (lossd.proto's 32 to 41).
constexpr const char* kHeadTensorNames[] = {
    "master_w",         "master_bias",        "exp_avg_w", "exp_avg_bias", "exp_avg_sq_w",
    "exp_avg_sq_bias",  "max_exp_avg_sq_w",   "max_exp_avg_sq_bias",      "copy_w",
    "copy_bias"};
static_assert(std::size(kHeadTensorNames) == static_cast<size_t>(HeadTensor::kCopyBias) -
                                                 static_cast<size_t>(HeadTensor::kMasterW) + 1);

}  // namespace

const char* OptimizerName(Optimizer kind) {
  return kind == Optimizer::kSgd ? "sgd" : "adamw";
}

const char* HeadTensorName(HeadTensor t) {
  const int i = static_cast<int>(t) - static_cast<int>(HeadTensor::kMasterW);
  return i >= 0 && i < static_cast<int>(std::size(kHeadTensorNames)) ? kHeadTensorNames[i]
                                                                     : "unknown";
}

std::optional<HeadTensor> HeadTensorFromName(absl::string_view name) {
  for (size_t i = 0; i < std::size(kHeadTensorNames); ++i) {
    if (name == kHeadTensorNames[i]) {
      return static_cast<HeadTensor>(static_cast<int>(HeadTensor::kMasterW) + i);
    }
  }
  return std::nullopt;
}

bool IsBiasTensor(HeadTensor t) {
  // Odd ids are the bias's (33, 35, ..., 41).
  return (static_cast<int>(t) & 1) != 0;
}

std::vector<HeadTensor> StateTensors(const OptimizerOptions& o, bool bias) {
  std::vector<HeadTensor> w;
  if (o.kind == Optimizer::kAdamW) {
    w = {HeadTensor::kExpAvgW, HeadTensor::kExpAvgSqW};
    if (o.amsgrad) w.push_back(HeadTensor::kMaxExpAvgSqW);
  } else if (o.momentum != 0) {
    w = {HeadTensor::kExpAvgW};
  }
  std::vector<HeadTensor> out;
  for (HeadTensor t : w) {
    out.push_back(t);
    if (bias) out.push_back(static_cast<HeadTensor>(static_cast<int>(t) + 1));
  }
  return out;
}

}  // namespace client
}  // namespace lossd
