#include "service/store_budgets.h"

#include <cstdint>
#include <string>

#include "gtest/gtest.h"

namespace lossd {
namespace {

constexpr uint64_t kGiB = 1ull << 30;

BackendInfo Cuda(uint64_t total, uint64_t budget) {
  BackendInfo b;
  b.name = "cuda";
  b.device = "NVIDIA H200";
  b.memory_total_bytes = total;
  b.memory_budget_bytes = budget;
  return b;
}

void ExpectRefused(const absl::Status& s, const std::string& want) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find(want), std::string::npos) << s;
}

TEST(StoreBudgetsTest, FitsInTheDevice) {
  EXPECT_TRUE(CheckStoreBudgets(4 * kGiB, 8 * kGiB, Cuda(141 * kGiB, 0)).ok());
  // Exactly the whole device is allowed (a budget, not an allocation).
  EXPECT_TRUE(CheckStoreBudgets(70 * kGiB, 71 * kGiB, Cuda(141 * kGiB, 0)).ok());
}

TEST(StoreBudgetsTest, MoreThanTheDeviceIsRefusedNamingBothFlags) {
  const absl::Status s = CheckStoreBudgets(16 * kGiB, 8 * kGiB, Cuda(12 * kGiB, 0));
  ExpectRefused(s, "--weight_cache_bytes=17179869184 plus --accumulator_bytes=8589934592");
  ExpectRefused(s, "25769803776 bytes");
  ExpectRefused(s, "device memory of 12884901888 bytes (NVIDIA H200)");
}

TEST(StoreBudgetsTest, TheBackendsOwnBudgetIsTheLimitWhereSet) {
  EXPECT_TRUE(CheckStoreBudgets(32 * kGiB, 32 * kGiB, Cuda(141 * kGiB, 120 * kGiB)).ok());
  const absl::Status s = CheckStoreBudgets(64 * kGiB, 64 * kGiB, Cuda(141 * kGiB, 120 * kGiB));
  ExpectRefused(s, "--device_memory_budget_bytes=128849018880");
  // A budget larger than the device does not raise the limit past the device.
  ExpectRefused(CheckStoreBudgets(100 * kGiB, 100 * kGiB, Cuda(141 * kGiB, 500 * kGiB)),
                "device memory of 151397597184 bytes");
}

TEST(StoreBudgetsTest, TheCpuBackendIsCheckedAgainstHostMemory) {
  BackendInfo cpu;
  cpu.name = "cpu";
  cpu.device = "2 threads";
  cpu.memory_total_bytes = 16 * kGiB;
  EXPECT_TRUE(CheckStoreBudgets(4 * kGiB, 8 * kGiB, cpu).ok());
  ExpectRefused(CheckStoreBudgets(8 * kGiB, 9 * kGiB, cpu), "host memory of 17179869184 bytes");
}

TEST(StoreBudgetsTest, SumsThatOverflowAreRefused) {
  ExpectRefused(CheckStoreBudgets(UINT64_MAX, 2, Cuda(141 * kGiB, 0)),
                "--weight_cache_bytes=18446744073709551615 plus --accumulator_bytes=2");
}

TEST(StoreBudgetsTest, UnknownMemoryIsNotChecked) {
  EXPECT_TRUE(CheckStoreBudgets(UINT64_MAX, UINT64_MAX, Cuda(0, 0)).ok());
}

TEST(StoreBudgetsTest, DefaultsThatDoNotFitShrinkToHalfInTheirRatio) {
  // An 8 GiB laptop GPU: 4 + 8 GiB become 4/3 + 8/3 GiB, and then pass the check.
  uint64_t wc = 4 * kGiB, acc = 8 * kGiB;
  EXPECT_TRUE(FitDefaultStoreBudgets(&wc, &acc, Cuda(8 * kGiB, 0)));
  EXPECT_LE(wc + acc, 4 * kGiB);
  EXPECT_GE(wc + acc, 4 * kGiB - 2);  // rounding down each loses under a byte
  EXPECT_EQ(acc / kGiB, 2u);
  EXPECT_LE(wc * 2, acc);
  EXPECT_GE(wc * 2 + 2, acc);
  EXPECT_TRUE(CheckStoreBudgets(wc, acc, Cuda(8 * kGiB, 0)).ok());
  // Where they fit, nothing changes.
  wc = 4 * kGiB, acc = 8 * kGiB;
  EXPECT_FALSE(FitDefaultStoreBudgets(&wc, &acc, Cuda(141 * kGiB, 0)));
  EXPECT_EQ(wc, 4 * kGiB);
  EXPECT_EQ(acc, 8 * kGiB);
  // The backend's own budget is the limit where it is set.
  EXPECT_TRUE(FitDefaultStoreBudgets(&wc, &acc, Cuda(141 * kGiB, 6 * kGiB)));
  EXPECT_LE(wc + acc, 3 * kGiB);
  EXPECT_TRUE(CheckStoreBudgets(wc, acc, Cuda(141 * kGiB, 6 * kGiB)).ok());
  // A backend that reports no memory leaves them alone.
  wc = 4 * kGiB, acc = 8 * kGiB;
  EXPECT_FALSE(FitDefaultStoreBudgets(&wc, &acc, Cuda(0, 0)));
  EXPECT_EQ(wc + acc, 12 * kGiB);
}

TEST(StoreBudgetsTest, HostDefaultsFollowTheHostLimit) {
  // A 1 GiB container: defaults 8 GiB and 2 GiB become a quarter and an eighth of it.
  uint64_t mem = 8 * kGiB, pool = 2 * kGiB;
  EXPECT_TRUE(FitDefaultHostBudgets(kGiB, false, false, &mem, &pool));
  EXPECT_EQ(mem, kGiB / 4);
  EXPECT_EQ(pool, kGiB / 8);
  // Values the user gave stay what they are, even where they exceed the limit.
  mem = 8 * kGiB, pool = 2 * kGiB;
  EXPECT_TRUE(FitDefaultHostBudgets(kGiB, true, false, &mem, &pool));
  EXPECT_EQ(mem, 8 * kGiB);
  EXPECT_EQ(pool, kGiB / 8);
  mem = 8 * kGiB, pool = 2 * kGiB;
  EXPECT_FALSE(FitDefaultHostBudgets(kGiB, true, true, &mem, &pool));
  EXPECT_EQ(mem, 8 * kGiB);
  EXPECT_EQ(pool, 2 * kGiB);
  // A large host keeps the defaults; an unknown one (0) changes nothing.
  EXPECT_FALSE(FitDefaultHostBudgets(128 * kGiB, false, false, &mem, &pool));
  EXPECT_EQ(mem, 8 * kGiB);
  EXPECT_EQ(pool, 2 * kGiB);
  EXPECT_FALSE(FitDefaultHostBudgets(0, false, false, &mem, &pool));
  EXPECT_EQ(mem, 8 * kGiB);
}

}  // namespace
}  // namespace lossd
