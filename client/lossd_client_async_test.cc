// SPDX-License-Identifier: Apache-2.0
// Tests LossClient::ComputeAsync against the in-process fake lossd service over real loopback
// gRPC: the result and the errors are Compute's, two calls run at once (one held by the fake
// while the other completes), max_in_flight 1 keeps them in order, the callback runs off the
// caller's thread, a destroyed client answers the calls not started CANCELLED, and the option
// is checked.
#include <chrono>
#include <future>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "client/lossd_client.h"
#include "testing/client/fake_loss_service.h"
#include "testing/client/lossd_client_fixture.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace lossd {
namespace client {
namespace {

using ::testing::HasSubstr;
using Result = absl::StatusOr<ComputeResult>;

constexpr auto kLong = std::chrono::seconds(30);

// Holds the fake's next Compute once it has its header: `held` is notified, and the call
// waits for `release`.
struct Hold {
  absl::Notification held, release;
  explicit Hold(FakeLossService& fake) {
    absl::MutexLock lock(&fake.mu);
    fake.held = &held;
    fake.release = &release;
  }
};

TEST_F(LossClientTest, ComputeAsyncGivesComputesResult) {
  auto client = Client(Options());
  ComputeRequest r = SmallRequest();
  std::future<Result> fut = client->ComputeAsync(r);
  ASSERT_EQ(fut.wait_for(kLong), std::future_status::ready);
  Result got = fut.get();
  ASSERT_TRUE(got.ok()) << got.status();
  Result want = client->Compute(r);
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_EQ(got->loss, want->loss);
  EXPECT_EQ(got->outputs.size(), want->outputs.size());
  EXPECT_TRUE(SameBytes(*got->Find(OutputTensor::kDx), r.x));  // the fake echoes X as dX
  EXPECT_TRUE(SameBytes(*got->Find(OutputTensor::kDx), *want->Find(OutputTensor::kDx)));
}

TEST_F(LossClientTest, TwoComputeAsyncCallsRunAtOnce) {
  auto client = Client(Options());  // max_in_flight 2 by default
  Hold hold(fake_);
  std::future<Result> first = client->ComputeAsync(SmallRequest(6));
  ASSERT_TRUE(hold.held.WaitForNotificationWithTimeout(absl::Seconds(30)));
  // The first call is held in the server; the second completes beside it.
  std::future<Result> second = client->ComputeAsync(SmallRequest(4));
  ASSERT_EQ(second.wait_for(kLong), std::future_status::ready);
  Result r2 = second.get();
  ASSERT_TRUE(r2.ok()) << r2.status();
  EXPECT_EQ(r2->Find(OutputTensor::kDx)->shape(), (std::vector<int64_t>{4, 5}));
  EXPECT_NE(first.wait_for(std::chrono::seconds(0)), std::future_status::ready);
  hold.release.Notify();
  Result r1 = first.get();
  ASSERT_TRUE(r1.ok()) << r1.status();
  EXPECT_EQ(r1->Find(OutputTensor::kDx)->shape(), (std::vector<int64_t>{6, 5}));
}

TEST_F(LossClientTest, OneInFlightRunsTheCallsInOrder) {
  ClientOptions o = Options();
  o.max_in_flight = 1;
  auto client = Client(o);
  Hold hold(fake_);
  std::future<Result> first = client->ComputeAsync(SmallRequest(6));
  ASSERT_TRUE(hold.held.WaitForNotificationWithTimeout(absl::Seconds(30)));
  std::future<Result> second = client->ComputeAsync(SmallRequest(4));
  // The second waits behind the held first (it cannot have run: one call at a time).
  EXPECT_EQ(second.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout);
  hold.release.Notify();
  EXPECT_TRUE(first.get().ok());
  EXPECT_TRUE(second.get().ok());
}

TEST_F(LossClientTest, ComputeAsyncErrorsAreComputes) {
  fake_.error_code = grpc::StatusCode::FAILED_PRECONDITION;
  fake_.error_message = "head h is at version 3, the call names 2";
  fake_.mode = Mode::kError;  // last: publishes the two above to the server's threads
  auto client = Client(Options());
  Result got = client->ComputeAsync(SmallRequest()).get();
  ASSERT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition) << got.status();
  absl::MutexLock lock(&fake_.mu);
  EXPECT_EQ(got.status().message(),
            absl::StrCat(fake_.error_message, " (request_id ", fake_.last_request_id, ")"));
}

TEST_F(LossClientTest, ARequestRefusedLocallyIsRefusedAlike) {
  auto client = Client(Options());
  ComputeRequest r = SmallRequest();
  r.w = RandomTensor(DType::kBF16, {7}, 2);  // one-dimensional W
  Result sync = client->Compute(r);
  Result async = client->ComputeAsync(r).get();
  ASSERT_EQ(sync.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(async.status(), sync.status());
}

TEST_F(LossClientTest, TheCallbackRunsOffTheCallersThread) {
  auto client = Client(Options());
  absl::Notification done;
  std::thread::id ran_on;
  Result got = absl::UnknownError("not called");
  client->ComputeAsync(SmallRequest(), {}, [&](Result r) {
    ran_on = std::this_thread::get_id();
    got = std::move(r);
    done.Notify();
  });
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_TRUE(got.ok()) << got.status();
  EXPECT_NE(ran_on, std::this_thread::get_id());
}

TEST_F(LossClientTest, ADestroyedClientCancelsTheCallsNotStarted) {
  ClientOptions o = Options();
  o.max_in_flight = 1;
  auto client = Client(o);
  Hold hold(fake_);
  std::future<Result> running = client->ComputeAsync(SmallRequest());
  ASSERT_TRUE(hold.held.WaitForNotificationWithTimeout(absl::Seconds(30)));
  std::future<Result> waiting = client->ComputeAsync(SmallRequest());
  // The destructor answers the waiting call at once, then waits for the running one.
  std::thread destroy([&client] { client.reset(); });
  ASSERT_EQ(waiting.wait_for(kLong), std::future_status::ready);
  Result w = waiting.get();
  EXPECT_EQ(w.status().code(), absl::StatusCode::kCancelled);
  EXPECT_THAT(std::string(w.status().message()), HasSubstr("destroyed before this"));
  hold.release.Notify();
  destroy.join();
  EXPECT_TRUE(running.get().ok());
}

TEST(LossClientAsyncOptionsTest, MaxInFlightIsChecked) {
  for (int bad : {0, -1, 65}) {
    ClientOptions o;
    o.max_in_flight = bad;
    auto c = LossClient::Create(o);
    ASSERT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(c.status().message()),
                HasSubstr(absl::StrCat("max_in_flight must be in [1, 64] (ComputeAsync's calls "
                                       "at once), got ", bad)));
  }
}

}  // namespace
}  // namespace client
}  // namespace lossd
