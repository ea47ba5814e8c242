// SPDX-License-Identifier: Apache-2.0
#include "kernels/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kernels/cuda/ce_kernels.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_io.h"
#include "kernels/cuda/fused_loss.h"
#include "kernels/cuda/nccl_comm.h"
#include "kernels/cuda/optimizer.h"
#include "kernels/cuda/policy_sequence.h"
#include "kernels/cuda/row_loss_io.h"
#include "kernels/cuda/streamed_chunk_hooks.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "core/loss_problem_check.h"
#include "core/status_macros.h"
#include "kernels/optimizer.h"
#include "kernels/optimizer_check.h"

namespace lossd {
namespace cuda {
namespace {

// Device bytes one Compute allocates, and the part of them that is workspace (not a device
// copy of an input or an output).
struct DevicePlan {
  uint64_t total = 0;
  uint64_t extra = 0;
};

DevicePlan PlanDeviceBytes(const WorkspaceShape& s, const ChunkPlan& plan) {
  const uint64_t bt = static_cast<uint64_t>(s.bt), h = static_cast<uint64_t>(s.h),
                 v = static_cast<uint64_t>(s.v);
  const uint64_t elem = DTypeSize(s.dtype), g = DTypeSize(s.grad_dtype);
  DevicePlan d;
  d.total += Align(bt * h * elem);                       // x
  if (s.w_memory == Memory::kHost) {
    d.total += Align(v * h * elem);                      // w
    if (s.has_bias) d.total += Align(v * elem);          // bias
  }
  d.total += Align(bt * 4);                              // targets
  if (s.has_class_weights) d.total += Align(v * 4);
  if (s.has_grad_output) d.total += Align(bt * 4);
  d.total += 4 * Align(bt * 4) + Align(4);               // per-row statistics, flags
  if (s.want_dx) d.total += Align(bt * h * g);
  if (s.dw == GradOut::kAccumulated) {
    if (s.accum_memory == Memory::kHost) d.total += Align(v * h * 4);
  } else if (s.dw == GradOut::kWritten) {
    d.total += Align(v * h * 4);
    if (s.grad_dtype != DType::kF32) {
      d.total += Align(v * h * g);
      d.extra += Align(v * h * 4);  // the fp32 accumulator behind a 16-bit dW
    }
  }
  if (s.has_bias) {
    if (s.db == GradOut::kAccumulated) {
      if (s.accum_memory == Memory::kHost) d.total += Align(v * 4);
    } else if (s.db == GradOut::kWritten) {
      d.total += 2 * Align(v * 4);
    }
  }
  d.total += RowLossInputBytes(s);
  d.total += plan.workspace_bytes;
  d.extra += plan.workspace_bytes;
  return d;
}

// What this backend cannot do with a valid problem (core/loss_problem_check.h, which the
// engine ran): its kernels index rows, columns and classes with 32-bit integers.
absl::Status CheckIndexRange(const LossProblem& p) {
  if (p.bt > 0x7fffffff || p.v > 0x7fffffff || p.h > 0x7fffffff) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda: shape must have 0 <= bt, 0 < h, 0 < v, each below 2^31; got bt=", p.bt,
        " h=", p.h, " v=", p.v));
  }
  return absl::OkStatus();
}

}  // namespace

CudaBackend::CudaBackend(const CudaBackendOptions& options)
    : options_(options), counters_(std::make_shared<MemoryCounters>()) {}

