// SPDX-License-Identifier: Apache-2.0
// A Compute's contribution to an accumulator: the micro-batch the engine added into it
// (ComputeOutcome.added_to), held by the call until the client is known to have heard the
// call's OK. A contribution whose call fails, or whose OK never reached the client, leaves
// the sum marked partial (Engine::MarkPartial): the client cannot tell whether its
// micro-batch counts, and a retry would add it twice. Never adds, and never touches gRPC.
//
// The shape is meant for every contribution a call makes to state that outlives it: a
// hosted head's step contribution (a Compute whose dW goes into the head's current step,
// undone on failure) is the same life, Added -> Settle -> Delivered or the destructor.
#ifndef LOSSD_ENGINE_ACCUMULATOR_CONTRIBUTION_H_
#define LOSSD_ENGINE_ACCUMULATOR_CONTRIBUTION_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "engine/accumulators.h"
#include "engine/engine.h"

namespace lossd {

class AccumulatorContribution {
 public:
  explicit AccumulatorContribution(Engine* engine) : engine_(engine) {}
  // A contribution settled OK but never Delivered (the call ended without the client
  // hearing its OK) is marked partial on the executor: the accumulator's lock may keep it
  // busy for a whole compute, and a destructor runs on a gRPC thread.
  ~AccumulatorContribution();
  AccumulatorContribution(const AccumulatorContribution&) = delete;
  AccumulatorContribution& operator=(const AccumulatorContribution&) = delete;

  // The engine added the call's micro-batch into `acc` (null: nothing was added), whose
  // reset count was `resets` then (ComputeOutcome.added_resets). Before Settle; any thread.
  void Added(std::shared_ptr<Accumulator> acc, uint64_t resets);

  // Decides the call's final status, once. `client_gone`: the call has been cancelled.
  // Nothing added: `s` as it is. OK but the client gone: CANCELLED (it can only see a
  // failure, so this is one). A failure after adding: the sum is marked partial now and the
  // message says so. An OK that stands is held until Delivered.
  absl::Status Settle(absl::Status s, bool client_gone);

  // After the call has ended: whether its OK status reached the client. Not delivered: the
  // sum is marked partial (on the executor), as for a failure.
  void Delivered(bool delivered);

 private:
  Engine* const engine_;
  absl::Mutex mu_;
  std::shared_ptr<Accumulator> added_to_ ABSL_GUARDED_BY(mu_);  // until settled or delivered
  uint64_t resets_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace lossd

#endif  // LOSSD_ENGINE_ACCUMULATOR_CONTRIBUTION_H_
