// SPDX-License-Identifier: Apache-2.0
// Rendezvous (highest random weight) hashing of the replica pool: which replica a key's state
// lives on, and where it goes next when that replica is lost. The C++ and Python clients
// compute the same scores (docs/replica_pool.md), so a C++ and a Python trainer of one job
// send one key to one replica. Pure functions: no I/O, no state.
#ifndef LOSSD_CLIENT_RENDEZVOUS_H_
#define LOSSD_CLIENT_RENDEZVOUS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace lossd {
namespace client {

// 64-bit FNV-1a of `bytes` (offset basis 0xcbf29ce484222325, prime 0x100000001b3).
uint64_t Fnv1a64(absl::string_view bytes);
// splitmix64's finalizer: spreads FNV's weak low bits over the whole word.
uint64_t SplitMix64Finalize(uint64_t z);
// score(key, endpoint) = SplitMix64Finalize(Fnv1a64(key + '\0' + endpoint)).
uint64_t RendezvousScore(absl::string_view key, absl::string_view endpoint);
// `endpoints` by descending score for `key` (ties: the smaller endpoint string first): the
// key's home first, then its failover order. Losing one endpoint moves only the keys whose
// home it was, each to its own next endpoint, which spreads them evenly over the rest.
std::vector<std::string> RendezvousOrder(absl::string_view key,
                                         const std::vector<std::string>& endpoints);
// Where a key's state goes after it was lost on `lost_on` (unreachable, or restarted: its
// instance changed): every endpoint but `lost_on`, beginning with the one after it in the
// key's order over `endpoints` and `lost_on`, wrapping around. A function of the replica list
// and the replica that lost the state only, so every pool that meets the loss, in whatever
// order and whatever it saw before, names the same new home; and the replica that lost it is
// never that home, even when it is back (restarted, empty). Empty when `lost_on` is the only
// endpoint.
std::vector<std::string> OrderAfterLoss(absl::string_view key,
                                        const std::vector<std::string>& endpoints,
                                        const std::string& lost_on);

// The key strings both clients hash: what owns state names the replica.
std::string WeightsKey(absl::string_view name);          // "weights:<name>"
std::string AccumulatorKey(absl::string_view name);      // "acc:<name>"
std::string HeadKey(absl::string_view name);             // "head:<name>"
std::string RankKey(uint32_t rank);                      // "rank:<rank>" (stateless calls)

}  // namespace client
}  // namespace lossd

#endif  // LOSSD_CLIENT_RENDEZVOUS_H_
