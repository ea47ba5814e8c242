// SPDX-License-Identifier: Apache-2.0
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

StoreBudgets Stores(uint64_t weights, uint64_t accumulators, uint64_t heads) {
  StoreBudgets b;
  b.weight_cache_bytes = weights;
  b.accumulator_bytes = accumulators;
  b.head_bytes = heads;
  return b;
}

TEST(StoreBudgetsTest, FitsInTheDevice) {
  EXPECT_TRUE(CheckStoreBudgets(Stores(4 * kGiB, 8 * kGiB, 16 * kGiB), Cuda(141 * kGiB, 0)).ok());
  // Exactly the whole device is allowed (a budget, not an allocation).
  EXPECT_TRUE(CheckStoreBudgets(Stores(70 * kGiB, 50 * kGiB, 21 * kGiB), Cuda(141 * kGiB, 0)).ok());
}

TEST(StoreBudgetsTest, MoreThanTheDeviceIsRefusedNamingTheFlags) {
  const absl::Status s = CheckStoreBudgets(Stores(16 * kGiB, 8 * kGiB, 0), Cuda(12 * kGiB, 0));
  ExpectRefused(s, "--weight_cache_bytes=17179869184 plus --accumulator_bytes=8589934592 plus "
                   "--head_bytes=0");
  ExpectRefused(s, "25769803776 bytes");
  ExpectRefused(s, "device memory of 12884901888 bytes (NVIDIA H200)");
  // The heads' budget alone can be what does not fit.
  ExpectRefused(CheckStoreBudgets(Stores(4 * kGiB, 4 * kGiB, 5 * kGiB), Cuda(12 * kGiB, 0)),
                "--head_bytes=5368709120 plus --ticket_bytes=0 (13958643712 bytes) exceed");
  // So can the tickets'.
  StoreBudgets t = Stores(4 * kGiB, 4 * kGiB, 3 * kGiB);
  t.ticket_bytes = 2 * kGiB;
  ExpectRefused(CheckStoreBudgets(t, Cuda(12 * kGiB, 0)),
                "--head_bytes=3221225472 plus --ticket_bytes=2147483648 (13958643712 bytes)");
  t.ticket_bytes = kGiB;
  EXPECT_TRUE(CheckStoreBudgets(t, Cuda(12 * kGiB, 0)).ok());
}

TEST(StoreBudgetsTest, TheBackendsOwnBudgetIsTheLimitWhereSet) {
  EXPECT_TRUE(
      CheckStoreBudgets(Stores(32 * kGiB, 32 * kGiB, 16 * kGiB), Cuda(141 * kGiB, 120 * kGiB))
          .ok());
  const absl::Status s =
      CheckStoreBudgets(Stores(64 * kGiB, 48 * kGiB, 16 * kGiB), Cuda(141 * kGiB, 120 * kGiB));
  ExpectRefused(s, "--device_memory_budget_bytes=128849018880");
  // A budget larger than the device does not raise the limit past the device.
  ExpectRefused(
      CheckStoreBudgets(Stores(100 * kGiB, 100 * kGiB, 0), Cuda(141 * kGiB, 500 * kGiB)),
      "device memory of 151397597184 bytes");
}

TEST(StoreBudgetsTest, TheCpuBackendIsCheckedAgainstHostMemory) {
  BackendInfo cpu;
  cpu.name = "cpu";
  cpu.device = "2 threads";
  cpu.memory_total_bytes = 16 * kGiB;
  EXPECT_TRUE(CheckStoreBudgets(Stores(4 * kGiB, 8 * kGiB, 4 * kGiB), cpu).ok());
  ExpectRefused(CheckStoreBudgets(Stores(4 * kGiB, 8 * kGiB, 5 * kGiB), cpu),
                "host memory of 17179869184 bytes");
}

TEST(StoreBudgetsTest, SumsThatOverflowAreRefused) {
  const absl::Status s = CheckStoreBudgets(Stores(UINT64_MAX, 2, 3), Cuda(141 * kGiB, 0));
  ExpectRefused(s, "--weight_cache_bytes=18446744073709551615 plus --accumulator_bytes=2");
  ExpectRefused(s, "(more than 2^64 bytes)");
}

TEST(StoreBudgetsTest, UnknownMemoryIsNotChecked) {
  EXPECT_TRUE(CheckStoreBudgets(Stores(UINT64_MAX, UINT64_MAX, UINT64_MAX), Cuda(0, 0)).ok());
}