CudaBackend::~CudaBackend() {
  absl::MutexLock lock(&mu_);
  fused_.reset();
  // Teardown errors have no caller to go to.
  cudaSetDevice(options_.device);
  // The allocation stream outlives a backend that was made (its buffers may outlive it and
  // free on it), but not one whose Create failed: no buffer exists yet.
  if (!created_ && alloc_stream_ != nullptr) cudaStreamDestroy(alloc_stream_);
  for (cudaEvent_t e : {x_start_, x_copied_, dx_done_}) {
    if (e != nullptr) cudaEventDestroy(e);
  }
  for (cudaStream_t st : {x_stream_, dx_stream_}) {
    if (st != nullptr) cudaStreamDestroy(st);
  }
}

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(
    const CudaBackendOptions& options) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (IsNoGpuError(e) || (e == cudaSuccess && count == 0)) {
    return absl::UnavailableError(absl::StrCat(
        "no GPU: cudaGetDeviceCount: ",
        e == cudaSuccess ? "no CUDA device" : cudaGetErrorString(e)));
  }
  LOSSD_CUDA_RETURN_IF_ERROR(e);
  if (options.device < 0 || options.device >= count) {
    return absl::InvalidArgumentError(absl::StrCat("cuda: device ", options.device,
                                                   " does not exist; there are ", count));
  }
  std::unique_ptr<CudaBackend> b(new CudaBackend(options));
  cudaDeviceProp prop;
  LOSSD_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, options.device));
  b->device_name_ = prop.name;
  LOSSD_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.device));
  // Freed memory stays in the device's pool for the next Compute (trimmed when an allocation
  // would fail), instead of going back to the driver at every synchronisation.
  cudaMemPool_t pool = nullptr;
  LOSSD_CUDA_RETURN_IF_ERROR(cudaDeviceGetDefaultMemPool(&pool, options.device));
  uint64_t keep = UINT64_MAX;
  LOSSD_CUDA_RETURN_IF_ERROR(
      cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  LOSSD_CUDA_RETURN_IF_ERROR(
      cudaStreamCreateWithFlags(&b->alloc_stream_, cudaStreamNonBlocking));
  absl::StatusOr<std::unique_ptr<FusedLoss>> fused = FusedLoss::Create(options.device);
  if (!fused.ok()) return fused.status();
  (*fused)->set_autotune(options.autotune_gemms);
  const DeviceTuning tuning = TuneForDevice(prop.name, prop.major, prop.minor, options.ref_exp);
  (*fused)->set_ref_exp(tuning.ref_exp);
  b->ref_exp_ = (*fused)->ref_exp();
  b->default_chunk_rows_ =
      options.default_chunk_rows > 0 ? options.default_chunk_rows : tuning.default_chunk_rows;
  b->tuning_reason_ = tuning.reason;
  absl::MutexLock lock(&b->mu_);
  b->fused_ = *std::move(fused);
  // Non-blocking: the copies must not wait for (or hold up) work on the legacy default stream.
  LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&b->x_stream_, cudaStreamNonBlocking));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&b->dx_stream_, cudaStreamNonBlocking));
  for (cudaEvent_t* e : {&b->x_start_, &b->x_copied_, &b->dx_done_}) {
    LOSSD_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  }
  b->created_ = true;
  return b;
}

BackendInfo CudaBackend::Info() {
  BackendInfo info;
  info.name = "cuda";
  info.device = device_name_;
  // The choice Create made (device_tuning.h), not a per-shape plan: the reference-exp path
  // takes the bf16 cross-entropy problems it covers, the row-chunk path the rest.
  info.compute_path = absl::StrCat(
      ref_exp_ ? "reference-exp for bf16 cross-entropy (row-chunk otherwise)" : "row-chunk",
      options_.chunk_budget_bytes != 0
          ? absl::StrCat(", chunks of a ", options_.chunk_budget_bytes >> 20, " MiB budget")
          : absl::StrCat(", ", default_chunk_rows_, "-row chunks"));
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaSetDevice(options_.device) == cudaSuccess &&
      cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
    info.memory_total_bytes = total_bytes;
    info.memory_used_bytes = total_bytes - free_bytes;
  } else {
    cudaGetLastError();  // a failed query is reported as zeros, not left pending
  }
  info.memory_peak_bytes = counters_->peak.load();
  info.memory_held_bytes = counters_->current.load();
  info.memory_budget_bytes = options_.memory_budget_bytes;
  info.healthy = healthy_.load();
  info.loss_kinds = LossKindBit(LossKind::kCrossEntropy) | LossKindBit(LossKind::kLogprob) |
                    LossKindBit(LossKind::kPolicy) | LossKindBit(LossKind::kDistill);
  const int32_t minor = options_.plugin_abi_minor;
  if (minor < 0 || minor >= 3) {
    info.loss_kinds |= kPolicySequenceBit | kPolicyIsRatioBit | kPolicyKlEstimatorBit |
                       kPolicyEntropyBit | kPolicyAggregationBit | kPolicyGpgBit |
                       kDistillWeightsBit;
  }
  if (minor < 0 || minor >= 4) info.loss_kinds |= kPolicyGeoMeanBit | kPolicyKlCovBit;
  if (minor < 0 || minor >= 5) info.loss_kinds |= kPolicyVespoBit;
  if (minor < 0 || minor >= 6) info.loss_kinds |= kPolicyCispoClampBit;
  return info;
}

