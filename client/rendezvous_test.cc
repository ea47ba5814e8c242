// SPDX-License-Identifier: Apache-2.0
// Tests the pool's rendezvous hashing: the shared test vectors both clients assert
// (docs/replica_pool.md), balance over many keys, and that losing a replica moves only the
// keys it held.
#include "client/rendezvous.h"

#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace lossd {
namespace client {
namespace {

const std::vector<std::string> kThree = {"127.0.0.1:50051", "127.0.0.2:50051",
                                         "127.0.0.3:50051"};

std::vector<std::string> Endpoints(const std::vector<int>& last_octets) {
  std::vector<std::string> out;
  for (int o : last_octets) out.push_back(absl::StrCat("127.0.0.", o, ":50051"));
  return out;
}

TEST(RendezvousTest, HashPiecesMatchTheirDefinitions) {
  EXPECT_EQ(Fnv1a64(""), 0xcbf29ce484222325ull);  // the offset basis
  EXPECT_EQ(Fnv1a64("a"), 0xaf63dc4c8601ec8cull);  // FNV-1a 64's published value for "a"
  EXPECT_EQ(SplitMix64Finalize(0), 0u);
  // The key and the endpoint are joined by a NUL, so moving a byte across the join changes it.
  EXPECT_NE(RendezvousScore("ab", "c"), RendezvousScore("a", "bc"));
  EXPECT_EQ(RendezvousScore("ab", "c"),
            SplitMix64Finalize(Fnv1a64(std::string("ab\0c", 4))));
}

TEST(RendezvousTest, SharedTestVectors) {
  EXPECT_EQ(RendezvousScore("head:lm", "127.0.0.1:50051"), 0xa7b6fac87c987dbfull);
  const std::map<std::string, std::vector<int>> want = {
      {"head:lm", {1, 2, 3}}, {"acc:step-7", {3, 1, 2}}, {"rank:0", {3, 2, 1}},
      {"rank:1", {1, 3, 2}},  {"rank:2", {2, 1, 3}},     {"weights:w0", {2, 1, 3}},
  };
  for (const auto& [key, order] : want) {
    EXPECT_EQ(RendezvousOrder(key, kThree), Endpoints(order)) << key;
  }
  EXPECT_EQ(HeadKey("lm"), "head:lm");
  EXPECT_EQ(AccumulatorKey("step-7"), "acc:step-7");
  EXPECT_EQ(RankKey(0), "rank:0");
  EXPECT_EQ(WeightsKey("w0"), "weights:w0");
}

TEST(RendezvousTest, SharedCountsOverTenThousandRanks) {
  std::map<std::string, int> counts;
  for (uint32_t r = 0; r < 10000; ++r) ++counts[RendezvousOrder(RankKey(r), kThree).front()];
  EXPECT_EQ(counts[kThree[0]], 3344);
  EXPECT_EQ(counts[kThree[1]], 3321);
  EXPECT_EQ(counts[kThree[2]], 3335);
}

TEST(RendezvousTest, OrderIsIndependentOfTheListsOrderAndTiesGoToTheSmallerString) {
  std::vector<std::string> reversed(kThree.rbegin(), kThree.rend());
  EXPECT_EQ(RendezvousOrder("acc:x", reversed), RendezvousOrder("acc:x", kThree));
  // Equal strings score equally: the tie rule keeps the order total and deterministic.
  EXPECT_EQ(RendezvousOrder("k", {"b", "a", "b"}).size(), 3u);
  EXPECT_TRUE(RendezvousOrder("k", {}).empty());
}

// Where state goes after a loss: the replica after the lost one in the key's order, wrapping
// around; the same vectors as the Python client's test (test_pool_route.py).
TEST(RendezvousTest, OrderAfterLossBeginsAfterTheLostReplicaAndWraps) {
  // head:lm's order over kThree is .1, .2, .3 (SharedTestVectors).
  EXPECT_EQ(OrderAfterLoss("head:lm", kThree, kThree[0]), Endpoints({2, 3}));
  EXPECT_EQ(OrderAfterLoss("head:lm", kThree, kThree[1]), Endpoints({3, 1}));
  EXPECT_EQ(OrderAfterLoss("head:lm", kThree, kThree[2]), Endpoints({1, 2}));
  // acc:step-7's is .3, .1, .2.
  EXPECT_EQ(OrderAfterLoss("acc:step-7", kThree, kThree[2]), Endpoints({1, 2}));
  EXPECT_EQ(OrderAfterLoss("acc:step-7", kThree, kThree[0]), Endpoints({2, 3}));
  // A lost replica no longer listed keeps its place in the order: the same answer.
  const std::vector<std::string> two = {kThree[1], kThree[2]};
  EXPECT_EQ(OrderAfterLoss("head:lm", two, kThree[0]), Endpoints({2, 3}));
  EXPECT_EQ(OrderAfterLoss("head:lm", {kThree[0], kThree[2]}, kThree[1]), Endpoints({3, 1}));
  EXPECT_TRUE(OrderAfterLoss("head:lm", {kThree[0]}, kThree[0]).empty());
}

// Every kind of key, over 3, 5 and 8 replicas: each replica's share within 10% of even.
TEST(RendezvousTest, BalanceWithinTenPercentOfEven) {
  for (int n : {3, 5, 8}) {
    std::vector<std::string> endpoints;
    for (int i = 0; i < n; ++i) endpoints.push_back(absl::StrCat("10.1.", i, ".7:50051"));
    for (const char* kind : {"rank", "acc", "weights", "head"}) {
      std::map<std::string, int> counts;
      const int keys = 2000 * n;
      for (int k = 0; k < keys; ++k) {
        const std::string key = std::string(kind) == "rank"
                                    ? RankKey(k)
                                    : absl::StrCat(kind, ":trainer-", k % 64, "-step-", k);
        ++counts[RendezvousOrder(key, endpoints).front()];
      }
      ASSERT_EQ(counts.size(), static_cast<size_t>(n)) << kind << " over " << n;
      const double even = static_cast<double>(keys) / n;
      for (const auto& [e, c] : counts) {
        EXPECT_GE(c, 0.9 * even) << kind << " keys on " << e << " of " << n;
        EXPECT_LE(c, 1.1 * even) << kind << " keys on " << e << " of " << n;
      }
    }
  }
}

// Losing one replica moves exactly the keys it held, and those spread over all the others;
// every other key keeps its replica.
TEST(RendezvousTest, LosingAReplicaMovesOnlyItsKeys) {
  std::vector<std::string> four;
  for (int i = 1; i <= 4; ++i) four.push_back(absl::StrCat("127.0.0.", i, ":50051"));
  const std::vector<std::string> three(four.begin() + 1, four.end());  // four[0] gone
  std::map<std::string, int> moved_to;
  int moved = 0;
  for (uint32_t r = 0; r < 3000; ++r) {
    const std::vector<std::string> before = RendezvousOrder(RankKey(r), four);
    const std::string after = RendezvousOrder(RankKey(r), three).front();
    if (before.front() == four[0]) {
      ++moved;
      ++moved_to[after];
      EXPECT_EQ(after, before[1]) << "rank " << r << " goes to its next by the same order";
    } else {
      EXPECT_EQ(after, before.front()) << "rank " << r << " must not move";
    }
  }
  EXPECT_GT(moved, 600);
  EXPECT_LT(moved, 900);
  EXPECT_EQ(moved_to.size(), 3u);
  for (const auto& [e, c] : moved_to) EXPECT_GT(c, moved / 5) << e;
}

}  // namespace
}  // namespace client
}  // namespace lossd