TEST(StoreBudgetsTest, DefaultsThatDoNotFitShrinkToHalfInTheirRatio) {
  const StoreBudgetsGiven none;
  // An 8 GiB laptop GPU: 4 + 8 + 16 GiB become 4/7 + 8/7 + 16/7 GiB, and then pass the check.
  StoreBudgets b = Stores(4 * kGiB, 8 * kGiB, 16 * kGiB);
  EXPECT_TRUE(FitDefaultStoreBudgets(&b, none, Cuda(8 * kGiB, 0)));
  const uint64_t sum = b.weight_cache_bytes + b.accumulator_bytes + b.head_bytes;
  EXPECT_LE(sum, 4 * kGiB);
  EXPECT_GE(sum, 4 * kGiB - 3);  // rounding down each loses under a byte
  EXPECT_LE(b.weight_cache_bytes * 2, b.accumulator_bytes);
  EXPECT_GE(b.weight_cache_bytes * 2 + 2, b.accumulator_bytes);
  EXPECT_LE(b.accumulator_bytes * 2, b.head_bytes);
  EXPECT_GE(b.accumulator_bytes * 2 + 2, b.head_bytes);
  EXPECT_TRUE(CheckStoreBudgets(b, Cuda(8 * kGiB, 0)).ok());
  // Where they fit, nothing changes.
  b = Stores(4 * kGiB, 8 * kGiB, 16 * kGiB);
  EXPECT_FALSE(FitDefaultStoreBudgets(&b, none, Cuda(141 * kGiB, 0)));
  EXPECT_EQ(b.weight_cache_bytes, 4 * kGiB);
  EXPECT_EQ(b.accumulator_bytes, 8 * kGiB);
  EXPECT_EQ(b.head_bytes, 16 * kGiB);
  // The backend's own budget is the limit where it is set.
  EXPECT_TRUE(FitDefaultStoreBudgets(&b, none, Cuda(141 * kGiB, 6 * kGiB)));
  EXPECT_LE(b.weight_cache_bytes + b.accumulator_bytes + b.head_bytes, 3 * kGiB);
  EXPECT_TRUE(CheckStoreBudgets(b, Cuda(141 * kGiB, 6 * kGiB)).ok());
  // A backend that reports no memory leaves them alone.
  b = Stores(4 * kGiB, 8 * kGiB, 16 * kGiB);
  EXPECT_FALSE(FitDefaultStoreBudgets(&b, none, Cuda(0, 0)));
  EXPECT_EQ(b.weight_cache_bytes + b.accumulator_bytes + b.head_bytes, 28 * kGiB);
}

TEST(StoreBudgetsTest, OnlyTheDefaultedOnesShrinkIntoWhatTheGivenOnesLeave) {
  // A 6 GiB CPU container that sets the weight cache and accumulators to 1 GiB each: the
  // default 16 GiB of heads takes the rest of half the memory (1 GiB).
  BackendInfo cpu;
  cpu.name = "cpu";
  cpu.device = "2 threads";
  cpu.memory_total_bytes = 6 * kGiB;
  StoreBudgetsGiven given;
  given.weight_cache = given.accumulator = true;
  StoreBudgets b = Stores(kGiB, kGiB, 16 * kGiB);
  EXPECT_TRUE(FitDefaultStoreBudgets(&b, given, cpu));
  EXPECT_EQ(b.weight_cache_bytes, kGiB);
  EXPECT_EQ(b.accumulator_bytes, kGiB);
  EXPECT_EQ(b.head_bytes, kGiB);
  EXPECT_TRUE(CheckStoreBudgets(b, cpu).ok());
  // Given ones that take half or more leave the defaulted ones nothing; given ones that do
  // not fit at all are still refused by the check.
  b = Stores(3 * kGiB, kGiB, 16 * kGiB);
  EXPECT_TRUE(FitDefaultStoreBudgets(&b, given, cpu));
  EXPECT_EQ(b.head_bytes, 0u);
  EXPECT_EQ(b.weight_cache_bytes, 3 * kGiB);
  b = Stores(7 * kGiB, kGiB, 16 * kGiB);
  FitDefaultStoreBudgets(&b, given, cpu);
  ExpectRefused(CheckStoreBudgets(b, cpu), "--weight_cache_bytes=7516192768");
  // All given: nothing to fit.
  given.head = true;
  b = Stores(kGiB, kGiB, 16 * kGiB);
  EXPECT_FALSE(FitDefaultStoreBudgets(&b, given, cpu));
  EXPECT_EQ(b.head_bytes, 16 * kGiB);
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