CudaBackend::RefExpCounters CudaBackend::RefExpCounts() {
  absl::MutexLock lock(&mu_);
  RefExpCounters c;
  c.chunks = fused_->ref_exp_chunks();
  c.redone_rows = fused_->ref_exp_redone_rows();
  c.chunk_fallbacks = fused_->ref_exp_fallbacks();
  return c;
}

ChunkPlan CudaBackend::Plan(const WorkspaceShape& s) const {
  const uint64_t budget = options_.chunk_budget_bytes != 0
                              ? options_.chunk_budget_bytes
                              : DefaultChunkBudget(s.bt, s.v, s.dtype, kGemmWorkspaceBytes,
                                                   default_chunk_rows_);
  // A fresh dW (not an accumulator) lends its memory to the logits: no fp32 re-reads. Not
  // with rows still arriving: every whole-batch GEMM reads all of X.
  // The other loss kinds' row kernel takes contiguous rows only.
  if (options_.whole_batch && s.chunk_rows == 0 && s.dw == GradOut::kWritten &&
      !s.rows_streamed && s.kind == LossKind::kCrossEntropy) {
    ChunkPlan whole = PlanWhole(s.bt, s.h, s.v, s.dtype, s.want_dx, s.grad_dtype, budget);
    if (whole.blocks > 0) return whole;
  }
  // Distill holds the teacher's logits chunk beside the student's: half the budget each.
  const bool distill = s.kind == LossKind::kDistill;
  // The reference-exp path's buffers share the budget with the chunk (the default budget
  // grows by them, so it plans the same chunk rows). Problems whose options it does not cover
  // (a softcap, label smoothing: not in the shape) run the other path in that workspace.
  const bool ref_exp = ref_exp_ && RefExpPlannable(s);
  ChunkPlan plan =
      ref_exp ? PlanRefExpChunks(s.bt, s.h, s.v,
                                 options_.chunk_budget_bytes != 0
                                     ? options_.chunk_budget_bytes
                                     : DefaultRefExpBudget(s.bt, s.h, s.v,
                                                           kGemmWorkspaceBytes,
                                                           default_chunk_rows_),
                                 s.chunk_rows)
              : PlanChunks(s.bt, s.v, s.dtype, distill ? budget / 2 : budget, s.chunk_rows,
                           options_.schedule);
  if (distill) {
    plan.workspace_bytes +=
        Align(static_cast<uint64_t>(plan.chunk_rows) * s.v * DTypeSize(s.dtype));
  }
  if (options_.auto_schedule && s.dw == GradOut::kNone) {
    plan.schedule = Schedule::kRowHalves;  // no dW to overlap
  } else if (options_.auto_schedule) {
    // Short chunks re-read the fp32 dW often; the column halves hide part of that traffic
    // under the next chunk's logits GEMM. Long chunks gain more from the row halves' CE
    // overlap (bench/RESULTS.md: columns won at C = 1024, rows at C >= 2048).
    plan.schedule = plan.chunk_rows < 2048 && plan.chunk_rows < s.bt ? Schedule::kColumnHalves
                                                                      : Schedule::kRowHalves;
  }
  plan.side_sms = options_.side_sms;
  return plan;
}

uint64_t CudaBackend::WorkspaceBytes(const WorkspaceShape& shape) {
  return PlanDeviceBytes(shape, Plan(shape)).total;
}

absl::Status CudaBackend::Check(absl::Status s) {
  if (s.ok()) return s;
  if (absl::IsResourceExhausted(s) || absl::IsInvalidArgument(s) || absl::IsOutOfRange(s)) {
    // Not a device fault (a refused request, or out of memory), but a failed allocation or
    // launch leaves its error pending on this thread: cleared here, or the next request's
    // first cudaGetLastError would report it and fail a request that did nothing wrong.
    cudaGetLastError();
    if (absl::IsResourceExhausted(s)) {
      // Out of memory, perhaps outside the pool (a kernel loaded at its first launch, a
      // cuBLASLt workspace), which the pool may hold all of: give its unused memory back,
      // or the same request would fail the same way every time.
      cudaMemPool_t pool = nullptr;
      if (cudaDeviceGetDefaultMemPool(&pool, options_.device) == cudaSuccess) {
        cudaMemPoolTrimTo(pool, 0);
      }
      cudaGetLastError();
    }
    return s;
  }
  // Anything else may have come from a device fault: a sticky error shows on every call.
  const cudaError_t e = cudaDeviceSynchronize();
  if (IsStickyCudaError(e)) {
    healthy_ = false;
    return absl::InternalError(absl::StrCat(s.message(), "; the device is in a sticky error ",
                                            "state (", cudaGetErrorName(e), ")"));
  }
  cudaGetLastError();
  return s;
}

