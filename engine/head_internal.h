// SPDX-License-Identifier: Apache-2.0
// HeadStore's insides, shared by its files (heads.cc: the store, head_create.cc: create and
// import, head_step.cc: the barrier and the update, head_export.cc: export). Not for use
// outside engine/heads*.
#ifndef LOSSD_ENGINE_HEAD_INTERNAL_H_
#define LOSSD_ENGINE_HEAD_INTERNAL_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "engine/heads.h"

namespace lossd {

class HeadStore::Impl {
 public:
  Impl(Backend* backend, Executor* executor, Options options);
  ~Impl();

  // The named head, the caller's (PERMISSION_DENIED otherwise), NOT_FOUND naming it.
  absl::StatusOr<std::shared_ptr<Head>> Get(const std::string& name, const std::string& caller);
  static HeadSummary Summarize(Head& head);

  // Runs a completed barrier's phase on the executor, then answers every waiter.
  void LaunchPhase(std::shared_ptr<Head> head, StepCall call,
                   std::vector<std::function<void(absl::StatusOr<StepResult>)>> waiters);
  // The watchdog's round: barriers past the step timeout, parked Computes past their deadline.
  void Tick(absl::Time now);
  void Shutdown();

  Backend* const backend;
  Executor* const executor;
  const Options options;
  // Bytes of every head alive (named, being created, or dropped but still held by a call),
  // what --head_bytes limits; each head's deleter gives its bytes back.
  const std::shared_ptr<std::atomic<uint64_t>> held;
  mutable absl::Mutex mu;
  absl::flat_hash_map<std::string, std::shared_ptr<Head>> map ABSL_GUARDED_BY(mu);
  // Names being created (between BeginCreate and CommitCreate), so two creates of one name
  // do not both allocate.
  absl::flat_hash_map<std::string, int> creating ABSL_GUARDED_BY(mu);

 private:
  void WatchdogLoop();
  absl::Mutex watchdog_mu_;
  bool stop_ ABSL_GUARDED_BY(watchdog_mu_) = false;
  std::thread watchdog_;
};

// The fp32 buffer of tensor `t` of `head` (master or state; null if the head has none), and
// the compute copy's buffer for kCopyW / kCopyBias.
BackendBuffer* HeadBuffer(Head& head, HeadTensor t);
// Bytes a head of this spec holds: master, optimizer state, gradient sum, compute copy.
uint64_t HeadBytes(const HeadSpec& spec);
// The tensors an export of `head` holds, in order, with their byte sizes.
std::vector<std::pair<HeadTensor, uint64_t>> ExportTensors(const HeadSummary& head);
// "head 'name'" for messages.
std::string HeadWhat(const std::string& name);

// A group's step (engine/head_group_step.cc); a one-server head never calls these.
// A Step call's refusal where the group cannot serve it here: world_size < S, or a rank
// another member serves (FAILED_PRECONDITION naming that member).
absl::Status CheckGroupCall(const Head& head, const StepCall& call);
// The ranks this server's barrier waits for: all of them, or this member's share.
uint32_t RanksHere(const Head& head, uint32_t world_size);
// The members compare the step's arguments (FAILED_PRECONDITION naming both sets when they
// differ; nothing runs) and pool their counts: r.contributions and r.tokens become the
// group's, `poisoned` true when any member's sum is.
absl::Status AgreeAcrossGroup(Head& head, const StepCall& call, int64_t opt_step,
                              bool has_reduced, StepResult& r, bool& poisoned)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(head.grad->mu);
// Reduce-scatters the sum in place (once per step) and returns the group's gradient norm:
// each member's slice's squares, summed in member order.
absl::StatusOr<double> GroupGradNorm(Backend& b, Head& head)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(head.grad->mu);
// All-gathers the compute copy after each member updated its slice.
absl::Status GatherCopy(Head& head) ABSL_EXCLUSIVE_LOCKS_REQUIRED(head.grad->mu);

// A group's export (engine/head_group_export.cc).
// The whole master and state of `head` at its current version (`version`, where set, must be
// it), gathered from every member over a communicator of the export's own, so a failure
// never touches the head's. Reused while the version stays; takes head.grad->mu itself.
absl::StatusOr<std::shared_ptr<const GatheredHead>> GatherForExport(
    HeadStore::Impl& store, Head& head, std::optional<uint64_t> version);
// The tensors of this member's part of a group's head, in export order: (slice) fp32 each.
std::vector<std::pair<HeadTensor, uint64_t>> PartTensors(Head& head);

}  // namespace lossd

#endif  // LOSSD_ENGINE_HEAD_INTERNAL_H_
