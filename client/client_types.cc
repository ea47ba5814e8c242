#include "client/client_types.h"

namespace lossd {
namespace client {

const char* OutputTensorName(OutputTensor t) {
  switch (t) {
    case OutputTensor::kLoss:
      return "loss";
    case OutputTensor::kLse:
      return "lse";
    case OutputTensor::kZLoss:
      return "z_loss";
    case OutputTensor::kPredictions:
      return "predictions";
    case OutputTensor::kDx:
      return "dx";
    case OutputTensor::kDw:
      return "dw";
    case OutputTensor::kDb:
      return "db";
  }
  return "unknown";
}

const HostTensor* ComputeResult::Find(OutputTensor t) const {
  auto it = outputs.find(t);
  return it == outputs.end() ? nullptr : &it->second;
}

}  // namespace client
}  // namespace lossd
