// SPDX-License-Identifier: Apache-2.0
#include "core/status_macros.h"
#include "kernels/cpu/cpu_backend.h"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "core/loss_problem_check.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_chunk.h"
#include "kernels/cpu/cpu_convert.h"
#include "kernels/cpu/cpu_kinds.h"
#include "kernels/cpu/cpu_task_pool.h"
#include "kernels/cpu/nonfinite_scan.h"
#include "kernels/cpu/optimizer_step.h"
#include "kernels/cpu/row_pass.h"
#include "kernels/host_memory.h"
#include "kernels/optimizer.h"
#include "kernels/optimizer_check.h"

namespace lossd {

// Bytes held (buffers from Allocate plus running workspaces) and their peak.
struct CpuMemoryCounter {
  std::atomic<int64_t> held{0};
  std::atomic<int64_t> peak{0};
  void Add(int64_t bytes) {
    const int64_t now = held.fetch_add(bytes) + bytes;
    int64_t p = peak.load();
    while (now > p && !peak.compare_exchange_weak(p, now)) {
    }
  }
};

namespace {

// ---------------------------------------------------------------------------------------------
// Memory.

class HostBuffer : public BackendBuffer {
 public:
  HostBuffer(void* data, size_t size, std::shared_ptr<CpuMemoryCounter> counter)
      : data_(data), size_(size), counter_(std::move(counter)) {}
  ~HostBuffer() override {
    std::free(data_);
    counter_->Add(-static_cast<int64_t>(size_));
  }
  void* data() override { return data_; }
  size_t size() const override { return size_; }

 private:
  void* data_;
  size_t size_;
  std::shared_ptr<CpuMemoryCounter> counter_;  // may outlive the backend
};

// ---------------------------------------------------------------------------------------------
// Info helpers.

std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, "model name")) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) {
        return std::string(absl::StripAsciiWhitespace(line.substr(colon + 1)));
      }
    }
  }
  return "unknown CPU";
}

// A "Name:   123 kB" field of /proc/meminfo in bytes; 0 when absent.
// CpuWorkspace plan shared by WorkspaceBytes and Compute.
struct Plan {
  int64_t chunk = 0;
  bool want_dx = false, want_dw = false, want_db = false, want_grad = false;
  bool w_copy = false, x_copy = false, dx_scratch = false, dw_scratch = false;
  bool db_scratch = false;
  uint64_t bytes = 0;
};

