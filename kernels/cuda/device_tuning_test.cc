// SPDX-License-Identifier: Apache-2.0
#include "kernels/cuda/device_tuning.h"

#include "gtest/gtest.h"
#include "kernels/cuda/chunk_plan.h"

namespace lossd {
namespace cuda {
namespace {

TEST(DeviceTuningTest, AnH100TakesTheOtherPathWithLongerChunks) {
  for (const char* name : {"NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL"}) {
    const DeviceTuning t = TuneForDevice(name, 9, 0, RefExpChoice::kPerDevice);
    EXPECT_FALSE(t.ref_exp) << name;
    EXPECT_EQ(t.default_chunk_rows, kH100DefaultChunkRows) << name;
    EXPECT_NE(t.reason.find("H100"), std::string::npos) << t.reason;
  }
}

TEST(DeviceTuningTest, OtherDevicesKeepTheReferenceExpPath) {
  for (const char* name : {"NVIDIA H200", "NVIDIA GH200 480GB", "NVIDIA A100-SXM4-80GB"}) {
    const DeviceTuning t = TuneForDevice(name, name[7] == 'A' ? 8 : 9, 0,
                                         RefExpChoice::kPerDevice);
    EXPECT_TRUE(t.ref_exp) << name;
    EXPECT_EQ(t.default_chunk_rows, kMinDefaultChunkRows) << name;
  }
}

TEST(DeviceTuningTest, AForcedChoiceWinsButKeepsTheDevicesChunk) {
  DeviceTuning on = TuneForDevice("NVIDIA H100 80GB HBM3", 9, 0, RefExpChoice::kOn);
  EXPECT_TRUE(on.ref_exp);
  EXPECT_EQ(on.default_chunk_rows, kH100DefaultChunkRows);
  EXPECT_NE(on.reason.find("forced on"), std::string::npos) << on.reason;
  DeviceTuning off = TuneForDevice("NVIDIA H200", 9, 0, RefExpChoice::kOff);
  EXPECT_FALSE(off.ref_exp);
  EXPECT_EQ(off.default_chunk_rows, kMinDefaultChunkRows);
  EXPECT_NE(off.reason.find("forced off"), std::string::npos) << off.reason;
}

TEST(DeviceTuningTest, TheEnvironmentVariableReadsZeroOneOrUnset) {
  EXPECT_EQ(RefExpChoiceFromEnv(nullptr), RefExpChoice::kPerDevice);
  EXPECT_EQ(RefExpChoiceFromEnv("0"), RefExpChoice::kOff);
  EXPECT_EQ(RefExpChoiceFromEnv("1"), RefExpChoice::kOn);
  EXPECT_EQ(RefExpChoiceFromEnv("auto"), RefExpChoice::kPerDevice);
}

TEST(DeviceTuningTest, TheDefaultBudgetHoldsTheDevicesRows) {
  // (8192, 4096, 128256) bf16: 2048 rows fit the 512 MiB default, 4096 rows grow it to 1 GiB.
  const uint64_t row = 128256ull * 2;
  EXPECT_LT(DefaultChunkBudget(8192, 128256, DType::kBF16), 2049 * row + (16ull << 20));
  const uint64_t h100 =
      DefaultChunkBudget(8192, 128256, DType::kBF16, kGemmWorkspaceBytes, kH100DefaultChunkRows);
  EXPECT_GE(h100, 4096 * row);
  EXPECT_EQ(PlanChunks(8192, 128256, DType::kBF16, h100, 0).chunk_rows, 4096);
  EXPECT_EQ(PlanChunks(8192, 128256, DType::kBF16,
                       DefaultChunkBudget(8192, 128256, DType::kBF16), 0)
                .chunk_rows,
            2048);
}

}  // namespace
}  // namespace cuda
}  // namespace lossd
