// The engine: validation -> admission -> backend. Turns a ComputeSpec into a checked plan,
// admits it by the memory budget, runs it on the executor and hands back plain results; holds
// the weight cache and the gradient accumulators. Knows nothing of gRPC or protobuf.
#ifndef LOSSD_SERVER_ENGINE_ENGINE_H_
#define LOSSD_SERVER_ENGINE_ENGINE_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "server/engine/accumulators.h"
#include "server/engine/compute_plan.h"
#include "server/engine/executor.h"
#include "server/engine/memory_budget.h"
#include "server/engine/weight_cache.h"

namespace lossd {

class Engine;

struct EngineOptions {
  std::string instance;                        // this server's identity, in every handle
  uint64_t memory_budget_bytes = 8ull << 30;   // requests' host buffers + backend workspace
  size_t max_queue = 64;                       // requests waiting for memory
  int executor_threads = 1;
  uint64_t weight_cache_bytes = 4ull << 30;
  uint64_t accumulator_bytes = 8ull << 30;
  size_t max_accumulators = 64;
  int64_t max_bt = 1 << 20;
  int64_t max_h = 1 << 16;
  int64_t max_v = 1 << 21;
  uint64_t max_request_bytes = 16ull << 30;
  bool check_finite = true;  // refuse NaN/Inf in X, W and bias
};

// A host byte buffer that is not zero-filled on allocation (it is overwritten in full).
using HostBuffer = std::unique_ptr<uint8_t[]>;
HostBuffer NewHostBuffer(uint64_t bytes);

struct ComputeOutcome {
  absl::Status status;
  float loss = 0, z_loss = 0, accuracy = 0;
  int64_t tokens = 0;
  uint64_t accumulated_micro_batches = 0;
  LossStats stats;
  double queue_seconds = 0;
  std::vector<HostBuffer> outputs;  // one per plan.outputs, same order
};

struct PendingWeights {
  std::shared_ptr<WeightEntry> entry;
  uint64_t reserved = 0;
  std::array<uint64_t, 2> received{};  // bytes of w, bias so far
  Engine* engine = nullptr;
  ~PendingWeights();  // gives the reservation back if never committed
};

struct GradientsSnapshot {
  int64_t v = 0, h = 0;
  bool has_bias = false;
  uint64_t micro_batches = 0;
  int64_t tokens = 0;
  HostBuffer dw;  // (V, H) fp32
  HostBuffer db;  // (V) fp32, or null
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
  void Run(std::shared_ptr<const ComputePlan> plan, std::shared_ptr<InputBuffers> inputs,
           std::function<void(ComputeOutcome)> done);

  // Weight uploads: Begin (validate + reserve + allocate), Write parts, Commit.
  absl::StatusOr<std::unique_ptr<PendingWeights>> BeginPutWeights(const TensorDesc& w,
                                                                  const TensorDesc& bias);
  absl::Status WriteWeights(PendingWeights& p, bool bias, uint64_t offset, const void* data,
                            uint64_t bytes);
  absl::StatusOr<std::string> CommitWeights(std::unique_ptr<PendingWeights> p);
  absl::Status DropWeights(const std::string& handle);

  // Copies an accumulator to the host (and zeroes it when `reset`), under its lock.
  absl::StatusOr<GradientsSnapshot> FetchGradients(const std::string& name, bool reset);
  absl::Status DropAccumulator(const std::string& name);

  // Runs `job` on the executor, after every compute submitted before it.
  void Submit(std::function<void()> job) { executor_.Submit(std::move(job)); }

  // Stops admitting; queued requests fail with UNAVAILABLE.
  void Drain();
  bool draining() const { return draining_.load(); }

  BackendInfo backend_info() { return backend_->Info(); }
  const EngineOptions& options() const { return options_; }
  WeightCache& weights() { return weights_; }
  AccumulatorStore& accumulators() { return accumulators_; }
  size_t executor_queued() const { return executor_.queued(); }

 private:
  friend struct PendingWeights;
  ComputeOutcome RunNow(const ComputePlan& plan, InputBuffers& in);

  std::unique_ptr<Backend> backend_;
  const EngineOptions options_;
  MemoryBudget budget_;
  WeightCache weights_;
  AccumulatorStore accumulators_;
  std::atomic<bool> draining_{false};
  Executor executor_;  // last: joined first, while everything above is alive
};

}  // namespace lossd

#endif  // LOSSD_SERVER_ENGINE_ENGINE_H_
