// SPDX-License-Identifier: Apache-2.0
// The engine: validation -> admission -> backend. Turns a ComputeSpec into a checked plan,
// admits it by the memory budget, runs it on the executor and hands back plain results; holds
// the weight cache and the gradient accumulators. Knows nothing of gRPC or protobuf.
#ifndef LOSSD_ENGINE_ENGINE_H_
#define LOSSD_ENGINE_ENGINE_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/backend.h"
#include "engine/accumulators.h"
#include "engine/compute_plan.h"
#include "engine/executor.h"
#include "engine/finite_check.h"
#include "engine/heads.h"
#include "engine/host_buffer.h"
#include "engine/memory_budget.h"
#include "engine/owner.h"
#include "engine/recent_keys.h"
#include "engine/streamed_rows.h"
#include "engine/tickets.h"
#include "engine/weight_cache.h"

namespace lossd {

class Engine;

struct EngineOptions {
  std::string instance;                        // this server's identity, in every handle
  uint64_t memory_budget_bytes = 8ull << 30;   // requests' host buffers + backend workspace
  size_t max_queue = 64;                       // requests waiting for memory
  int executor_threads = 1;
  uint64_t weight_cache_bytes = 4ull << 30;
  size_t max_weight_handles = 1024;
  uint64_t accumulator_bytes = 8ull << 30;
  size_t max_accumulators = 64;
  int64_t max_bt = 1 << 20;
  int64_t max_h = 1 << 16;
  int64_t max_v = 1 << 21;
  uint64_t max_request_bytes = 16ull << 30;
  bool check_finite = true;  // refuse NaN/Inf in X, W and bias
  uint64_t head_bytes = 16ull << 30;  // hosted heads' memory (--head_bytes)
  size_t max_heads = 64;
  absl::Duration head_step_timeout = absl::Minutes(10);  // a Step barrier's longest wait
  // Forms a head group's communicator (HeadStore::Options::connect_group); unset: this server
  // serves one-server heads only.
  ConnectHeadGroupFn head_connect_group;
  // Overlapped Computes: the longest the backend waits for the next rows of X (it holds the
  // device meanwhile) before the call fails with DEADLINE_EXCEEDED.
  absl::Duration overlap_stall = absl::Seconds(10);
  // Two-phase log-prob tickets (engine/tickets.h): --ticket_bytes, --max_tickets,
  // --ticket_max_ms; the clock their TTLs are read on (null: the system's; tests inject one).
  uint64_t ticket_bytes = 4ull << 30;
  size_t max_tickets = 256;
  int64_t ticket_max_ms = 10 * 60 * 1000;
  std::function<int64_t()> ticket_clock_ns;
};

// Points the LossOutputs field of `slot` at `ptr` (a buffer of that output's OutputDesc).
void BindOutput(OutputSlot slot, void* ptr, LossOutputs* out);

struct ComputeOutcome {
  absl::Status status;
  float loss = 0, z_loss = 0, accuracy = 0;
  float kl = 0, clip_fraction = 0;  // kPolicy's metrics
  int64_t tokens = 0;
  uint64_t accumulated_micro_batches = 0;
  uint64_t head_version = 0;  // a head's Compute: the version computed against
  bool head_added = false;    // and whether its gradient was added (false: a repeated key)
  std::string ticket;                // a forward that kept: its ticket, and when it expires
  int64_t ticket_expires_unix_ms = 0;
  // The accumulator this micro-batch was added into (null: none, or nothing added). A call
  // that fails after that (the client cancelled, went away, or sent a bad message once
  // computing had started) hands it to Engine::MarkPartial: the client cannot tell whether
  // its micro-batch counts, so the sum may not be trusted.
  std::shared_ptr<Accumulator> added_to;
  uint64_t added_resets = 0;  // added_to's reset count when it was added (MarkPartial)
  LossStats stats;
  double queue_seconds = 0;
  std::vector<HostBuffer> outputs;  // one per plan.outputs, same order
};

// An overlapped Compute (ComputeHeader.overlap): X is still arriving when the compute starts
// (the receiver reports rows to `rows`), and the outputs are made beforehand so that dX can
// be sent from its buffer while later chunks compute.
struct OverlapIo {
  std::shared_ptr<StreamedRows> rows;
  std::shared_ptr<std::vector<HostBuffer>> outputs;  // from Engine::NewOutputs(plan)
};

struct PendingWeights {
  std::shared_ptr<WeightEntry> entry;
  uint64_t reserved = 0;
  std::array<uint64_t, 2> received{};  // bytes of w, bias so far
  Engine* engine = nullptr;
  ~PendingWeights();  // gives the reservation back if never committed
};

// A copy of the bytes [begin, end) of an accumulator's concatenation dW (V, H) fp32 | db (V)
// fp32.
struct GradientsSnapshot {
  int64_t v = 0, h = 0;
  bool has_bias = false;
  uint64_t micro_batches = 0;
  int64_t tokens = 0;
  uint64_t begin = 0, end = 0;
  HostBuffer data;  // end - begin bytes
  // The accumulator this fetch reset (null: no reset), for Engine::UndoReset.
  std::shared_ptr<Accumulator> reset_of;
  uint64_t generation_after_reset = 0;
  uint64_t dw_bytes() const { return static_cast<uint64_t>(v) * h * 4; }
  uint64_t db_bytes() const { return has_bias ? static_cast<uint64_t>(v) * 4 : 0; }
};

// One weight upload striped over several streams (see WeightsHeader in the proto).
class StripedUpload {
 public:
  // Called once, with the handle or the reason the upload failed.
  using Waiter = std::function<void(absl::StatusOr<std::string>)>;
  const std::string& id() const { return id_; }
  // The upload's sizes, from its first stripe's header (validated when the upload began; a
  // later stripe's header joins only if it says the same). Fixed once the upload exists.
  uint64_t w_bytes() const {
    return static_cast<uint64_t>(w_.shape[0]) * static_cast<uint64_t>(w_.shape[1]) *
           DTypeSize(w_.dtype);
  }
  uint64_t bias_bytes() const {
    return bias_.present ? static_cast<uint64_t>(bias_.shape[0]) * DTypeSize(bias_.dtype) : 0;
  }
  // When any stripe last received a message (ns since the epoch), kept by the service: a
  // stripe that waits for its siblings is not idle while they still send.
  std::atomic<int64_t> activity_ns{0};

