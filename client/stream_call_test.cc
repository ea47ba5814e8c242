// SPDX-License-Identifier: Apache-2.0
// StripeGroup's verdict over its stripes (every stripe runs, and the error that comes back is
// the first real one, not a sibling's ABORTED, else the first error), and FromGrpcStatus.
#include "client/stream_call.h"

#include <atomic>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace lossd {
namespace client {
namespace {

TEST(StripeGroupTest, AllStripesRunAndAllOkIsOk) {
  std::atomic<int> ran{0};
  StripeGroup group(4, absl::Seconds(1));
  absl::Status s = group.Run([&](int) {
    ++ran;
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(ran.load(), 4);
}

TEST(StripeGroupTest, TheCauseWinsOverTheSiblingsAborted) {
  // Stripe 0 hears ABORTED first (the server aborted the upload); stripe 2 then reports why.
  absl::Notification aborted_reported;
  StripeGroup group(3, absl::Seconds(5));
  absl::Status s = group.Run([&](int i) -> absl::Status {
    if (i == 0) {
      aborted_reported.Notify();
      return absl::AbortedError("upload aborted");
    }
    if (i == 2) {
      aborted_reported.WaitForNotification();
      absl::SleepFor(absl::Milliseconds(30));
      return absl::InvalidArgumentError("part splits an element");
    }
    return absl::OkStatus();
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(s.message(), "part splits an element");
}

TEST(StripeGroupTest, OnlyAbortedComesBackAsAborted) {
  StripeGroup group(2, absl::ZeroDuration());
  absl::Status s = group.Run([](int i) -> absl::Status {
    return i == 1 ? absl::AbortedError("changed in between") : absl::OkStatus();
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_EQ(s.message(), "changed in between");
}

TEST(WithRequestIdTest, NamesTheIdAfterTheMessageKeepingCodeAndPayloads) {
  EXPECT_TRUE(WithRequestId(absl::OkStatus(), "abc").ok());
  absl::Status s = absl::NotFoundError("no accumulator 'a'");
  s.SetPayload("lossd.test", absl::Cord("p"));
  absl::Status named = WithRequestId(s, "0123456789abcdef");
  EXPECT_EQ(named.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(named.message(), "no accumulator 'a' (request_id 0123456789abcdef)");
  EXPECT_EQ(named.GetPayload("lossd.test"), absl::Cord("p"));
}

TEST(NewRequestIdTest, SixteenHexDigitsNewEachCall) {
  const std::string a = NewRequestId();
  EXPECT_EQ(a.size(), 16u);
  EXPECT_EQ(a.find_first_not_of("0123456789abcdef"), std::string::npos) << a;
  EXPECT_NE(a, NewRequestId());
}

TEST(FromGrpcStatusTest, KeepsCodeAndMessage) {
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK).ok());
  absl::Status s = FromGrpcStatus(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "budget"));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(), "budget");
}

}  // namespace
}  // namespace client
}  // namespace lossd
