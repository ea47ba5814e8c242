// SPDX-License-Identifier: Apache-2.0
// Who may use server state (weight handles, accumulators): the principal that created it.
// A principal is an opaque string the service derives from the call's credential (a bearer
// token's index in the token file, or the verified mTLS identity); "" where none is checked.
// Only names the owner's kind in messages, never the principal itself.
#ifndef LOSSD_ENGINE_OWNER_H_
#define LOSSD_ENGINE_OWNER_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace lossd {

// State created without a principal (no auth) is anyone's, as before ownership existed;
// otherwise only its creator's.
inline bool OwnerAllows(absl::string_view owner, absl::string_view caller) {
  return owner.empty() || owner == caller;
}

// OK when OwnerAllows; else PERMISSION_DENIED "<what> belongs to another credential".
absl::Status CheckOwner(absl::string_view owner, absl::string_view caller,
                        absl::string_view what);

// Nanoseconds since the epoch, for last-use times (List, the idle TTL).
int64_t NowNs();

// One piece of a caller's state, as List reports it.
struct StateInfo {
  enum class Kind { kWeights, kAccumulator, kHead, kTicket };
  Kind kind = Kind::kWeights;
  std::string name;  // the weight handle, the accumulator's or head's name, or the ticket
  uint64_t bytes = 0;
  int64_t last_used_ns = 0;  // since the epoch: created, or last named by a call
  uint64_t micro_batches = 0;  // accumulators; heads: Computes added to the current step
  uint64_t version = 0;        // heads only: steps completed
};

}  // namespace lossd

#endif  // LOSSD_ENGINE_OWNER_H_
