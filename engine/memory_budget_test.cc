// SPDX-License-Identifier: Apache-2.0
#include "engine/memory_budget.h"

#include <vector>

#include "gtest/gtest.h"

namespace lossd {
namespace {

TEST(MemoryBudgetTest, GrantsAtOnceWhenItFits) {
  MemoryBudget b(100, 4);
  int granted = 0;
  uint64_t t = 0;
  ASSERT_TRUE(b.Reserve(60, "r1", [&](absl::Status s) { granted += s.ok(); }, &t).ok());
  EXPECT_EQ(granted, 1);
  EXPECT_EQ(b.in_use(), 60u);
  b.Release(60);
  EXPECT_EQ(b.in_use(), 0u);
}

TEST(MemoryBudgetTest, RefusesWhatCanNeverFitWithTheLimitInTheMessage) {
  MemoryBudget b(100, 4);
  uint64_t t = 0;
  bool called = false;
  absl::Status s = b.Reserve(101, "Compute of (BT=1)", [&](absl::Status) { called = true; }, &t);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("101 bytes"), std::string::npos) << s;
  EXPECT_NE(s.message().find("100 bytes"), std::string::npos) << s;
  EXPECT_FALSE(called);
}

TEST(MemoryBudgetTest, WaitersAreGrantedInArrivalOrderWithoutOvertaking) {
  MemoryBudget b(100, 4);
  std::vector<int> order;
  uint64_t t = 0;
  ASSERT_TRUE(b.Reserve(90, "a", [&](absl::Status) { order.push_back(1); }, &t).ok());
  ASSERT_TRUE(b.Reserve(50, "b", [&](absl::Status) { order.push_back(2); }, &t).ok());
  // Small enough to fit beside the first, but it must not overtake the waiting one.
  ASSERT_TRUE(b.Reserve(10, "c", [&](absl::Status) { order.push_back(3); }, &t).ok());
  EXPECT_EQ(order, std::vector<int>({1}));
  b.Release(90);
  EXPECT_EQ(order, std::vector<int>({1, 2, 3}));
  EXPECT_EQ(b.in_use(), 60u);
}

TEST(MemoryBudgetTest, FullQueueIsUnavailable) {
  MemoryBudget b(10, 1);
  uint64_t t = 0;
  ASSERT_TRUE(b.Reserve(10, "a", [](absl::Status) {}, &t).ok());
  ASSERT_TRUE(b.Reserve(10, "b", [](absl::Status) {}, &t).ok());
  absl::Status s = b.Reserve(10, "c", [](absl::Status) {}, &t);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(s.message().find("--max_queue=1"), std::string::npos) << s;
}

TEST(MemoryBudgetTest, CancelFailsTheWaiterAndLetsTheNextOneIn) {
  MemoryBudget b(100, 4);
  uint64_t t1 = 0, t2 = 0, t3 = 0;
  absl::Status second = absl::OkStatus();
  bool third = false;
  ASSERT_TRUE(b.Reserve(60, "a", [](absl::Status) {}, &t1).ok());
  ASSERT_TRUE(b.Reserve(60, "b", [&](absl::Status s) { second = s; }, &t2).ok());
  ASSERT_TRUE(b.Reserve(40, "c", [&](absl::Status s) { third = s.ok(); }, &t3).ok());
  EXPECT_FALSE(third);
  b.Cancel(t2);
  EXPECT_EQ(second.code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(third);
  EXPECT_EQ(b.in_use(), 100u);
}

TEST(MemoryBudgetTest, CloseFailsWaitersAndRefusesNewOnes) {
  MemoryBudget b(10, 4);
  uint64_t t = 0;
  absl::Status waiting = absl::OkStatus();
  ASSERT_TRUE(b.Reserve(10, "a", [](absl::Status) {}, &t).ok());
  ASSERT_TRUE(b.Reserve(5, "b", [&](absl::Status s) { waiting = s; }, &t).ok());
  b.Close();
  EXPECT_EQ(waiting.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(b.Reserve(1, "c", [](absl::Status) {}, &t).code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace lossd
