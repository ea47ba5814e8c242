// SPDX-License-Identifier: Apache-2.0
// StreamedRows: WaitX returns once the rows are in, gives the receiver's failure, and gives up
// at the stall limit and at the deadline; DxReady forwards increasing row counts only.
#include "engine/streamed_rows.h"

#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace lossd {
namespace {

TEST(StreamedRowsTest, WaitReturnsOnceRowsArrive) {
  StreamedRows rows(100, absl::Seconds(30), absl::InfiniteFuture(), nullptr);
  std::thread sender([&] {
    for (int64_t r = 10; r <= 100; r += 10) {
      absl::SleepFor(absl::Milliseconds(1));
      rows.Arrived(r);
    }
  });
  EXPECT_TRUE(rows.WaitX(35).ok());
  EXPECT_GE(rows.arrived(), 35);
  EXPECT_TRUE(rows.WaitX(100).ok());
  EXPECT_TRUE(rows.WaitX(500).ok());  // clamped to BT
  sender.join();
  EXPECT_EQ(rows.arrived(), 100);
}

TEST(StreamedRowsTest, FailureEndsTheWaitButRowsInStillServe) {
  StreamedRows rows(64, absl::Seconds(30), absl::InfiniteFuture(), nullptr);
  rows.Arrived(16);
  std::thread sender([&] {
    absl::SleepFor(absl::Milliseconds(5));
    rows.Fail(absl::InvalidArgumentError("x contains a non-finite value (nan) at [17, 3]"));
  });
  absl::Status s = rows.WaitX(32);
  sender.join();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("non-finite"), absl::string_view::npos) << s;
  EXPECT_TRUE(rows.WaitX(16).ok());
  // The first failure stays; a later one does not replace it.
  rows.Fail(absl::CancelledError("later"));
  EXPECT_EQ(rows.WaitX(32).code(), absl::StatusCode::kInvalidArgument);
}

TEST(StreamedRowsTest, StallLimitAndDeadline) {
  StreamedRows stalled(8, absl::Milliseconds(20), absl::InfiniteFuture(), nullptr);
  stalled.Arrived(2);
  absl::Status s = stalled.WaitX(8);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(s.message().find("x stalled"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("2 of 8 rows"), absl::string_view::npos) << s;

  StreamedRows late(8, absl::Seconds(30), absl::Now() + absl::Milliseconds(20), nullptr);
  s = late.WaitX(1);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(s.message().find("deadline passed"), absl::string_view::npos) << s;
}

TEST(StreamedRowsTest, DxReadyForwardsIncreasingCounts) {
  std::vector<int64_t> seen;
  StreamedRows rows(10, absl::Seconds(30), absl::InfiniteFuture(),
                    [&](int64_t r) { seen.push_back(r); });
  rows.DxReady(4);
  rows.DxReady(4);  // no progress: not forwarded
  rows.DxReady(3);
  rows.DxReady(12);  // clamped to BT
  EXPECT_EQ(seen, (std::vector<int64_t>{4, 10}));
  EXPECT_EQ(rows.dx_ready(), 10);
}

}  // namespace
}  // namespace lossd
