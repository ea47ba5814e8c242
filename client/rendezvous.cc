// SPDX-License-Identifier: Apache-2.0
#include "client/rendezvous.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace lossd {
namespace client {

uint64_t Fnv1a64(absl::string_view bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char b : bytes) {
    h ^= b;
    h *= 0x100000001b3ull;
  }
  return h;
}

uint64_t SplitMix64Finalize(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t RendezvousScore(absl::string_view key, absl::string_view endpoint) {
  std::string bytes;
  bytes.reserve(key.size() + 1 + endpoint.size());
  bytes.append(key.data(), key.size());
  bytes.push_back('\0');  // "ab"+"c" and "a"+"bc" must not hash alike
  bytes.append(endpoint.data(), endpoint.size());
  return SplitMix64Finalize(Fnv1a64(bytes));
}

std::vector<std::string> RendezvousOrder(absl::string_view key,
                                         const std::vector<std::string>& endpoints) {
  std::vector<std::pair<uint64_t, const std::string*>> scored;
  scored.reserve(endpoints.size());
  for (const std::string& e : endpoints) scored.emplace_back(RendezvousScore(key, e), &e);
  std::sort(scored.begin(), scored.end(), [](const auto& a, const auto& b) {
    if (a.first != b.first) return a.first > b.first;
    return *a.second < *b.second;
  });
  std::vector<std::string> out;
  out.reserve(scored.size());
  for (const auto& s : scored) out.push_back(*s.second);
  return out;
}

std::vector<std::string> OrderAfterLoss(absl::string_view key,
                                        const std::vector<std::string>& endpoints,
                                        const std::string& lost_on) {
  std::vector<std::string> all = endpoints;
  if (std::find(all.begin(), all.end(), lost_on) == all.end()) all.push_back(lost_on);
  std::vector<std::string> order = RendezvousOrder(key, all);
  const auto at = std::find(order.begin(), order.end(), lost_on);
  std::vector<std::string> out(at + 1, order.end());
  out.insert(out.end(), order.begin(), at);
  return out;
}

std::string WeightsKey(absl::string_view name) { return absl::StrCat("weights:", name); }
std::string AccumulatorKey(absl::string_view name) { return absl::StrCat("acc:", name); }
std::string HeadKey(absl::string_view name) { return absl::StrCat("head:", name); }
std::string RankKey(uint32_t rank) { return absl::StrCat("rank:", rank); }

}  // namespace client
}  // namespace lossd