Plan MakePlan(const WorkspaceShape& s) {
  Plan pl;
  // Distillation holds two C x V fp32 chunks (the student's and the teacher's logits): the
  // default keeps both within the one chunk budget.
  const int64_t chunk_v = s.kind == LossKind::kDistill ? 2 * s.v : s.v;
  pl.chunk = CpuBackend::ChunkRows(s.bt, chunk_v, s.chunk_rows);
  pl.want_dx = s.want_dx;
  pl.want_dw = s.dw != GradOut::kNone;
  pl.want_db = s.has_bias && s.db != GradOut::kNone;
  pl.want_grad = pl.want_dx || pl.want_dw || pl.want_db;
  pl.w_copy = s.dtype != DType::kF32;
  pl.x_copy = s.dtype != DType::kF32;
  pl.dx_scratch = pl.want_dx && s.grad_dtype != DType::kF32;
  pl.dw_scratch = s.dw == GradOut::kWritten && s.grad_dtype != DType::kF32;
  pl.db_scratch = pl.want_db && s.db != GradOut::kAccumulated;
  const uint64_t c = pl.chunk, h = s.h, v = s.v, f = sizeof(float);
  pl.bytes = c * v * f;                     // the logits / G chunk
  if (pl.w_copy) pl.bytes += v * h * f;     // W in fp32
  if (pl.x_copy) pl.bytes += c * h * f;     // X_c in fp32
  if (pl.dx_scratch) pl.bytes += c * h * f;
  if (pl.dw_scratch) pl.bytes += v * h * f;
  pl.bytes += 3 * v * f;                    // bias, class weights, db in fp32
  pl.bytes += static_cast<uint64_t>(s.bt) * (sizeof(RowResult) + 2 * sizeof(double) + 8);
  pl.bytes += KindExtraBytes(s, pl.chunk);
  return pl;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// CpuBackend.

CpuBackend::CpuBackend(int threads)
    : threads_(std::max(1, threads)),
      device_(CpuModel()),
      // The container's memory limit where it is below the machine's: the store budgets
      // (service/store_budgets.h) are checked against this, so they hold inside a cgroup.
      host_memory_(ReadHostMemoryLimit()),
      memory_(std::make_shared<CpuMemoryCounter>()),
      pool_(std::make_unique<CpuTaskPool>(threads_)) {
  // Every sgemm runs single-threaded inside one of this backend's tasks (see the header).
  openblas_set_num_threads(1);
}

CpuBackend::~CpuBackend() = default;

int64_t CpuBackend::ChunkRows(const LossProblem& p) {
  return ChunkRows(p.bt, p.kind == LossKind::kDistill ? 2 * p.v : p.v, p.options.chunk_rows);
}

int64_t CpuBackend::ChunkRows(int64_t bt, int64_t v, int64_t chunk_rows) {
  int64_t c = chunk_rows;
  if (c <= 0) {
    c = static_cast<int64_t>(kDefaultChunkBytes / (static_cast<uint64_t>(std::max<int64_t>(v, 1)) *
                                                  sizeof(float)));
  }
  return std::max<int64_t>(1, std::min<int64_t>(c, std::max<int64_t>(bt, 1)));
}

BackendInfo CpuBackend::Info() {
  BackendInfo info;
  info.name = "cpu";
  info.device = device_;
  info.memory_total_bytes = host_memory_.limit_bytes();
  info.memory_used_bytes = host_memory_.ReadUsedBytes();
  info.memory_peak_bytes = static_cast<uint64_t>(std::max<int64_t>(0, memory_->peak.load()));
  info.memory_held_bytes = static_cast<uint64_t>(std::max<int64_t>(0, memory_->held.load()));
  info.healthy = true;
  info.loss_kinds = kCpuLossKinds;
  info.compute_path = "cpu";  // one path: OpenBLAS row chunks
  return info;
}

absl::StatusOr<std::unique_ptr<BackendBuffer>> CpuBackend::Allocate(size_t bytes) {
  const size_t rounded = (std::max<size_t>(bytes, 1) + 63) / 64 * 64;
  if (rounded < bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("cpu backend: cannot allocate ", bytes,
                                                     " bytes"));
  }
  void* data = std::aligned_alloc(64, rounded);
  if (data == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cpu backend: out of host memory allocating ", bytes, " bytes"));
  }
  memory_->Add(static_cast<int64_t>(bytes));
  return std::unique_ptr<BackendBuffer>(new HostBuffer(data, bytes, memory_));
}