 private:
  friend class Engine;
  std::string id_;   // the client's upload_id, for messages
  std::string key_;  // owner and upload_id: the upload's key in the engine
  uint32_t stripes_ = 0;
  TensorDesc w_, bias_;
  absl::Mutex mu_;
  std::unique_ptr<PendingWeights> pending_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<uint64_t, uint64_t>> ranges_ ABSL_GUARDED_BY(mu_);
  uint32_t joined_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t finished_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t w_received_ ABSL_GUARDED_BY(mu_) = 0;
  bool bias_claimed_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<Waiter> waiters_ ABSL_GUARDED_BY(mu_);
};

class Engine {
 public:
  Engine(std::unique_ptr<Backend> backend, EngineOptions options);
  ~Engine();

  // Validates the spec: shapes, dtypes, options, limits, the weight handle and accumulator.
  // INVALID_ARGUMENT / NOT_FOUND / RESOURCE_EXHAUSTED with messages that name the field.
  absl::StatusOr<ComputePlan> Plan(const ComputeSpec& spec);

  // Admission by the memory budget (see MemoryBudget).
  MemoryBudget& budget() { return budget_; }

  // Checks the received data (target range, finiteness), runs the backend on the executor and
  // calls `done` there. `inputs` must hold plan.input_bytes for every slot sent inline.
  using InputBuffers = std::array<HostBuffer, static_cast<int>(InputSlot::kCount)>;
  // A request whose deadline has passed when its turn comes is not started
  // (DEADLINE_EXCEEDED). `inputs_checked_finite`: the caller has already run the
  // --check_finite test (CheckFiniteElements) on every float input it sent, so it is skipped.
  // `overlap.rows` set: every input but X is complete, X fills in while the compute runs
  // (its --check_finite test is the receiver's, part by part, before rows are reported), and
  // the results land in `overlap.outputs` (ComputeOutcome.outputs stays empty).
  // `cancelled` (may be empty) is asked when its turn comes: a call cancelled while queued
  // is not started either (CANCELLED), so nothing is added for it.
  void Run(std::shared_ptr<const ComputePlan> plan, std::shared_ptr<InputBuffers> inputs,
           std::function<void(ComputeOutcome)> done,
           absl::Time deadline = absl::InfiniteFuture(), bool inputs_checked_finite = false,
           OverlapIo overlap = {}, std::function<bool()> cancelled = nullptr);

