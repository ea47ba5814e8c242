// SPDX-License-Identifier: Apache-2.0
// Hosted heads: an LM head whose fp32 master weights, optimizer state and compute copy live on
// this server. Every data-parallel rank's Compute adds its dW/db into the head's current step
// (a gradient sum, idempotent by (rank, micro-batch)); Step is a barrier over the step's ranks
// that applies the summed gradient once (kernels/optimizer.h) and bumps the version. Knows
// nothing of gRPC or protobuf; never evicts a head (it holds a training run's state).
#ifndef LOSSD_ENGINE_HEADS_H_
#define LOSSD_ENGINE_HEADS_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/accumulators.h"
#include "engine/executor.h"
#include "engine/head_group.h"
#include "engine/host_buffer.h"
#include "engine/owner.h"
#include "engine/weight_cache.h"
#include "kernels/backend.h"
#include "kernels/optimizer.h"

namespace lossd {

// An optimizer as the trainer configured it, every default resolved (torch's).
struct HeadOptimizer {
  OptimizerKind kind = OptimizerKind::kAdamW;
  double lr = 1e-3;
  double weight_decay = 0.01;  // of W
  double bias_weight_decay = 0;
  double momentum = 0, dampening = 0;
  bool nesterov = false;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  bool amsgrad = false;
  // How many fp32 state tensors a parameter has: AdamW 2 (3 with amsgrad), SGD 1 with
  // momentum, else 0.
  int states() const;
  bool operator==(const HeadOptimizer& o) const;
};

// The tensors of a head, in the order of an export's concatenation (and an import's parts).
enum class HeadTensor : int {
  kMasterW = 0, kMasterBias, kExpAvgW, kExpAvgBias, kExpAvgSqW, kExpAvgSqBias,
  kMaxExpAvgSqW, kMaxExpAvgSqBias, kCopyW, kCopyBias, kCount
};
const char* HeadTensorName(HeadTensor t);  // "master_w", "exp_avg_bias", ...

// What CreateHead asks for (a new head, or an import of an exported or torch state).
struct HeadSpec {
  std::string name;
  int64_t v = 0, h = 0;
  bool has_bias = false;
  DType master_dtype = DType::kF32;  // as sent: fp32, or bf16/fp16 (the master is its upcast)
  DType compute_dtype = DType::kBF16;
  HeadOptimizer optimizer;
  uint64_t version = 0;
  int64_t optimizer_step = 0;
  bool with_state = false;  // the optimizer's state tensors are sent (else zero)
  // The server instance that wrote the export this spec imports, where this server imports
  // its own drain's export at start (--head_export_dir); "" otherwise. For messages only.
  std::string exported_by;
  // The members serving this head (engine/head_group.h); size() 1: this server alone.
  HeadGroup group;
};

// One parameter (W or the bias) of a head, all in backend memory.
struct HeadParam {
  int64_t n = 0;
  // The part of the parameter whose master and state this server holds and updates: all of
  // it for a one-server head, this member's slice HeadSliceOf(n, member, S) in a group
  // (ZeRO-1: the master and the moments per member fall S-fold).
  HeadSlice slice;
  std::unique_ptr<BackendBuffer> master;                  // (slice.n()) fp32
  std::array<std::unique_ptr<BackendBuffer>, 3> state;    // (slice.n()) fp32 each
};

// A group's whole master and optimizer state at one version, gathered from every member
// for an export (engine/head_group_export.cc), so each byte range of one export reads the
// same bytes without another collective. Host memory: 4 B a parameter per fp32 tensor.
struct GatheredHead {
  uint64_t version = 0;
  // By HeadTensor: the master and state tensors the head has, whole (the copy is not here:
  // every member holds it whole already).
  std::array<std::vector<float>, static_cast<int>(HeadTensor::kCount)> tensors;
};

// What an export holds: the whole head (a one-server head's, or a group's, gathered from
// every member), or only this member's ZeRO-1 part of a group's head: its slices of the
// master and the optimizer state, which is what a group member writes on drain.
enum class HeadExportScope { kWhole, kMemberPart };

struct StepResult {
  uint64_t version = 0;  // after the call
  double grad_norm = 0;
  bool finite = true;
  bool applied = false;
  float clip_coef = 1.0f;
  uint64_t contributions = 0;
  int64_t tokens = 0;
  double step_seconds = 0;
  // A retried call answered from the step already done (the result again, nothing run):
  // callers that count steps (metrics) skip it.
  bool replayed = false;
};

enum class StepPhase { kFull = 0, kReduce = 1, kApply = 2 };

// One rank's Step call.
struct StepCall {
  std::string head;
  uint64_t version = 0;
  uint32_t rank = 0;
  uint32_t world_size = 1;
  StepPhase phase = StepPhase::kFull;
  std::optional<double> lr;
  std::optional<float> clip_coef;
  std::optional<double> max_norm;
  bool skip = false;
  // The same step's arguments (what every rank of a barrier must agree on).
  bool SameArguments(const StepCall& o) const;
};

struct Head {
  std::string name;
  std::string owner;
  int64_t v = 0, h = 0;
  bool has_bias = false;
  DType dtype = DType::kBF16;  // the compute copy's
  HeadOptimizer optimizer;
  std::atomic<int64_t> last_used_ns{0};
  // The compute copy, as a weight entry so a Compute runs on it as on a weight handle. Its
  // buffers are rewritten by a step under grad->mu, which every Compute on the head holds for
  // its whole run: no Compute sees a half-updated W.
  std::shared_ptr<WeightEntry> copy;
  // The current step's gradient sum (not in the AccumulatorStore). Its mu also guards the
  // master, the state, the copy's bytes and `keys`.
  std::shared_ptr<Accumulator> grad;
  // A group's members and communicator (null for a one-server head); set before the head is
  // named. Once a collective failed the head is broken (below).
  HeadGroup group;
  std::shared_ptr<HeadComm> comm;
  // A group's step has reduce-scattered the sum in place: each member's slice of grad holds
  // that slice of the group's sum (a STEP_REDUCE did it; its STEP_APPLY must not again).
  bool reduced_in_place ABSL_GUARDED_BY(grad->mu) = false;
  HeadParam w, bias;  // bias.n == 0 without a bias
  // (rank, micro-batch) of every Compute added to the current step.
  absl::flat_hash_set<std::pair<uint32_t, uint64_t>> keys ABSL_GUARDED_BY(grad->mu);
  uint64_t bytes = 0;  // everything above, for the budget and List
  // The current step's non-ignored tokens, readable without grad->mu (which a Compute holds
  // for its whole run).
  std::atomic<int64_t> step_tokens{0};
  // The instance whose export this head was imported from at start, and the version then
  // (HeadSpec::exported_by); set before the head is named, never changed.
  std::string exported_by;
  uint64_t imported_version = 0;
  // Set when an update failed midway: the master may be half stepped, so the head refuses
  // every later Compute and Step (import its last export).
  std::atomic<bool> broken{false};
  // A group's export (engine/head_group_export.cc): export_mu lets one gather run at a
  // time on this member; `gathered` (under mu) is the last one, dropped when the version moves.
  absl::Mutex export_mu;