namespace {
absl::Status CheckRange(const char* what, size_t size, size_t offset, size_t bytes) {
  if (offset > size || bytes > size - offset) {
    return absl::InvalidArgumentError(absl::StrCat("cpu backend: ", what, " of ", bytes,
                                                   " bytes at offset ", offset,
                                                   " overruns a buffer of ", size, " bytes"));
  }
  return absl::OkStatus();
}

absl::Status OutOfMemory(const char* what, uint64_t bytes) {
  return absl::ResourceExhaustedError(absl::StrCat("cpu backend: out of host memory for ",
                                                   what, " (", bytes, " bytes)"));
}

// Allocates what `plan` says and widens W and the bias to fp32; RESOURCE_EXHAUSTED names the
// first buffer that could not be had.
absl::Status AllocateWorkspace(CpuTaskPool& pool, const LossProblem& p, const LossOutputs& out,
                               const Plan& plan, CpuWorkspace* ws) {
  const int64_t h = p.h, v = p.v, chunk = plan.chunk;
  ws->wf = static_cast<const float*>(p.w);
  if (plan.w_copy) {
    if (!ws->w_copy.Allocate(v * h)) {
      return OutOfMemory("W in fp32", static_cast<uint64_t>(v) * h * 4);
    }
    ParallelWiden(pool, p.w, p.dtype, v * h, ws->w_copy.data());
    ws->wf = ws->w_copy.data();
  }
  if (p.bias != nullptr) {
    if (!ws->bias_f.Allocate(v)) return OutOfMemory("bias", static_cast<uint64_t>(v) * 4);
    WidenRange(p.bias, p.dtype, 0, v, ws->bias_f.data());
  }
  if (!ws->z_buf.Allocate(chunk * v)) {
    return OutOfMemory("the logits chunk", static_cast<uint64_t>(chunk) * v * 4);
  }
  if (plan.x_copy && !ws->x_copy.Allocate(chunk * h)) {
    return OutOfMemory("X chunk in fp32", static_cast<uint64_t>(chunk) * h * 4);
  }
  if (plan.dx_scratch && !ws->dx_scratch.Allocate(chunk * h)) {
    return OutOfMemory("dX chunk in fp32", static_cast<uint64_t>(chunk) * h * 4);
  }
  ws->dw_f = out.dw_accum;  // accumulate straight into the caller's fp32 buffer
  if (ws->dw_f == nullptr && out.dw != nullptr) {
    if (plan.dw_scratch) {
      if (!ws->dw_scratch.Allocate(v * h)) {
        return OutOfMemory("dW in fp32", static_cast<uint64_t>(v) * h * 4);
      }
      ws->dw_f = ws->dw_scratch.data();
    } else {
      ws->dw_f = static_cast<float*>(out.dw);
    }
  }
  ws->dw_overwrite = out.dw_accum == nullptr;
  ws->db_acc = out.db_accum;
  if (plan.db_scratch) {
    if (!ws->db_f.Allocate(v)) return OutOfMemory("db in fp32", static_cast<uint64_t>(v) * 4);
    std::fill(ws->db_f.data(), ws->db_f.data() + v, 0.0f);
    ws->db_acc = ws->db_f.data();
  }
  return absl::OkStatus();
}

// The row pass's constants for p; *max_cw is set to the class weights' largest magnitude
// (0 without weights), for the gradient's scale.
RowPassParams MakeRowPassParams(const LossProblem& p, const Plan& plan,
                                const float* bias_f,  // (V) fp32, or null
                                double* max_cw) {
  const LossOptions& o = p.options;
  RowPassParams rp;
  rp.v = p.v;
  rp.dtype = p.dtype;
  rp.cw = p.class_weights;
  rp.bias = bias_f;
  *max_cw = 0;
  for (int64_t j = 0; j < p.v && p.class_weights != nullptr; ++j) {
    rp.cw_sum += p.class_weights[j];
    *max_cw = std::max(*max_cw, std::abs(double{p.class_weights[j]}));
  }
  if (p.class_weights == nullptr) rp.cw_sum = static_cast<double>(p.v);
  rp.eps = o.label_smoothing;
  rp.zs = o.z_loss_scale;
  rp.cap = o.softcap;
  rp.token_scaling = o.token_scaling;
  rp.want_grad = plan.want_grad;
  return rp;
}

// The power of two the GEMMs' alpha carries instead of the stored G.
// The stored G would carry the whole scale (1/N for a mean over N tokens, the upstream
// gradient, the class weights' size), and in fp16 a mean over a few thousand tokens puts
// it among the subnormals, where it keeps a few bits. A power of two near that scale
// leaves the stored G for the GEMMs' alpha instead: exact, so bf16 and fp32 results keep
// their bits, and fp16 keeps its precision (as the CUDA backend does).
double GradAlpha(const LossProblem& p,
                 const std::vector<int64_t>& targets,  // (BT) -1 for an ignored row
                 double ce_scale, double max_cw) {
  const LossOptions& o = p.options;
  double max_scale = std::abs(ce_scale);
  if (o.reduction == Reduction::kNone) {
    max_scale = p.grad_output != nullptr ? 0.0 : 1.0;
    for (int64_t i = 0; i < p.bt && p.grad_output != nullptr; ++i) {
      if (targets[i] >= 0) max_scale = std::max(max_scale, std::abs(double{p.grad_output[i]}));
    }
  }
  // Within 2^[-100, 100], so it is a normal float.
  return std::clamp(PowerOfTwoAbove(max_scale) * ClassWeightScale(max_cw, o.z_loss_scale),
                    std::ldexp(1.0, -100), std::ldexp(1.0, 100));
}

// The per-row outputs, and the reductions over the non-ignored rows in row order.
void WriteRowOutputs(const LossProblem& p, const LossOutputs& out,
                     const std::vector<RowResult>& rows,   // (BT)
                     const std::vector<int64_t>& targets,  // (BT) -1 for an ignored row
                     int64_t tokens, double weight_sum) {
  const LossOptions& o = p.options;
  const bool none = o.reduction == Reduction::kNone;
  double ce_total = 0, z_total = 0;
  int64_t correct = 0;
  for (int64_t i = 0; i < p.bt; ++i) {
    const RowResult& r = rows[i];
    if (out.lse != nullptr) out.lse[i] = r.lse;
    if (out.predictions != nullptr) out.predictions[i] = r.argmax;
    if (targets[i] >= 0) {
      ce_total += r.ce;
      z_total += r.zl;
      if (r.argmax == targets[i]) ++correct;
    }
    if (none) {
      if (out.loss != nullptr) out.loss[i] = static_cast<float>(r.ce + r.zl);
      if (out.z_loss != nullptr) out.z_loss[i] = static_cast<float>(r.zl);
    }
  }
  if (!none) {
    double ce_loss = ce_total, z_loss = z_total;
    if (o.reduction == Reduction::kMean) {
      ce_loss = weight_sum != 0 ? ce_total / weight_sum : 0.0;
      z_loss = tokens != 0 ? z_total / static_cast<double>(tokens) : 0.0;
    }
    if (out.loss != nullptr) out.loss[0] = static_cast<float>(ce_loss + z_loss);
    if (out.z_loss != nullptr) out.z_loss[0] = static_cast<float>(z_loss);
  }
  if (out.accuracy != nullptr) {
    out.accuracy[0] =
        tokens != 0 ? static_cast<float>(static_cast<double>(correct) / tokens) : 0.0f;
  }
  if (out.tokens != nullptr) out.tokens[0] = tokens;
}

// Gradients in the gradient dtype. An empty batch never ran a chunk: write zeros.
void FinishGradients(CpuTaskPool& pool, const LossProblem& p, const LossOutputs& out,
                     const Plan& plan, CpuWorkspace& ws) {
  const int64_t h = p.h, v = p.v;
  if (p.bt == 0) {
    if (ws.dw_f != nullptr && ws.dw_overwrite) std::fill(ws.dw_f, ws.dw_f + v * h, 0.0f);
  }
  if (plan.dw_scratch) ParallelNarrow(pool, ws.dw_f, v * h, out.grad_dtype, out.dw);
  if (plan.db_scratch && out.db != nullptr) {
    NarrowRange(ws.db_f.data(), v, out.grad_dtype, out.db, 0);
  }
}

// Which written gradients hold a NaN or an Inf (kNonFiniteDx | kNonFiniteDw | kNonFiniteDb).
// After the fact: dW is added into an accumulator block by block, so a check before the add
// would need a scratch dW; reading the written outputs once costs less.
uint32_t NonFiniteGradients(CpuTaskPool& pool, const LossProblem& p, const LossOutputs& out) {
  const int64_t h = p.h, v = p.v;
  const bool dx_bad = ParallelAnyNonFinite(pool, out.dx, out.grad_dtype, p.bt * h);
  const bool dw_bad = out.dw_accum != nullptr
                          ? ParallelAnyNonFinite(pool, out.dw_accum, DType::kF32, v * h)
                          : ParallelAnyNonFinite(pool, out.dw, out.grad_dtype, v * h);
  const bool db_bad = out.db_accum != nullptr
                          ? AnyNonFinite(out.db_accum, DType::kF32, 0, v)
                          : out.db != nullptr && AnyNonFinite(out.db, out.grad_dtype, 0, v);
  return (dx_bad ? kNonFiniteDx : 0u) | (dw_bad ? kNonFiniteDw : 0u) |
         (db_bad ? kNonFiniteDb : 0u);
}

// The cross-entropy chunks and outputs (the gradients' narrowing aside), in `ws`.
absl::Status ComputeCrossEntropy(CpuTaskPool& pool, const LossProblem& p, const LossOutputs& out,
                                 const Plan& plan, CpuWorkspace& ws) {
  const int64_t bt = p.bt, chunk = plan.chunk;
  const LossOptions& o = p.options;
  // Targets (each in [0, V) or ignored: validated): the non-ignored count and the
  // class-weight sum (mean's denominators are needed before any gradient). -1 marks an
  // ignored row below.
  std::vector<int64_t> targets(bt);
  int64_t tokens = 0;
  double weight_sum = 0;
  for (int64_t i = 0; i < bt; ++i) {
    const int64_t t = LoadAsInt(p.targets, p.target_dtype, i);
    if (t == o.ignore_index) {
      targets[i] = -1;
      continue;
    }
    targets[i] = t;
    ++tokens;
    weight_sum += p.class_weights != nullptr ? p.class_weights[t] : 1.0;
  }
  double ce_scale = o.grad_scale, z_scale = o.grad_scale;
  if (o.reduction == Reduction::kMean) {
    ce_scale = weight_sum != 0 ? o.grad_scale / weight_sum : 0.0;
    z_scale = tokens != 0 ? o.grad_scale / static_cast<double>(tokens) : 0.0;
  }
  double max_cw = 0;  // the weights' largest magnitude, for the gradient's scale
  const RowPassParams rp =
      MakeRowPassParams(p, plan, p.bias != nullptr ? ws.bias_f.data() : nullptr, &max_cw);
  const double g_alpha = GradAlpha(p, targets, ce_scale, max_cw);

  std::vector<RowResult> rows(bt);
  const CpuChunkPass pass{p,       out,      pool,    ws,      rp,
                          targets, ce_scale, z_scale, g_alpha, rows,
                          plan.x_copy, plan.want_dx, plan.dx_scratch};
  for (int64_t c0 = 0; c0 < bt; c0 += chunk) {
    const int64_t rows_c = std::min(chunk, bt - c0);
    const float* xc = nullptr;
    LOSSD_RETURN_IF_ERROR(ChunkForward(pass, c0, rows_c, &xc));
    if (plan.want_grad) ChunkBackward(pass, c0, rows_c, xc);
  }
  WriteRowOutputs(p, out, rows, targets, tokens, weight_sum);
  return absl::OkStatus();
}
}  // namespace

