// SPDX-License-Identifier: Apache-2.0
#include "engine/admission.h"

#include <memory>
#include <optional>

#include "gtest/gtest.h"

namespace lossd {
namespace {

TEST(AdmissionTest, GrantedBytesGoBackWhenDestroyed) {
  MemoryBudget budget(100, 4);
  std::optional<absl::Status> answer;
  {
    Admission a(&budget);
    ASSERT_TRUE(a.Request(60, "a call", [&](absl::Status s) { answer = s; }).ok());
    ASSERT_TRUE(answer.has_value());  // free memory: granted before Request returns
    EXPECT_TRUE(answer->ok());
    EXPECT_EQ(a.granted_bytes(), 60u);
    EXPECT_EQ(budget.in_use(), 60u);
  }
  EXPECT_EQ(budget.in_use(), 0u);
}

TEST(AdmissionTest, ReleaseGrantsTheNextWaiterOnce) {
  MemoryBudget budget(100, 4);
  auto first = std::make_unique<Admission>(&budget);
  Admission second(&budget);
  std::optional<absl::Status> second_answer;
  ASSERT_TRUE(first->Request(80, "first", [](absl::Status) {}).ok());
  ASSERT_TRUE(second.Request(50, "second", [&](absl::Status s) { second_answer = s; }).ok());
  EXPECT_FALSE(second_answer.has_value());  // waits for the first's bytes
  first->Release();
  ASSERT_TRUE(second_answer.has_value());
  EXPECT_TRUE(second_answer->ok());
  first->Release();  // idempotent: nothing is given back twice
  first.reset();
  EXPECT_EQ(budget.in_use(), 50u);
}

TEST(AdmissionTest, WithdrawWhileWaitingAnswersCancelledAndHoldsNothing) {
  MemoryBudget budget(100, 4);
  Admission holder(&budget);
  ASSERT_TRUE(holder.Request(100, "holder", [](absl::Status) {}).ok());
  Admission waiting(&budget);
  std::optional<absl::Status> answer;
  ASSERT_TRUE(waiting.Request(10, "waiting", [&](absl::Status s) { answer = s; }).ok());
  waiting.Withdraw();
  ASSERT_TRUE(answer.has_value());
  EXPECT_EQ(answer->code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(waiting.granted_bytes(), 0u);
  EXPECT_EQ(budget.waiting(), 0u);
  holder.Release();
  EXPECT_EQ(budget.in_use(), 0u);  // the withdrawn one was never granted
}

// A Withdraw that lands before Request has its ticket (a cancel racing the header) is not
// lost: the request is cancelled as soon as it is queued.
TEST(AdmissionTest, WithdrawBeforeRequestCancelsTheQueuedRequest) {
  MemoryBudget budget(100, 4);
  Admission holder(&budget);
  ASSERT_TRUE(holder.Request(100, "holder", [](absl::Status) {}).ok());
  Admission late(&budget);
  late.Withdraw();
  EXPECT_TRUE(late.withdrawn());
  std::optional<absl::Status> answer;
  ASSERT_TRUE(late.Request(10, "late", [&](absl::Status s) { answer = s; }).ok());
  ASSERT_TRUE(answer.has_value());
  EXPECT_EQ(answer->code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(budget.waiting(), 0u);
}

TEST(AdmissionTest, WithdrawAfterGrantKeepsTheBytes) {
  MemoryBudget budget(100, 4);
  Admission a(&budget);
  int answers = 0;
  ASSERT_TRUE(a.Request(30, "a call", [&](absl::Status) { ++answers; }).ok());
  a.Withdraw();
  EXPECT_EQ(answers, 1);
  EXPECT_EQ(a.granted_bytes(), 30u);
  EXPECT_EQ(budget.in_use(), 30u);
}

TEST(AdmissionTest, RefusedAtOnceNeverAnswers) {
  MemoryBudget budget(100, 4);
  Admission a(&budget);
  bool answered = false;
  absl::Status s = a.Request(101, "too big", [&](absl::Status) { answered = true; });
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(answered);
  EXPECT_EQ(a.granted_bytes(), 0u);
}

}  // namespace
}  // namespace lossd
