// SPDX-License-Identifier: Apache-2.0
// Tests the pool's replicas without servers: the checks of PoolOptions (each naming its
// field), resolution at creation, again after the period (an injected clock) and at once
// after a replica is found unreachable (a closed port on loopback), and that a replica found
// down goes last in every key's order, probed again each time down_for has passed.
#include "client/replica_pool.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/rendezvous.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace lossd {
namespace client {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A loopback port nothing listens on: bound (so nobody else takes it) but never listening,
// so a connection to it is refused at once.
class ClosedPort {
 public:
  ClosedPort() {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    socklen_t len = sizeof(a);
    getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
  }
  ~ClosedPort() { close(fd_); }
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

TEST(ReplicaPoolTest, RefusesEveryBadOptionNamingIt) {
  const struct {
    std::function<void(PoolOptions*)> set;
    const char* message;
  } cases[] = {
      {[](PoolOptions* o) { o->targets = ""; }, "targets is empty"},
      {[](PoolOptions* o) { o->targets = "a:99999"; }, "targets entry 'a:99999': port"},
      {[](PoolOptions* o) { o->client.target = "x:1"; }, "client.target must be empty"},
      {[](PoolOptions* o) { o->client.connections = 0; }, "client: connections must be"},
      {[](PoolOptions* o) { o->client.part_bytes = 0; }, "client: part_bytes"},
      {[](PoolOptions* o) { o->reresolve_period = absl::ZeroDuration(); },
       "reresolve_period must be a positive, finite duration, got 0"},
      {[](PoolOptions* o) { o->reresolve_period = absl::InfiniteDuration(); },
       "reresolve_period must be"},
      {[](PoolOptions* o) { o->down_for = absl::Seconds(-1); }, "down_for must be"},
      {[](PoolOptions* o) { o->probe_deadline = absl::ZeroDuration(); },
       "probe_deadline must be"},
      {[](PoolOptions* o) { o->tickets_kept = 0; }, "tickets_kept must be at least 1, got 0"},
  };
  for (const auto& c : cases) {
    PoolOptions o;
    o.targets = "127.0.0.1:50051";
    c.set(&o);
    absl::Status s = ValidatePoolOptions(o);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.message));
    EXPECT_EQ(ReplicaPool::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  }
  PoolOptions ok;
  ok.targets = "127.0.0.1:50051";
  EXPECT_TRUE(ValidatePoolOptions(ok).ok());
}

TEST(ReplicaPoolTest, NoReplicaAtCreationIsAnError) {
  PoolOptions o;
  o.targets = "dns:///svc:50051";
  o.resolve = [](const std::string&) -> absl::StatusOr<std::vector<std::string>> {
    return absl::NotFoundError("NXDOMAIN");
  };
  absl::StatusOr<std::unique_ptr<ReplicaPool>> p = ReplicaPool::Create(o);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("svc: NXDOMAIN"));
}

TEST(ReplicaPoolTest, ResolvesAgainAfterThePeriodAndKeepsTheLastListOnFailure) {
  absl::Time now = absl::FromUnixSeconds(1000);
  std::vector<std::string> answer = {"10.0.0.1", "10.0.0.2"};
  int asked = 0;
  PoolOptions o;
  o.targets = "dns:///svc:50051";
  o.reresolve_period = absl::Seconds(30);
  o.now = [&] { return now; };
  o.resolve = [&](const std::string& host) -> absl::StatusOr<std::vector<std::string>> {
    ++asked;
    EXPECT_EQ(host, "svc");
    if (answer.empty()) return absl::UnavailableError("DNS down");
    return answer;
  };
  auto pool = ReplicaPool::Create(o);
  ASSERT_TRUE(pool.ok()) << pool.status();
  ReplicaPool& p = **pool;
  EXPECT_EQ(asked, 1);
  EXPECT_THAT(p.endpoints(), ElementsAre("10.0.0.1:50051", "10.0.0.2:50051"));

  now += absl::Seconds(29);
  p.Order("rank:0");
  EXPECT_EQ(asked, 1);  // within the period
  answer = {"10.0.0.3", "10.0.0.2"};
  now += absl::Seconds(1);
  EXPECT_EQ(p.Order("rank:0"), RendezvousOrder("rank:0", {"10.0.0.2:50051", "10.0.0.3:50051"}));
  EXPECT_EQ(asked, 2);
  EXPECT_EQ(p.counters().reresolutions, 1u);

  answer.clear();  // the name resolves to nothing for a while: the replicas stay
  now += absl::Seconds(30);
  EXPECT_EQ(p.Order("rank:0").size(), 2u);
  EXPECT_EQ(asked, 3);
  EXPECT_EQ(p.counters().reresolutions, 2u);
}