absl::Status CpuBackend::CopyToBackend(BackendBuffer& dst, size_t offset, const void* src,
                                       size_t bytes) {
  LOSSD_RETURN_IF_ERROR(CheckRange("CopyToBackend", dst.size(), offset, bytes));
  if (bytes > 0) std::memcpy(static_cast<char*>(dst.data()) + offset, src, bytes);
  return absl::OkStatus();
}

absl::Status CpuBackend::CopyFromBackend(const BackendBuffer& src, size_t offset, void* dst,
                                         size_t bytes) {
  LOSSD_RETURN_IF_ERROR(CheckRange("CopyFromBackend", src.size(), offset, bytes));
  // data() is not const in the interface; reading through it does not modify the buffer.
  const char* from = static_cast<const char*>(const_cast<BackendBuffer&>(src).data());
  if (bytes > 0) std::memcpy(dst, from + offset, bytes);
  return absl::OkStatus();
}

absl::Status CpuBackend::Zero(BackendBuffer& buf) {
  if (buf.size() > 0) std::memset(buf.data(), 0, buf.size());
  return absl::OkStatus();
}

uint64_t CpuBackend::WorkspaceBytes(const WorkspaceShape& shape) {
  return MakePlan(shape).bytes;
}

absl::Status CpuBackend::Compute(const LossProblem& p, const LossOutputs& out,
                                 LossStats* stats) {
  const auto start = std::chrono::steady_clock::now();
  // What this backend computes at all: its own refusals first (INVALID_ARGUMENT, as the
  // interface asks of a backend), so a caller that skipped the validation still gets a status.
  LOSSD_RETURN_IF_ERROR(CheckKindProblem(p, out));
  // The engine validated the problem (core/loss_problem_check.h); debug builds check again.
  LOSSD_DCHECK_VALID_PROBLEM(p, &out, "cpu backend");
  const Plan plan = MakePlan(ShapeOf(p, out));
  CpuTaskPool& pool = *pool_;
  memory_->Add(static_cast<int64_t>(plan.bytes));
  struct Release {
    CpuMemoryCounter* counter;
    int64_t bytes;
    ~Release() { counter->Add(-bytes); }
  } release{memory_.get(), static_cast<int64_t>(plan.bytes)};

  CpuWorkspace ws;
  LOSSD_RETURN_IF_ERROR(AllocateWorkspace(pool, p, out, plan, &ws));
  if (p.kind == LossKind::kCrossEntropy) {
    LOSSD_RETURN_IF_ERROR(ComputeCrossEntropy(pool, p, out, plan, ws));
  } else {
    const KindPassSetup setup{pool, ws, plan.chunk, plan.x_copy, plan.want_dx, plan.dx_scratch,
                              plan.want_grad};
    LOSSD_RETURN_IF_ERROR(ComputeKind(p, out, setup));
  }
  FinishGradients(pool, p, out, plan, ws);
  if (stats != nullptr) {
    stats->nonfinite = NonFiniteGradients(pool, p, out);
    stats->compute_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    stats->peak_extra_bytes = plan.bytes;
    stats->chunk_rows = plan.chunk;
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::OptimizerStep(const OptimizerParams& p, const OptimizerTensors& t) {
  LOSSD_RETURN_IF_ERROR(CheckOptimizerStep(p, t));
  CpuOptimizerStep(p, t, pool_.get());
  return absl::OkStatus();
}

absl::StatusOr<double> CpuBackend::SumOfSquares(const float* data, int64_t n) {
  LOSSD_RETURN_IF_ERROR(CheckSumOfSquares(data, n));
  return CpuSumOfSquares(data, n, pool_.get());
}

std::unique_ptr<Backend> NewCpuBackend(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::thread::hardware_concurrency());
  return std::make_unique<CpuBackend>(std::max(1, threads));
}

}  // namespace lossd
