// SPDX-License-Identifier: Apache-2.0
// Tests the pool's targets: a list named as written, a name alone resolved, every refusal
// (naming the field and the entry), endpoint strings (IPv6 in brackets), resolution through
// an injected resolver (every address one replica, duplicates merged) and getaddrinfo.
#include "client/replica_resolver.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace lossd {
namespace client {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(ReplicaResolverTest, AListNamesItsReplicasAsWrittenANameAloneIsResolved) {
  absl::StatusOr<std::vector<TargetEntry>> t =
      ParseTargets("127.0.0.1:50051, [::0:1]:7 ,node1:50051");
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->size(), 3u);
  EXPECT_EQ((*t)[0].host, "127.0.0.1");
  EXPECT_EQ((*t)[0].port, 50051);
  EXPECT_EQ((*t)[1].host, "::1");  // canonical: one replica, one string
  EXPECT_EQ((*t)[1].port, 7);
  EXPECT_EQ((*t)[2].host, "node1");
  for (const TargetEntry& e : *t) EXPECT_FALSE(e.resolve) << e.host;
  auto list = ResolveTargets(*t, nullptr);
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_THAT(*list, ElementsAre("127.0.0.1:50051", "[::1]:7", "node1:50051"));

  for (const char* alone : {"dns:///lossd-headless.lossd.svc:50051", "lossd-headless:50051",
                            "dns:///10.0.0.1:50051"}) {
    t = ParseTargets(alone);
    ASSERT_TRUE(t.ok()) << t.status();
    ASSERT_EQ(t->size(), 1u);
    EXPECT_TRUE((*t)[0].resolve) << alone;
    EXPECT_EQ((*t)[0].port, 50051);
  }
  t = ParseTargets("10.0.0.1:50051");  // an address alone is one replica
  ASSERT_TRUE(t.ok());
  EXPECT_FALSE((*t)[0].resolve);
}

TEST(ReplicaResolverTest, RefusesBadTargetsNamingTheFieldAndEntry) {
  const struct {
    const char* targets;
    const char* message;
  } cases[] = {
      {"", "targets is empty"},
      {"  ", "targets is empty"},
      {"a:1,,b:2", "targets has an empty entry"},
      {"host", "targets entry 'host': expected host:port"},
      {"::1:50051", "targets entry '::1:50051': expected host:port"},
      {":50051", "targets entry ':50051': empty host"},
      {"a:0", "port '0' is not a number in [1, 65535]"},
      {"a:65536", "port '65536'"},
      {"a:-1", "port '-1'"},
      {"a:http", "port 'http'"},
      {"a:", "port ''"},
      {"a: 5", "port ' 5'"},
      {"[::1:50051", "'[' without ']'"},
      {"[::1]", "targets entry '[::1]': port ''"},
      {"ipv4:///1.2.3.4:5", "only dns:/// names and host:port"},
      {"dns:///a:1,b:2", "'dns:///a:1': a dns:/// name stands alone"},
      {"a:1,b:2,a:1", "targets entry 'a:1': a replica listed twice"},
      {"[::1]:5,[0::1]:5", "a replica listed twice"},
  };
  for (const auto& c : cases) {
    absl::StatusOr<std::vector<TargetEntry>> t = ParseTargets(c.targets);
    ASSERT_FALSE(t.ok()) << "'" << c.targets << "' was accepted";
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << c.targets;
    EXPECT_THAT(std::string(t.status().message()), HasSubstr(c.message)) << c.targets;
  }
  EXPECT_THAT(std::string(ParseTargets("", "--targets").status().message()),
              HasSubstr("--targets is empty"));
}

TEST(ReplicaResolverTest, EndpointStrings) {
  EXPECT_EQ(EndpointString("10.0.0.5", 50051), "10.0.0.5:50051");
  EXPECT_EQ(EndpointString("fd00::5", 50051), "[fd00::5]:50051");
}

TEST(ReplicaResolverTest, EveryAddressOfANameIsOneReplicaSortedAndMerged) {
  std::vector<std::string> asked;
  ResolveFunction resolve = [&](const std::string& host)
      -> absl::StatusOr<std::vector<std::string>> {
    asked.push_back(host);
    return std::vector<std::string>{"10.0.0.9", "10.0.0.5", "fd00:0::5", "10.0.0.5"};
  };
  auto entries = ParseTargets("dns:///svc:50051");
  ASSERT_TRUE(entries.ok()) << entries.status();
  absl::StatusOr<std::vector<std::string>> e = ResolveTargets(*entries, resolve);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_THAT(*e, ElementsAre("10.0.0.5:50051", "10.0.0.9:50051", "[fd00::5]:50051"));
  EXPECT_THAT(asked, ElementsAre("svc"));
}

TEST(ReplicaResolverTest, ANameWithoutAddressesIsUnavailableNamingTheFailure) {
  const struct {
    const char* target;
    const char* message;
  } cases[] = {{"gone:1", "gone: NXDOMAIN"},
               {"empty:2", "empty: no addresses"},
               {"junk:3", "'not-an-ip', not an address"}};
  ResolveFunction resolve = [](const std::string& host)
      -> absl::StatusOr<std::vector<std::string>> {
    if (host == "empty") return std::vector<std::string>{};
    if (host == "junk") return std::vector<std::string>{"not-an-ip"};
    return absl::NotFoundError("NXDOMAIN");
  };
  for (const auto& c : cases) {
    auto entries = ParseTargets(c.target);
    ASSERT_TRUE(entries.ok());
    absl::StatusOr<std::vector<std::string>> e = ResolveTargets(*entries, resolve);
    ASSERT_FALSE(e.ok()) << c.target;
    EXPECT_EQ(e.status().code(), absl::StatusCode::kUnavailable);
    EXPECT_THAT(std::string(e.status().message()), HasSubstr(c.message));
  }
}

TEST(ReplicaResolverTest, GetAddrInfoResolvesLocalhost) {
  absl::StatusOr<std::vector<std::string>> ips = GetAddrInfoResolve("localhost");
  ASSERT_TRUE(ips.ok()) << ips.status();
  ASSERT_FALSE(ips->empty());
  for (const std::string& ip : *ips) {
    EXPECT_TRUE(ip == "127.0.0.1" || ip == "::1") << ip;
  }
  absl::StatusOr<std::vector<std::string>> none = GetAddrInfoResolve("no-such-host.invalid");
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(none.status().message()), HasSubstr("no-such-host.invalid"));
}

}  // namespace
}  // namespace client
}  // namespace lossd