absl::Status CudaBackend::Unhealthy(absl::string_view call) const {
  return absl::UnavailableError(absl::StrCat(
      "cuda: ", call, " refused: the device hit a sticky error earlier; this backend can no "
      "longer serve (the process must restart)"));
}

absl::Status CudaBackend::Compute(const LossProblem& p, const LossOutputs& out,
                                  LossStats* stats) {
  absl::MutexLock lock(&mu_);
  if (!healthy_) return Unhealthy("Compute");
  return Check(ComputeLocked(p, out, stats));
}

absl::Status CudaBackend::OptimizerStep(const OptimizerParams& p, const OptimizerTensors& t) {
  LOSSD_RETURN_IF_ERROR(CheckOptimizerStep(p, t));
  if (t.n == 0) return absl::OkStatus();
  if (!healthy_) return Unhealthy("OptimizerStep");
  LOSSD_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  LOSSD_RETURN_IF_ERROR(Check(CudaStatus(LaunchOptimizerStep(p, t, cudaStreamLegacy),
                                         "LaunchOptimizerStep")));
  return Check(CudaStatus(cudaStreamSynchronize(cudaStreamLegacy),
                          "cudaStreamSynchronize(after the optimizer step)"));
}

absl::StatusOr<double> CudaBackend::SumOfSquares(const float* data, int64_t n) {
  LOSSD_RETURN_IF_ERROR(CheckSumOfSquares(data, n));
  if (n == 0) return 0.0;
  if (!healthy_) return Unhealthy("SumOfSquares");
  LOSSD_ASSIGN_OR_RETURN(std::unique_ptr<BackendBuffer> scratch,
                         AllocateDevice(kSumOfSquaresScratch * sizeof(double)));
  auto* partial = static_cast<double*>(scratch->data());
  LOSSD_RETURN_IF_ERROR(Check(CudaStatus(LaunchSumOfSquares(data, n, partial, cudaStreamLegacy),
                                         "LaunchSumOfSquares")));
  double sum = 0;
  // Synchronous on the legacy stream: the copy waits for both passes, and the scratch is
  // idle before it is freed.
  LOSSD_RETURN_IF_ERROR(Check(CudaStatus(
      cudaMemcpy(&sum, partial + kSumOfSquaresBlocks, sizeof(double), cudaMemcpyDeviceToHost),
      "cudaMemcpy(sum of squares to host)")));
  return sum;
}

absl::Status CudaBackend::CommAvailable() {
  if (!healthy_) return Unhealthy("CommAvailable");
  return NcclAvailable();
}

absl::StatusOr<std::string> CudaBackend::NewCommId() {
  if (!healthy_) return Unhealthy("NewCommId");
  return NcclNewCommId();
}

absl::StatusOr<std::unique_ptr<BackendComm>> CudaBackend::ConnectComm(const std::string& id,
                                                                      uint32_t size,
                                                                      uint32_t rank,
                                                                      int64_t timeout_ms) {
  if (!healthy_) return Unhealthy("ConnectComm");
  return NcclConnect(options_.device, id, size, rank, timeout_ms);
}