  // The step's bookkeeping: the version, the barrier, Computes waiting for the next version.
  absl::Mutex mu;
  uint64_t version ABSL_GUARDED_BY(mu) = 0;
  int64_t optimizer_step ABSL_GUARDED_BY(mu) = 0;
  // Set once the barrier of the current version has all its ranks: the sum is sealed, and a
  // Compute of this version is refused from then on.
  bool sealed ABSL_GUARDED_BY(mu) = false;
  struct Waiter {
    StepCall call;
    std::function<void(absl::StatusOr<StepResult>)> done;
  };
  struct Barrier {
    StepCall first;  // the arguments every rank must repeat
    absl::Time opened;
    std::map<uint32_t, std::function<void(absl::StatusOr<StepResult>)>> waiting;  // by rank
  };
  std::optional<Barrier> barrier ABSL_GUARDED_BY(mu);
  // Step calls of this version refused, with no rank waiting, because they disagree with
  // the step (another version or phase), by rank: the next rank to arrive with other
  // arguments is refused at once naming one (which is then forgotten), rather than waiting
  // out --head_step_timeout for a rank that did call. Forgotten too when that rank calls
  // again or the version moves.
  std::map<uint32_t, StepCall> disagreeing ABSL_GUARDED_BY(mu);
  // The current version's REDUCE result (before its APPLY), and the last completed step's
  // result with its call (a retried Step of it gets the same answer).
  std::optional<StepResult> reduced ABSL_GUARDED_BY(mu);
  std::optional<std::pair<StepCall, StepResult>> last ABSL_GUARDED_BY(mu);
  // Computes of version + 1 that arrived while this version's step was pending: run once the
  // update is done (ok), or failed with its reason (the step timed out or failed).
  struct Parked {
    uint64_t version;
    absl::Time deadline;
    std::function<void(absl::Status)> resume;
  };
  std::vector<Parked> parked ABSL_GUARDED_BY(mu);
  bool dropped ABSL_GUARDED_BY(mu) = false;
  std::shared_ptr<const GatheredHead> gathered ABSL_GUARDED_BY(mu);
};

// A head's description for Info, List and export headers.
struct HeadSummary {
  std::string name;
  int64_t v = 0, h = 0;
  bool has_bias = false;
  DType dtype = DType::kBF16;
  HeadOptimizer optimizer;
  uint64_t version = 0;
  int64_t optimizer_step = 0;
  uint64_t bytes = 0;
  uint64_t contributions = 0;
  int64_t tokens = 0;
  uint32_t ranks_waiting = 0;
  int64_t last_used_ns = 0;
  HeadGroup group;
};

class PendingHead;  // below

// Bytes of an export range, copied under the head's lock.
struct HeadExportRange {
  HeadSummary head;
  std::vector<std::pair<HeadTensor, uint64_t>> tensors;  // the concatenation: tensor, bytes
  uint64_t begin = 0, end = 0;
  HostBuffer data;  // end - begin bytes
};

// What BeginCreate found: a head to fill with parts, or the same head already here at the
// same version (an import repeated: the parts are read and dropped, nothing changes).
struct HeadCreation {
  std::unique_ptr<PendingHead> pending;
  std::optional<HeadSummary> existing;
};

class HeadStore {
 public:
  struct Options {
    std::string instance;          // this server's, for messages
    uint64_t budget_bytes = 16ull << 30;  // --head_bytes
    size_t max_heads = 64;
    int64_t max_v = 1 << 21, max_h = 1 << 16;  // as the engine's shape limits
    absl::Duration step_timeout = absl::Minutes(10);  // --head_step_timeout
    // Forms a head group's communicator (blocking until every member joined or it gave up);
    // unset, a create naming a group of more than one member is refused (FAILED_PRECONDITION).
    ConnectHeadGroupFn connect_group;
  };
  HeadStore(Backend* backend, Executor* executor, Options options);
  ~HeadStore();
  // Stops the watchdog (barrier timeouts, parked deadlines), which submits to the executor:
  // before the executor joins. Idempotent.
  void Shutdown();