  // After a call whose micro-batch was added into `acc` failed: the accumulator refuses
  // further use (FAILED_PRECONDITION, as after a failed update) until it is dropped, unless
  // a reset fetch has taken the sum since (`resets_at_add`: ComputeOutcome.added_resets).
  // Returns what to append to the call's error message.
  static std::string MarkPartial(Accumulator& acc, uint64_t resets_at_add);

  // Output buffers for `plan`, one per plan.outputs in order (not zero-filled).
  static std::vector<HostBuffer> NewOutputs(const ComputePlan& plan);

  // Weight uploads: Begin (validate + reserve + allocate), Write parts, Commit. The handle
  // belongs to `owner` (owner.h): only it may name, fetch with or drop it.
  absl::StatusOr<std::unique_ptr<PendingWeights>> BeginPutWeights(
      const TensorDesc& w, const TensorDesc& bias, const std::string& owner = "");
  absl::Status WriteWeights(PendingWeights& p, bool bias, uint64_t offset, const void* data,
                            uint64_t bytes);
  absl::StatusOr<std::string> CommitWeights(std::unique_ptr<PendingWeights> p);
  // PERMISSION_DENIED when `caller` does not own the handle (owner.h); so for the
  // accumulator calls below.
  absl::Status DropWeights(const std::string& handle, const std::string& caller = "");

  // Striped uploads. Join registers one stripe with its W byte range [begin, end) (and
  // whether it carries the bias); the first stripe creates the upload. WriteStripe copies a
  // part (the caller checks order within its range). FinishStripe records a complete stripe:
  // when every stripe is in, the weights are committed and every waiter gets the handle.
  // FailStripedUpload aborts the upload for all its stripes. An upload belongs to its
  // `owner` (the client: its bearer token, or its host without auth): the same upload_id
  // from another client is another upload, which can neither join nor abort this one.
  absl::StatusOr<std::shared_ptr<StripedUpload>> JoinStripedUpload(
      const std::string& owner, const std::string& upload_id, uint32_t stripes,
      const TensorDesc& w, const TensorDesc& bias, uint64_t begin, uint64_t end,
      bool carries_bias, const std::string& principal = "");
  absl::Status WriteStripe(StripedUpload& u, bool bias, uint64_t offset, const void* data,
                           uint64_t bytes);
  void FinishStripe(const std::shared_ptr<StripedUpload>& u, StripedUpload::Waiter done);
  void FailStripedUpload(const std::shared_ptr<StripedUpload>& u, const absl::Status& why);
  // The same for a stripe refused before it joined (a bad range, a mismatched header).
  void FailStripedUpload(const std::string& owner, const std::string& upload_id,
                         const absl::Status& why);

  // OK when `expected` (a request's accumulator_instance, named `field`) is empty or this
  // server's instance; else FAILED_PRECONDITION: accumulator `name` began on another server
  // instance (another replica, or this server before a restart), so adding to or reading the
  // one of that name here would be a second, partial sum.
  absl::Status CheckAccumulatorInstance(const std::string& expected, const std::string& name,
                                        absl::string_view field) const;

  // Checks a fetch of the bytes [begin, end) of an accumulator's dW | db (0, 0 = all of it;
  // `reset`: whole fetches only) and returns the range with (0, 0) resolved: the bytes the
  // fetch's host copy takes, which the caller reserves in the memory budget first.
  // INVALID_ARGUMENT / NOT_FOUND naming the accumulator and the range.
  absl::StatusOr<std::pair<uint64_t, uint64_t>> CheckFetch(const std::string& name, bool reset,
                                                           uint64_t begin, uint64_t end,
                                                           const std::string& caller = "");
  // Copies the bytes [begin, end) of an accumulator's dW | db to the host under its lock
  // (0, 0 = all of it), zeroing it afterwards when `reset` (whole fetches only).
  absl::StatusOr<GradientsSnapshot> FetchGradients(const std::string& name, bool reset,
                                                   uint64_t begin = 0, uint64_t end = 0,
                                                   const std::string& caller = "");
  // A reset fetch whose data did not reach the client (the server saw it cancel or go away
  // while the parts were sent): puts the snapshot `data` (all of dW | db) back into the
  // accumulator it reset, with its counts, so the step's sum is not lost. Where anything has
  // happened to the sum since (a Compute added, a fetch read it), the two cannot be told
  // apart any more and it is marked partial instead; a dropped one is left alone. Returns
  // what happened, for the call's error message.
  std::string UndoReset(const GradientsSnapshot& g, const uint8_t* data);
  absl::Status DropAccumulator(const std::string& name, const std::string& caller = "");