absl::Status CudaBackend::ComputeLocked(const LossProblem& p, const LossOutputs& out,
                                        LossStats* stats) {
  const auto t0 = std::chrono::steady_clock::now();
  LOSSD_DCHECK_VALID_PROBLEM(p, &out, "cuda backend");
  LOSSD_RETURN_IF_ERROR(CheckIndexRange(p));
  if (!RowLossKindComputed(p.kind)) {
    return absl::UnimplementedError(absl::StrCat("cuda: loss kind ", LossKindName(p.kind),
                                                 " is not computed by this backend"));
  }
  std::vector<int32_t> targets32;
  // Distill's targets only mark ignored rows (any other value counts; none: every row does).
  absl::StatusOr<TargetSummary> summary =
      p.kind == LossKind::kDistill
          ? DistillRows(p, &targets32)
          : SummarizeTargets(p.targets, p.target_dtype, p.bt, p.v, p.options.ignore_index,
                             p.class_weights, &targets32);
  if (!summary.ok()) return summary.status();
  const WorkspaceShape shape = ShapeOf(p, out);
  const ChunkPlan plan = Plan(shape);
  const DevicePlan bytes = PlanDeviceBytes(shape, plan);
  if (options_.memory_budget_bytes != 0 && bytes.total > options_.memory_budget_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cuda: this problem needs ", bytes.total, " device bytes; the budget is ",
        options_.memory_budget_bytes));
  }

  const int64_t bt = p.bt, h = p.h;
  const size_t elem = DTypeSize(p.dtype), gsize = DTypeSize(out.grad_dtype);
  cudaStream_t stream = fused_->stream();
  LOSSD_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));

  // The overlapped path's hooks, when p.rows is set, and the host vectors the results are
  // copied into: declared before `drain`, so that the host functions and copies queued for
  // them have run (the device drained) before they go.
  std::optional<StreamedChunkHooks> streamed;
  HostRows host(bt);
  // Every buffer lives until the end of this call. On an error path work may still be queued
  // on the fused loss's streams (and, overlapped, on the copy streams, host functions included):
  // wait for the device before the buffers go back to the pool (declared after `held`, so it
  // runs first).
  std::vector<std::unique_ptr<BackendBuffer>> held;
  struct DrainOnError {
    bool done = false;
    ~DrainOnError() {
      if (!done) cudaDeviceSynchronize();
    }
  } drain;
  CallBuffers buffers([this](uint64_t n) { return AllocateDevice(n); }, &held, stream);

  DeviceLossArgs a = MakeArgs(p, *summary);
  void* x_device = nullptr;  // (BT, H) input dtype; written by StreamedChunkHooks when overlapped
  LOSSD_RETURN_IF_ERROR(UploadInputs(buffers, p, targets32, &a, &x_device));
  LOSSD_RETURN_IF_ERROR(UploadRowLossInputs(buffers, p, targets32, &a));
  DeviceOutputs d_out;
  LOSSD_RETURN_IF_ERROR(AllocateOutputs(buffers, p, out, &a, &d_out));
  absl::StatusOr<void*> workspace = buffers.Alloc(plan.workspace_bytes);
  if (!workspace.ok()) return workspace.status();
  if (p.rows != nullptr) {
    StreamedChunkHooks::Streams s;
    s.main = stream;
    s.x = x_stream_;
    s.dx = dx_stream_;
    s.x_start = x_start_;
    s.x_copied = x_copied_;
    s.dx_done = dx_done_;
    streamed.emplace(p.rows, s, p.x, x_device, h * elem, out.dx, a.dx, h * gsize);
    a.hooks = &*streamed;
  }

  const int64_t tunings_before = fused_->tunings();
  // Policy at sequence level: a forward pass first, then this Enqueue runs as logprob with
  // the coefficients it gave, unless no gradient is wanted (policy_sequence.h).
  const bool sequence = PolicySequenceLevel(p);
  if (sequence) {
    LOSSD_RETURN_IF_ERROR(
        EnqueueSequenceForward(*fused_, buffers, p, targets32, plan, *workspace, &a));
  }
  if (!sequence || WantsGradient(a)) {
    LOSSD_RETURN_IF_ERROR(fused_->Enqueue(a, plan, *workspace));
  }
  const int64_t tunings = fused_->tunings() - tunings_before;

  // Results back to the host, on the same stream (into the vectors declared before `drain`).
  LOSSD_RETURN_IF_ERROR(
      DownloadResults(buffers, p, out, a, d_out, streamed.has_value(), &host));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  // main_ waited for every X copy, but the last dX copies and their host functions may trail.
  if (streamed.has_value()) LOSSD_RETURN_IF_ERROR(streamed->Finish());
  drain.done = true;  // everything the call queued has run

  if (p.kind == LossKind::kCrossEntropy) {
    WriteHostOutputs(p, out, *summary, targets32, host);
  } else {
    WriteRowLossOutputs(p, out, targets32, host);
  }
  if (stats != nullptr) {
    stats->compute_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    stats->peak_extra_bytes = bytes.extra;
    stats->chunk_rows = plan.chunk_rows;
    stats->gemm_tunings = tunings;
    stats->nonfinite = host.nonfinite;
  }
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace lossd
