// SPDX-License-Identifier: Apache-2.0
// Random test tensors for the C++ client's tests: floats drawn uniformly from [-scale, scale)
// by a seeded generator and stored in the tensor's dtype, so a test's inputs are random,
// distinct by seed, and the same on every run. Test-only; never linked into the client.
#ifndef LOSSD_TESTING_CLIENT_TEST_TENSORS_H_
#define LOSSD_TESTING_CLIENT_TEST_TENSORS_H_

#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "client/host_tensor.h"
#include "core/dtype.h"

namespace lossd {
namespace client {

inline HostTensor UniformTensor(DType dtype, std::vector<int64_t> shape, uint32_t seed,
                                float scale) {
  HostTensor t = HostTensor::Owned(dtype, std::move(shape));
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  for (int64_t i = 0; i < t.num_elements(); ++i) {
    StoreFromFloat(t.mutable_data(), dtype, i, u(gen));
  }
  return t;
}

}  // namespace client
}  // namespace lossd

#endif  // LOSSD_TESTING_CLIENT_TEST_TENSORS_H_
