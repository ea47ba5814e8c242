// SPDX-License-Identifier: Apache-2.0
// The gloo communicator of a head group: three members as threads of this process over TCP on
// 127.0.0.1, rendezvous through a MemoryGroupStore.
#include "engine/head_group.h"

#include <atomic>
#include <cstring>
#include <functional>
#include <iostream>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace lossd {
namespace {

using ::testing::HasSubstr;

HeadGroup Group(uint32_t member, uint32_t size, const std::string& id) {
  HeadGroup g;
  for (uint32_t m = 0; m < size; ++m) g.members.push_back("127.0.0.1:" + std::to_string(7000 + m));
  g.member = member;
  g.id = id;
  return g;
}

// Runs f(member) on `size` threads, each with its own communicator of one group.
void OnEveryMember(uint32_t size, const std::string& id, absl::Duration timeout,
                   const std::function<void(uint32_t, HeadComm&)>& f) {
  auto store = std::make_shared<MemoryGroupStore>();
  std::vector<std::thread> threads;
  for (uint32_t m = 0; m < size; ++m) {
    threads.emplace_back([&, m] {
      GlooOptions o;
      o.timeout = timeout;
      auto comm = ConnectGloo(store, Group(m, size, id), o);
      ASSERT_TRUE(comm.ok()) << comm.status();
      f(m, **comm);
    });
  }
  for (auto& t : threads) t.join();
}

TEST(HeadGroupTest, ReduceScatterLeavesEachMemberItsSliceOfTheSum) {
  for (uint32_t size : {2u, 3u}) {
    const int64_t n = 1001;  // not a multiple of 2 or 3
    OnEveryMember(size, "rs" + std::to_string(size), absl::Seconds(20),
                  [&](uint32_t m, HeadComm& comm) {
      std::vector<float> buf(n);
      // Small integers: every order of the sum is exact, so the check is exact.
      for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>((i % 7) * (m + 1));
      const absl::Status rs = comm.ReduceScatter(buf.data(), n);
      ASSERT_TRUE(rs.ok()) << rs;
      const HeadSlice s = HeadSliceOf(n, m, size);
      const float members = size * (size + 1) / 2.0f;
      for (int64_t i = s.lo; i < s.hi; ++i) ASSERT_EQ(buf[i], (i % 7) * members) << i;
      // With three members gloo's reduce-scatter may finish on one member before a peer has
      // read its last message, and a communicator destroyed then fails that read ("closed by
      // peer"): each member waits for the others before its communicator goes.
      const absl::Status left = comm.Barrier();
      ASSERT_TRUE(left.ok()) << left;
    });
  }
}

TEST(HeadGroupTest, AllGatherGivesEveryMemberEverySlice) {
  const int64_t n = 37;
  OnEveryMember(3, "ag", absl::Seconds(20), [&](uint32_t m, HeadComm& comm) {
    std::vector<uint16_t> buf(n, 0xFFFF);
    const HeadSlice s = HeadSliceOf(n, m, 3);
    for (int64_t i = s.lo; i < s.hi; ++i) buf[i] = static_cast<uint16_t>(i * 3);
    ASSERT_TRUE(comm.AllGather(buf.data(), n, sizeof(uint16_t)).ok());
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(buf[i], i * 3) << i;
    auto values = comm.AllGatherValues({1.0 * m, 10.0 * m});
    ASSERT_TRUE(values.ok());
    EXPECT_EQ(*values, (std::vector<double>{0, 0, 1, 10, 2, 20}));
    EXPECT_TRUE(comm.Barrier().ok());
  });
}

// Each member's arrival marks are forgotten once the next collective completed: a long run's
// store does not grow with its steps.
TEST(HeadGroupTest, TheStoreDoesNotGrowWithTheCollectivesRun) {
  auto store = std::make_shared<MemoryGroupStore>();
  std::vector<size_t> sizes(2);
  std::vector<std::thread> threads;
  for (uint32_t m = 0; m < 2; ++m) {
    threads.emplace_back([&, m] {
      auto comm = ConnectGloo(store, Group(m, 2, "grow"), GlooOptions{});
      ASSERT_TRUE(comm.ok()) << comm.status();
      for (int i = 0; i < 3; ++i) ASSERT_TRUE((*comm)->Barrier().ok());
      ASSERT_TRUE((*comm)->Barrier().ok());
      if (m == 0) sizes[0] = store->size();
      for (int i = 0; i < 50; ++i) ASSERT_TRUE((*comm)->Barrier().ok());
      if (m == 0) sizes[1] = store->size();
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_LE(sizes[1], sizes[0] + 2);  // at most each member's latest mark beyond
}

TEST(HeadGroupTest, AMemberThatNeverJoinsIsNamed) {
  auto store = std::make_shared<MemoryGroupStore>();
  std::vector<absl::Status> got(2);
  std::vector<std::thread> threads;
  for (uint32_t m = 0; m < 2; ++m) {
    threads.emplace_back([&, m] {
      GlooOptions o;
      o.timeout = absl::Milliseconds(500);
      got[m] = ConnectGloo(store, Group(m, 3, "absent"), o).status();
    });
  }
  for (auto& t : threads) t.join();
  for (const absl::Status& s : got) {
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_THAT(s.message(), HasSubstr("member 2 (127.0.0.1:7002) never joined")) << s;
  }
}

TEST(HeadGroupTest, ACollectiveAMemberNeverJoinsTimesOutNamingItAndAbortsTheGroup) {
  OnEveryMember(3, "stall", absl::Seconds(1), [&](uint32_t m, HeadComm& comm) {
    ASSERT_TRUE(comm.Barrier().ok());
    if (m == 2) return;  // never takes part in the next collective
    absl::StatusOr<std::vector<double>> got = comm.AllGatherValues({1.0});
    EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
    EXPECT_THAT(got.status().message(), HasSubstr("member 2 (127.0.0.1:7002) never arrived"));
    absl::Status again = comm.Barrier();
    EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition) << again;
    EXPECT_THAT(again.message(), HasSubstr("was aborted earlier"));
  });
}

// A member whose collective failed leaves the group at once: a member that comes to the
// next collective later fails without waiting out the timeout, and its error carries why
// (the member that never arrived), read from the store.
TEST(HeadGroupTest, AMemberArrivingAfterTheGroupFailedIsToldAtOnceWhoWasLost) {
  const absl::Duration timeout = absl::Seconds(4);
  absl::Notification member0_failed, member1_done;
  absl::Duration member1_took;
  OnEveryMember(3, "late", timeout, [&](uint32_t m, HeadComm& comm) {
    ASSERT_TRUE(comm.Barrier().ok());
    if (m == 2) {  // stalled: its connections stay open, it takes no part
      member1_done.WaitForNotificationWithTimeout(absl::Seconds(60));
      return;
    }
    if (m == 1) member0_failed.WaitForNotificationWithTimeout(absl::Seconds(60));
    const absl::Time start = absl::Now();
    absl::StatusOr<std::vector<double>> got = comm.AllGatherValues({1.0});
    const absl::Status& s = got.status();
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    if (m == 0) {
      EXPECT_THAT(s.message(), HasSubstr("members 1 (127.0.0.1:7001), 2 (127.0.0.1:7002) "
                                         "never arrived"))
          << s;
      member0_failed.Notify();
    } else {
      member1_took = absl::Now() - start;
      EXPECT_THAT(s.message(), HasSubstr("failed on member 1 (127.0.0.1:7001): member 0 "
                                         "(127.0.0.1:7000) left the group before (the "
                                         "all-gather of the step's arguments and norms of "
                                         "head group 'late' failed on member 0"))
          << s;
      EXPECT_THAT(s.message(), HasSubstr("); member 2 (127.0.0.1:7002) never arrived")) << s;
      member1_done.Notify();
    }
    EXPECT_EQ(comm.AbortReason(), s.message());
  });
  EXPECT_LT(member1_took, timeout / 2);  // measured: milliseconds
  std::cout << "member 1 failed " << member1_took << " after it arrived\n";
}

// A store that stops answering (lossd keeps it on member 0: member 0 was lost, or stalls):
// every call, or only the reads, fail with `code`. A remote store past its call's deadline
// says DEADLINE_EXCEEDED, as a key that is not set does.
class CutStore : public HeadGroupStore {
 public:
  absl::Status Set(const std::string& k, const std::string& v) override {
    return cut_ && !reads_only_ ? Gone() : inner_.Set(k, v);
  }
  absl::StatusOr<std::string> Get(const std::string& k, absl::Duration t) override {
    if (cut_) return Gone();
    return inner_.Get(k, t);
  }
  bool Has(const std::string& k) override { return !cut_ && inner_.Has(k); }
  absl::Status Delete(const std::string& k) override {
    return cut_ && !reads_only_ ? Gone() : inner_.Delete(k);
  }
  std::atomic<bool> cut_{false};
  bool reads_only_ = false;
  absl::StatusCode code_ = absl::StatusCode::kUnavailable;

 private:
  absl::Status Gone() const { return absl::Status(code_, "the store did not answer"); }
  MemoryGroupStore inner_;
};

TEST(HeadGroupTest, AStoreThatCannotBeReachedIsSaidNotGuessed) {
  // Lost: nothing reaches it. Stalled after this member's arrival was marked: its reads run
  // past their deadline, which must not read as members that never arrived.
  for (bool stalled : {false, true}) {
    auto store = std::make_shared<CutStore>();
    store->reads_only_ = stalled;
    store->code_ = stalled ? absl::StatusCode::kDeadlineExceeded
                           : absl::StatusCode::kUnavailable;
    const std::string id = stalled ? "stalled" : "cut";
    absl::Notification formed;
    std::thread member0([&] {
      auto comm = ConnectGloo(store, Group(0, 2, id), GlooOptions{});
      ASSERT_TRUE(comm.ok()) << comm.status();
      formed.WaitForNotification();
    });  // member 0 goes, and its connections with it
    GlooOptions o;
    o.timeout = absl::Seconds(4);
    auto comm = ConnectGloo(store, Group(1, 2, id), o);
    ASSERT_TRUE(comm.ok()) << comm.status();
    store->cut_ = true;
    formed.Notify();
    member0.join();
    const absl::Status got = (*comm)->Barrier();
    EXPECT_EQ(got.code(), absl::StatusCode::kUnavailable) << got;
    EXPECT_THAT(got.message(), HasSubstr("failed on member 1 (127.0.0.1:7001): the group's "
                                         "store (member 0, 127.0.0.1:7000) cannot be reached, "
                                         "so it cannot tell which members arrived: the store "
                                         "did not answer"))
        << got;
  }
}

}  // namespace
}  // namespace lossd