TEST(ReplicaPoolTest, AnUnreachableReplicaGoesLastAndIsResolvedAgainAndProbedAfterDownFor) {
  ClosedPort closed;
  absl::Time now = absl::FromUnixSeconds(1000);
  std::vector<std::string> log;
  PoolOptions o;
  const std::string dead = absl::StrCat("127.0.0.1:", closed.port());
  const std::string other = absl::StrCat("127.0.0.2:", closed.port());
  // One name with two addresses: the dead replica and another.
  o.targets = absl::StrCat("dns:///replicas:", closed.port());
  o.resolve = [](const std::string&) -> absl::StatusOr<std::vector<std::string>> {
    return std::vector<std::string>{"127.0.0.1", "127.0.0.2"};
  };
  o.down_for = absl::Seconds(10);
  o.now = [&] { return now; };
  o.log = [&](const std::string& line) { log.push_back(line); };
  auto pool = ReplicaPool::Create(o);
  ASSERT_TRUE(pool.ok()) << pool.status();
  ReplicaPool& p = **pool;
  // A key whose home is the dead one.
  std::string key;
  for (uint32_t r = 0; key.empty(); ++r) {
    if (p.Order(RankKey(r)).front() == dead) key = RankKey(r);
  }
  absl::StatusOr<ServerInfoResult> info = p.Client(dead)->ServerInfo();
  ASSERT_EQ(info.status().code(), absl::StatusCode::kUnavailable) << info.status();
  EXPECT_EQ(p.counters().calls.at(dead), 1u);

  // A bad request's own error is not a lost replica, whatever the code.
  EXPECT_FALSE(p.LostReason(dead, absl::InvalidArgumentError("x"), "").has_value());
  std::optional<std::string> why = p.LostReason(dead, info.status(), "");
  ASSERT_TRUE(why.has_value());
  EXPECT_THAT(*why, HasSubstr("is unreachable"));
  const uint64_t resolutions = p.counters().reresolutions;
  EXPECT_THAT(p.Order(key), ElementsAre(other, dead));
  EXPECT_EQ(p.counters().reresolutions, resolutions + 1);  // resolved again at once
  now += absl::Seconds(9);
  EXPECT_THAT(p.Order(key), ElementsAre(other, dead));
  // Its down time over, it is probed before it takes keys again: still unreachable, so down
  // for another down_for. (A replica that is back takes its keys again: pooled_client_test.)
  now += absl::Seconds(1);
  EXPECT_THAT(p.Order(key), ElementsAre(other, dead));
  now += absl::Seconds(9);
  EXPECT_THAT(p.Order(key), ElementsAre(other, dead));
  EXPECT_TRUE(log.empty());  // the pool logs moves, not probes

  // A fixed list is never looked up, so never counted as resolved again.
  PoolOptions fixed = o;
  fixed.targets = absl::StrCat(dead, ",", other);
  fixed.resolve = nullptr;
  auto listed = ReplicaPool::Create(fixed);
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_TRUE((*listed)->LostReason(dead, info.status(), "").has_value());
  EXPECT_THAT((*listed)->Order(key), ElementsAre(other, dead));
  EXPECT_EQ((*listed)->counters().reresolutions, 0u);
}

}  // namespace
}  // namespace client
}  // namespace lossd
