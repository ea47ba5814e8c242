// SPDX-License-Identifier: Apache-2.0
// Named server-side fp32 gradient accumulators (dW, db) kept across the micro-batches of one
// optimizer step, so a trainer sends W once and fetches dW once per step. Never evicted: an
// accumulator holds accepted work, so a full store refuses new names instead.
#ifndef LOSSD_ENGINE_ACCUMULATORS_H_
#define LOSSD_ENGINE_ACCUMULATORS_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kernels/backend.h"
#include "engine/owner.h"

namespace lossd {

struct Accumulator {
  std::string name;
  int64_t v = 0;
  int64_t h = 0;
  bool has_bias = false;
  std::string owner;  // the principal that created it (owner.h); "" = anyone's
  // Set at creation and by every Compute and fetch naming it, for List and the idle TTL.
  std::atomic<int64_t> last_used_ns{0};
  std::unique_ptr<BackendBuffer> dw;  // (V, H) fp32, backend memory
  std::unique_ptr<BackendBuffer> db;  // (V) fp32, or null
  // Serialises updates and reads: micro-batches add in the order they reach the executor.
  absl::Mutex mu;
  uint64_t micro_batches ABSL_GUARDED_BY(mu) = 0;  // change it with SetMicroBatches
  // micro_batches, readable without mu: a Compute holds mu for its whole run, and List must
  // not wait on a gRPC thread for that.
  std::atomic<uint64_t> listed_micro_batches{0};
  int64_t tokens ABSL_GUARDED_BY(mu) = 0;
  bool poisoned ABSL_GUARDED_BY(mu) = false;  // a failed update may have left it partial
  // Bumped by every add and every fetch's snapshot: an undone reset (Engine::UndoReset) must
  // find nothing has happened to the sum since.
  uint64_t generation ABSL_GUARDED_BY(mu) = 0;
  uint64_t resets ABSL_GUARDED_BY(mu) = 0;  // reset fetches so far
  // Set when a micro-batch made the sum non-finite (an overflow, e.g. a huge grad_scale):
  // which one, when, and in what. Until a reset fetch or a drop, every Compute into the
  // accumulator and every fetch of it is refused (NonFiniteSumStatus).
  std::string nonfinite_by ABSL_GUARDED_BY(mu);
};

// Sets acc.micro_batches and its lock-free copy.
inline void SetMicroBatches(Accumulator& acc, uint64_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(acc.mu) {
  acc.micro_batches = n;
  acc.listed_micro_batches.store(n);
}

// Records that the micro-batch just counted (acc.micro_batches) left a NaN or Inf in the sum;
// `bits`: LossStats' NonFiniteBits. Keeps the first such micro-batch.
void MarkNonFinite(Accumulator& acc, uint32_t bits) ABSL_EXCLUSIVE_LOCKS_REQUIRED(acc.mu);
// OK while the sum is finite; else FAILED_PRECONDITION naming the accumulator, the
// micro-batch that overflowed and when, and the way out.
absl::Status NonFiniteSumStatus(const Accumulator& acc) ABSL_SHARED_LOCKS_REQUIRED(acc.mu);

class AccumulatorStore {
 public:
  AccumulatorStore(Backend* backend, uint64_t budget_bytes, size_t max_count);

  // Returns the named accumulator, creating a zeroed one owned by `caller` on first use.
  // PERMISSION_DENIED when another principal owns it (owner.h); INVALID_ARGUMENT when it
  // exists with another shape; RESOURCE_EXHAUSTED when a new one does not fit.
  absl::StatusOr<std::shared_ptr<Accumulator>> GetOrCreate(const std::string& name, int64_t v,
                                                           int64_t h, bool has_bias,
                                                           const std::string& caller = "");
  // GetOrCreate's refusals without creating anything: the Compute's plan asks before any of
  // its tensors are received. GetOrCreate asks again (another request may have come between).
  absl::Status Check(const std::string& name, int64_t v, int64_t h, bool has_bias,
                     const std::string& caller = "") const;
  // No owner check: the caller checks (CheckOwner) where a client names the accumulator.
  absl::StatusOr<std::shared_ptr<Accumulator>> Get(const std::string& name);
  // Forgets the name at once; the memory is freed, and its bytes come back to
  // --accumulator_bytes, when the last holder (a running Compute or fetch) lets go.
  // PERMISSION_DENIED, dropping nothing, when `caller` does not own it.
  absl::Status Drop(const std::string& name, const std::string& caller = "");
  // The accumulators `caller` owns (all of them for "": no auth), for List.
  std::vector<StateInfo> List(const std::string& caller) const;
  // Drops every accumulator last used before `before_ns`, whoever owns it; returns a line for
  // each, for the log.
  std::vector<std::string> DropIdle(int64_t before_ns);

  // Accumulators known by name (what --max_accumulators limits; dropped ones not included).
  size_t count() const;
  // Bytes of accumulator memory held now, what --accumulator_bytes limits: every named
  // accumulator's, plus those of dropped ones that running calls still hold.
  uint64_t bytes() const;

 private:
  absl::Status CheckLocked(const std::string& name, int64_t v, int64_t h, bool has_bias,
                           const std::string& caller) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Backend* const backend_;
  const uint64_t budget_;
  const size_t max_count_;
  // Bytes of every accumulator alive, named or dropped: added at creation (under mu_, so a
  // check and its add are one step), subtracted by the accumulator's deleter after its memory
  // is freed. Shared with the deleters, since a call may let go after the store is gone.
  const std::shared_ptr<std::atomic<uint64_t>> held_bytes_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Accumulator>> map_ ABSL_GUARDED_BY(mu_);
  uint64_t named_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // of the accumulators in map_
};

// Accumulator names: 1 to 128 characters of [A-Za-z0-9._:/-].
absl::Status ValidateAccumulatorName(const std::string& name, absl::string_view field);

}  // namespace lossd

#endif  // LOSSD_ENGINE_ACCUMULATORS_H_
