// SPDX-License-Identifier: Apache-2.0
// What one FetchGradients call holds while it streams: the checked range, its admission (the
// host copy of the range comes out of the memory budget, like a Compute's buffers, so
// fetches in parallel wait for memory instead of running the host out of it), the snapshot,
// and for a reset fetch the duty to put the sum back if the client never hears of it. The
// destructor gives everything back. Never touches gRPC and never writes to the wire.
//
// A hosted head's step (issue 22) reads the same way: a lease on the step's sum, taken on
// the executor, undone unless the client heard the OK (see AccumulatorContribution).
#ifndef LOSSD_ENGINE_FETCH_LEASE_H_
#define LOSSD_ENGINE_FETCH_LEASE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "engine/admission.h"
#include "engine/engine.h"

namespace lossd {

struct FetchRequest {
  std::string accumulator;
  std::string accumulator_instance;  // empty: any (Engine::CheckAccumulatorInstance)
  std::string principal;             // the caller (owner.h)
  bool reset = false;
  uint64_t begin = 0, end = 0;  // bytes of dW | db; (0, 0): all of it
};

class FetchLease {
 public:
  // Checks the request: the instance, the accumulator and its owner, the range (Engine::
  // CheckFetch), and that its host copy fits in the whole memory budget (RESOURCE_EXHAUSTED
  // naming the range and the way out). The errors of those checks, unchanged.
  static absl::StatusOr<std::unique_ptr<FetchLease>> Check(Engine* engine, FetchRequest request);

  // An OK reset fetch that was never Delivered has its reset undone on the executor.
  ~FetchLease();
  FetchLease(const FetchLease&) = delete;
  FetchLease& operator=(const FetchLease&) = delete;

  // Waits for the range's bytes in the memory budget (Admission::Request): `admitted` runs
  // once, OK when granted (possibly before Admit returns), else with the reason.
  absl::Status Admit(MemoryBudget::Callback admitted);
  // Withdraws the lease while it waits for memory (its callback answers CANCELLED).
  void Withdraw() { admission_.Withdraw(); }

  // Copies the range (and zeroes the sum of a reset fetch) under the accumulator's lock; on
  // the executor, after every Compute queued before it. The errors of Engine::FetchGradients.
  absl::Status TakeSnapshot();
  // The snapshot's counts and range (its bytes are data()'s one buffer); after TakeSnapshot.
  const GradientsSnapshot& snapshot() const { return snapshot_; }
  // The snapshot's bytes, shared with whatever sends them (slices that outlive a write).
  const std::shared_ptr<std::vector<HostBuffer>>& data() const { return data_; }

  // Decides the call's final status and passes it to `finish`, once, after giving the
  // memory back. OK but the client gone (`client_gone`): CANCELLED. A failure after a reset:
  // the sum is put back first (on the executor: after the computes queued before it; a copy
  // of a large dW blocks) and `finish` runs there, its message saying what became of the
  // sum. An OK reset keeps its data until Delivered says the client heard it.
  void Settle(absl::Status s, bool client_gone, std::function<void(absl::Status)> finish);

  // After the call has ended: whether its OK reached the client. Not delivered: the reset is
  // undone as for a failure (on the executor; the job owns what it needs).
  void Delivered(bool delivered);

  const std::string& accumulator() const { return request_.accumulator; }

 private:
  FetchLease(Engine* engine, FetchRequest request);
  // The bytes of a reset are held (not undone, not given up).
  bool holds_reset() const { return snapshot_.reset_of != nullptr && data_ != nullptr; }

  Engine* const engine_;
  FetchRequest request_;  // the range resolved by Check
  Admission admission_;
  GradientsSnapshot snapshot_;  // its data moved into data_
  std::shared_ptr<std::vector<HostBuffer>> data_;
};

}  // namespace lossd

#endif  // LOSSD_ENGINE_FETCH_LEASE_H_