  // The tensors CreateHead expects for `spec`, in order, with their byte sizes: the master
  // (in spec.master_dtype) always, the optimizer state with spec.with_state. Parts of each
  // fill it in byte order.
  static std::vector<std::pair<HeadTensor, uint64_t>> ImportTensors(const HeadSpec& spec);

  // Validates the spec (name, shape limits, dtypes, optimizer ranges), checks the owner, the
  // count and the budget (RESOURCE_EXHAUSTED naming the bytes), and allocates.
  absl::StatusOr<HeadCreation> BeginCreate(const HeadSpec& spec, const std::string& owner);
  // One part of tensor `t` at `offset` (whole elements, in order, finite). The master's part
  // is also cast into the compute copy.
  absl::Status WriteCreate(PendingHead& p, HeadTensor t, uint64_t offset, const void* data,
                           uint64_t bytes);
  // Every byte must have arrived (INVALID_ARGUMENT naming what is missing). Names the head.
  absl::StatusOr<HeadSummary> CommitCreate(std::unique_ptr<PendingHead> p);

  // A rank's Step. `done` is called once, on an executor or watchdog thread, or inline for an
  // immediate refusal. A call that disagrees with the step (version, phase, world_size, lr,
  // clip, skip) is refused together with every rank waiting at its barrier (FAILED_PRECONDITION
  // naming both argument sets); nothing runs, W and the step's sum are kept. A STEP_FULL or
  // STEP_APPLY of a step with no contributions is refused (FAILED_PRECONDITION): W never
  // moves on nothing (a skip still moves the version on).
  void Step(const StepCall& call, const std::string& caller,
            std::function<void(absl::StatusOr<StepResult>)> done);