  // The weight handles, accumulators, heads and tickets `caller` owns (everything where no
  // auth is checked:
  // caller and owners all ""), with sizes and last use.
  std::vector<StateInfo> ListState(const std::string& caller) const;
  // Drops every weight handle and accumulator, whoever owns it, that no call has named for
  // `idle` (running calls keep what they hold); returns a line for each, for the log.
  std::vector<std::string> DropIdleState(absl::Duration idle);

  // Runs `job` on the executor, after every compute submitted before it.
  void Submit(std::function<void()> job) { executor_.Submit(std::move(job)); }

  // Stops admitting; queued requests fail with UNAVAILABLE.
  void Drain();
  bool draining() const { return draining_.load(); }

  BackendInfo backend_info() { return backend_->Info(); }
  // BackendInfo::loss_kinds, as read at construction (ServerFeatures, Plan).
  uint32_t loss_kinds() const { return loss_kinds_; }
  const EngineOptions& options() const { return options_; }
  WeightCache& weights() { return weights_; }
  AccumulatorStore& accumulators() { return accumulators_; }
  HeadStore& heads() { return *heads_; }
  TicketStore& tickets() { return tickets_; }
  size_t executor_queued() const { return executor_.queued(); }
  // A compute submitted now would start at once (nothing queued, a thread free).
  bool executor_idle() const { return executor_.idle(); }

 private:
  friend struct PendingWeights;
  ComputeOutcome RunNow(const ComputePlan& plan, InputBuffers& in, bool checked_finite,
                        const OverlapIo& overlap);
  // After a forward that keeps has computed: its ticket, from the request's X and targets
  // (moved out of `in`) and its weight (shared, or inline W copied into backend memory).
  absl::Status KeepTicket(const ComputePlan& plan, InputBuffers& in,
                          TicketStore::Reservation room, ComputeOutcome* r);
  // Checks one weight part (whole elements, inside its tensor, finite) and copies it to the
  // backend; shared by plain and striped uploads.
  absl::Status CopyWeightPart(const WeightEntry& e, bool bias, uint64_t offset,
                              const void* data, uint64_t bytes);

  std::unique_ptr<Backend> backend_;
  // From the backend's Info at construction: what Plan refuses (UNIMPLEMENTED) before any
  // tensor arrives, without asking the device on every request.
  std::string backend_name_;
  uint32_t loss_kinds_ = 0;
  const EngineOptions options_;
  MemoryBudget budget_;
  WeightCache weights_;
  AccumulatorStore accumulators_;
  mutable TicketStore tickets_;  // List (const) frees expired tickets first
  std::atomic<bool> draining_{false};
  absl::Mutex uploads_mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<StripedUpload>> uploads_
      ABSL_GUARDED_BY(uploads_mu_);
  // The ids of the last kEndedUploadsKept uploads that completed or were aborted, oldest
  // first: a stripe that arrives after its upload ended is refused instead of starting a
  // fresh upload under the same id (which would hold a reservation no one completes).
  static constexpr size_t kEndedUploadsKept = 4096;
  // At most this many chunks for a client's options.chunk_rows (the backends' own plans stay
  // far below it).
  static constexpr int64_t kMaxRequestedChunks = 4096;
  RecentKeys<bool> ended_ ABSL_GUARDED_BY(uploads_mu_){kEndedUploadsKept};
  // Made after the executor (it submits steps there); ~Engine stops its watchdog first, then
  // the executor (last) joins while every store is alive.
  std::unique_ptr<HeadStore> heads_;
  Executor executor_;  // last: joined first, while everything above is alive
};

}  // namespace lossd

#endif  // LOSSD_ENGINE_ENGINE_H_
