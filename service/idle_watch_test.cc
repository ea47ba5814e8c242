// SPDX-License-Identifier: Apache-2.0
#include "service/idle_watch.h"

#include <atomic>
#include <memory>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace lossd {
namespace {

constexpr absl::Duration kTimeout = absl::Milliseconds(200);
constexpr absl::Duration kTick = absl::Milliseconds(10);

// Waits up to `limit` for `done`; true when it came.
template <typename F>
bool Eventually(F done, absl::Duration limit = absl::Seconds(5)) {
  const absl::Time end = absl::Now() + limit;
  while (absl::Now() < end) {
    if (done()) return true;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return done();
}

TEST(IdleWatchTest, AnArmedIdleEntryExpiresOnceAndAnUnarmedOneNever) {
  IdleWatch watch(kTimeout, kTick);
  std::atomic<int> armed_fired{0}, unarmed_fired{0};
  auto armed = watch.Watch([&] { ++armed_fired; });
  auto unarmed = watch.Watch([&] { ++unarmed_fired; });
  armed->Arm();
  const absl::Time start = absl::Now();
  ASSERT_TRUE(Eventually([&] { return armed_fired.load() == 1; }));
  EXPECT_GE(absl::Now() - start, kTimeout);
  EXPECT_TRUE(armed->expired());
  absl::SleepFor(3 * kTimeout);
  EXPECT_EQ(armed_fired.load(), 1) << "expired twice";
  EXPECT_EQ(unarmed_fired.load(), 0);
  EXPECT_FALSE(unarmed->expired());
  EXPECT_EQ(watch.expired_count(), 1u);
  EXPECT_NE(armed->Reason().find("no message from the client for 200ms"), std::string::npos);
  watch.Unwatch(armed);
  watch.Unwatch(unarmed);
}

// A write the client does not take expires the entry, armed or not (a stream that sends
// results has no read pending); writes that complete in time, one after another for longer
// than the timeout in all, do not.
TEST(IdleWatchTest, AWriteNotTakenWithinTheTimeoutExpires) {
  IdleWatch watch(kTimeout, kTick);
  std::atomic<int> fired{0};
  auto e = watch.Watch([&] { ++fired; });
  for (int i = 0; i < 10; ++i) {  // 10 x 50 ms writes
    e->WriteStarted();
    absl::SleepFor(absl::Milliseconds(50));
    e->WriteDone();
  }
  absl::SleepFor(2 * kTimeout);  // no write in flight, disarmed: waiting for itself
  EXPECT_EQ(fired.load(), 0);
  EXPECT_FALSE(e->expired());
  e->WriteStarted();
  const absl::Time start = absl::Now();
  ASSERT_TRUE(Eventually([&] { return fired.load() == 1; }));
  EXPECT_GE(absl::Now() - start, kTimeout);
  EXPECT_TRUE(e->expired());
  EXPECT_NE(e->Reason().find("the client took no response message for 200ms"),
            std::string::npos)
      << e->Reason();
  watch.Unwatch(e);
}

TEST(IdleWatchTest, TouchesAndAFollowedClockKeepItAlive) {
  IdleWatch watch(kTimeout, kTick);
  std::atomic<int> fired{0};
  auto e = watch.Watch([&] { ++fired; });
  e->Arm();
  for (int i = 0; i < 10; ++i) {  // 10 x 50 ms, past the timeout in all
    absl::SleepFor(absl::Milliseconds(50));
    e->Touch();
  }
  EXPECT_EQ(fired.load(), 0);
  // A sibling's clock moving counts as activity too.
  std::atomic<int64_t> sibling{IdleWatch::Entry::Now()};
  e->Follow(&sibling);
  for (int i = 0; i < 10; ++i) {
    absl::SleepFor(absl::Milliseconds(50));
    sibling.store(IdleWatch::Entry::Now());
  }
  EXPECT_EQ(fired.load(), 0);
  // Disarmed (lossd waits for itself): never expires; armed again, it does.
  e->Disarm();
  absl::SleepFor(2 * kTimeout);
  EXPECT_EQ(fired.load(), 0);
  e->Arm();
  EXPECT_TRUE(Eventually([&] { return fired.load() == 1; }));
  watch.Unwatch(e);
}

// Unwatch returns only once a running expiry has returned, and an expiry may Unwatch its own
// entry (gRPC can run a cancelled call's OnDone inside TryCancel).
TEST(IdleWatchTest, UnwatchWaitsForARunningExpiryAndMayBeCalledFromIt) {
  IdleWatch watch(kTimeout, kTick);
  absl::Notification entered, release;
  std::atomic<bool> returned{false};
  auto slow = watch.Watch([&] {
    entered.Notify();
    release.WaitForNotification();
    returned = true;
  });
  slow->Arm();
  ASSERT_TRUE(entered.WaitForNotificationWithTimeout(absl::Seconds(5)));
  std::thread unwatch([&] {
    watch.Unwatch(slow);
    EXPECT_TRUE(returned.load()) << "Unwatch returned while the expiry still ran";
  });
  absl::SleepFor(absl::Milliseconds(50));
  release.Notify();
  unwatch.join();

  std::shared_ptr<IdleWatch::Entry> self;
  std::atomic<bool> done{false};
  self = watch.Watch([&] {
    watch.Unwatch(self);  // must not deadlock
    done = true;
  });
  self->Arm();
  EXPECT_TRUE(Eventually([&] { return done.load(); }));
}

TEST(IdleWatchTest, AZeroTimeoutWatchesNothing) {
  IdleWatch watch(absl::ZeroDuration());
  std::atomic<int> fired{0};
  auto e = watch.Watch([&] { ++fired; });
  e->Arm();
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(fired.load(), 0);
  watch.Unwatch(e);
}

}  // namespace
}  // namespace lossd