  // The bytes [begin, end) of the head's export concatenation at `version` (unset: the
  // current one), (0, 0) = all. CheckExport resolves the range without copying (the caller
  // reserves its host bytes first); Export copies it under the head's lock.
  // A group's head: the whole export (kWhole) is a collective of the group: the first range
  // of a version on each member gathers every member's slices (it waits, up to the group's
  // timeout, for every member to be asked for the same version; a failure leaves the head
  // as it was). kMemberPart (only for a group's head): this member's slices alone, no
  // collective; its tensors are the master and the state, each (slice) fp32.
  absl::StatusOr<std::pair<uint64_t, uint64_t>> CheckExport(
      const std::string& name, std::optional<uint64_t> version, uint64_t begin, uint64_t end,
      const std::string& caller, HeadExportScope scope = HeadExportScope::kWhole);
  absl::StatusOr<HeadExportRange> Export(const std::string& name,
                                         std::optional<uint64_t> version, uint64_t begin,
                                         uint64_t end, const std::string& caller,
                                         HeadExportScope scope = HeadExportScope::kWhole);
  // The export header's HeadSpec: what CreateHead takes to import this head as it is now.
  static HeadSpec SpecOf(const HeadSummary& s);

  absl::StatusOr<HeadSummary> Info(const std::string& name, const std::string& caller);
  // OK when `named` (a request's head_instance, the field `field`) is empty or this server's
  // instance; else FAILED_PRECONDITION. Where head `name` is here, the caller's, imported at
  // start from the export that instance `named` wrote as it stopped, the message says the
  // head is here (imported at version N) and to call HeadInfo for this instance; else that
  // the head lives on another instance.
  absl::Status CheckInstance(const std::string& name, const std::string& named,
                             absl::string_view field, const std::string& caller);
  // Forgets the name; waiting Steps and parked Computes fail (NOT_FOUND: dropped).
  absl::Status Drop(const std::string& name, const std::string& caller);
  std::vector<StateInfo> List(const std::string& caller) const;
  // Every head's name and owner, whoever it belongs to: for the drain's export of every head
  // (--head_export_dir), which must import each for its owner again. Never for a caller.
  std::vector<std::pair<std::string, std::string>> Owners() const;
  std::vector<std::string> DropIdle(int64_t before_ns);
  size_t count() const;
  uint64_t bytes() const;

  // The Compute path (engine/plan.cc, run.cc). Get: NOT_FOUND / PERMISSION_DENIED.
  absl::StatusOr<std::shared_ptr<Head>> Get(const std::string& name, const std::string& caller);
  // Before a Compute on `head` at `version` is submitted: true = submit it now; false = it
  // waits for the pending step of version - 1 and `resume` is called when it may be
  // submitted (OK) or with why not (the step failed or timed out, the deadline passed, the
  // head was dropped). FAILED_PRECONDITION for an older version or one further ahead.
  absl::StatusOr<bool> AdmitCompute(Head& head, uint64_t version, absl::Time deadline,
                                    std::function<void(absl::Status)> resume);
  // At the Compute's run, under head.grad->mu: true = add its gradient and record the key;
  // false = the key is already in the step (compute, answer, add nothing).
  // FAILED_PRECONDITION when the version moved on or the step is sealed.
  absl::StatusOr<bool> CheckAtRun(Head& head, uint64_t version, uint32_t rank,
                                  uint64_t micro_batch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(head.grad->mu);

  class Impl;  // engine/head_internal.h

 private:
  std::unique_ptr<Impl> impl_;
};

// A head being created (BeginCreate to CommitCreate): the head, not yet named, with every
// byte of its memory allocated, and how much of each tensor has arrived. Destroyed
// uncommitted, it gives the memory and the name back.
class PendingHead {
 public:
  ~PendingHead();
  std::shared_ptr<Head> head;
  HeadSpec spec;
  HeadStore::Impl* store = nullptr;
  std::vector<std::pair<HeadTensor, uint64_t>> expected;  // ImportTensors(spec)
  std::vector<uint64_t> received;                         // bytes so far, per expected
};

// OK for a head that works; for a broken one (an update failed midway, or its group's
// collective failed) FAILED_PRECONDITION saying why where it is known and what to do: import
// its last export (a group's: into a new group).
absl::Status CheckNotBroken(const Head& head);

// Head names: as accumulator names, 1 to 128 characters of [A-Za-z0-9._:/-].
absl::Status ValidateHeadName(const std::string& name, absl::string_view field);

}  // namespace lossd

#endif  // LOSSD_ENGINE_HEADS_H_
