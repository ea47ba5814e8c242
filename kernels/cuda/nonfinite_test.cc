// SPDX-License-Identifier: Apache-2.0
// GPU test of LaunchNonFiniteCheck: random finite values (the largest finite ones included)
// leave the flags alone in every float dtype, at 16-byte aligned and merely 4-byte aligned
// addresses and odd lengths; one NaN, +Inf or -Inf at the first, a middle or the last element
// sets exactly the bit asked for, beside bits already set.
#include "kernels/cuda/nonfinite.h"

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "core/dtype.h"

namespace lossd {
namespace cuda {
namespace {

#define ASSERT_CUDA(expr) \
  ASSERT_EQ((expr), cudaSuccess) << #expr << ": " << cudaGetErrorString(cudaGetLastError())

struct Case {
  DType dtype;
  int64_t n;
  int64_t offset_bytes;  // from a cudaMalloc'd (256-byte aligned) base: 0 or 4
};

class NonFiniteTest : public ::testing::TestWithParam<Case> {};

TEST_P(NonFiniteTest, FindsEveryKindAtEveryPosition) {
  const Case c = GetParam();
  const size_t size = DTypeSize(c.dtype);
  const size_t bytes = c.n * size;
  std::mt19937 gen(static_cast<uint32_t>(c.n));
  std::uniform_real_distribution<float> u(-100.0f, 100.0f);
  std::vector<uint8_t> host(bytes);
  for (int64_t i = 0; i < c.n; ++i) StoreFromFloat(host.data(), c.dtype, i, u(gen));
  const float big = c.dtype == DType::kF16 ? 65504.0f
                    : c.dtype == DType::kBF16 ? Bf16ToFloat(0x7F7F)
                                              : std::numeric_limits<float>::max();
  StoreFromFloat(host.data(), c.dtype, c.n / 3, -big);
  ASSERT_TRUE(std::isfinite(LoadAsFloat(host.data(), c.dtype, c.n / 3)));

  uint8_t* base = nullptr;
  uint32_t* flags = nullptr;
  ASSERT_CUDA(cudaMalloc(reinterpret_cast<void**>(&base), bytes + 16));
  ASSERT_CUDA(cudaMalloc(reinterpret_cast<void**>(&flags), 4));
  uint8_t* data = base + c.offset_bytes;
  auto run = [&](const std::vector<uint8_t>& h, uint32_t before) {
    EXPECT_EQ(cudaMemcpy(data, h.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(flags, &before, 4, cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(LaunchNonFiniteCheck(data, static_cast<int32_t>(c.dtype), c.n, 1u << 3, flags,
                                   nullptr),
              cudaSuccess);
    uint32_t after = 0xDEADBEEF;
    EXPECT_EQ(cudaMemcpy(&after, flags, 4, cudaMemcpyDeviceToHost), cudaSuccess);
    return after;
  };
  EXPECT_EQ(run(host, 0u), 0u);
  EXPECT_EQ(run(host, 1u << 1), 1u << 1);
  const float bad[] = {std::numeric_limits<float>::quiet_NaN(),
                       std::numeric_limits<float>::infinity(),
                       -std::numeric_limits<float>::infinity()};
  for (float b : bad) {
    for (int64_t at : {int64_t{0}, c.n / 2, c.n - 1}) {
      std::vector<uint8_t> copy = host;
      StoreFromFloat(copy.data(), c.dtype, at, b);
      EXPECT_EQ(run(copy, 0u), 1u << 3) << b << " at " << at;
      EXPECT_EQ(run(copy, 1u << 1), (1u << 1) | (1u << 3)) << b << " at " << at;
    }
  }
  ASSERT_CUDA(cudaFree(base));
  ASSERT_CUDA(cudaFree(flags));
}

std::vector<Case> Cases() {
  std::vector<Case> cases;
  for (DType t : {DType::kBF16, DType::kF16, DType::kF32}) {
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1001}, (int64_t{1} << 20) + 3}) {
      for (int64_t off : {0, 4}) cases.push_back({t, n, off});
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(
    DTypesLengthsAlignments, NonFiniteTest, ::testing::ValuesIn(Cases()),
    [](const ::testing::TestParamInfo<Case>& info) {
      return std::string(DTypeName(info.param.dtype)) + "_n" + std::to_string(info.param.n) +
             "_off" + std::to_string(info.param.offset_bytes);
    });

TEST(NonFiniteLaunchTest, RefusesWhatItCannotRead) {
  uint32_t* flags = nullptr;
  ASSERT_CUDA(cudaMalloc(reinterpret_cast<void**>(&flags), 16));
  EXPECT_EQ(LaunchNonFiniteCheck(flags, 7, 1, 1, flags, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(LaunchNonFiniteCheck(reinterpret_cast<uint8_t*>(flags) + 2, 0, 1, 1, flags,
                                 nullptr),
            cudaErrorMisalignedAddress);
  EXPECT_EQ(LaunchNonFiniteCheck(flags, 2, 0, 1, flags, nullptr), cudaSuccess);
  ASSERT_CUDA(cudaFree(flags));
}

}  // namespace
}  // namespace cuda
}  // namespace lossd
