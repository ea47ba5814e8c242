// SPDX-License-Identifier: Apache-2.0
#include "client/client_types.h"

#include <iterator>

namespace lossd {
namespace client {

const char* OutputTensorName(OutputTensor t) {
  // Indexed from kLoss: the output ids are consecutive (lossd.proto's TensorId 16 to 24).
  static constexpr const char* kNames[] = {"loss", "lse", "z_loss", "predictions", "dx",
                                           "dw",   "db",  "logp",   "entropy"};
  static_assert(std::size(kNames) == static_cast<size_t>(OutputTensor::kEntropy) -
                                         static_cast<size_t>(OutputTensor::kLoss) + 1);
  const int i = static_cast<int>(t) - static_cast<int>(OutputTensor::kLoss);
  return i >= 0 && i < static_cast<int>(std::size(kNames)) ? kNames[i] : "unknown";
}

const HostTensor* ComputeResult::Find(OutputTensor t) const {
  auto it = outputs.find(t);
  return it == outputs.end() ? nullptr : &it->second;
}

}  // namespace client
}  // namespace lossd
