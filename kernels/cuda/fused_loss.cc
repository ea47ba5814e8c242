#include "kernels/cuda/fused_loss.h"

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/ce_kernels.h"
#include "kernels/cuda/cuda_status.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "core/status_macros.h"

namespace lossd {
namespace cuda {
namespace {

constexpr uint64_t kAlign = 256;

uint64_t RoundUp(uint64_t x, uint64_t m) { return (x + m - 1) / m * m; }

cudaDataType CudaType(DType t) {
  switch (t) {
    case DType::kBF16:
      return CUDA_R_16BF;
    case DType::kF16:
      return CUDA_R_16F;
    default:
      return CUDA_R_32F;
  }
}

// Largest power of two (up to 256) dividing the address: what cuBLASLt may assume of it.
uint32_t PointerAlignment(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t align = 256;
  while (align > 1 && a % align != 0) align >>= 1;
  return align;
}

const char* Offset(const void* base, int64_t elements, size_t elem_size) {
  return static_cast<const char*>(base) + elements * static_cast<int64_t>(elem_size);
}

// Whether the logits GEMMs add the bias (cuBLASLt's bias epilogue): there is one, and its slice
// at each of the `n` first columns is 16-byte aligned.
bool BiasInGemm(const void* bias, size_t elem, const int64_t* first_cols, int n) {
  if (bias == nullptr) return false;
  for (int i = 0; i < n; ++i) {
    if (PointerAlignment(Offset(bias, first_cols[i], elem)) < 16) return false;
  }
  return true;
}

// Frees whatever cuBLASLt descriptors were created, on every path out of Gemm.
struct LtDescriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~LtDescriptors() {
    if (pref != nullptr) cublasLtMatmulPreferenceDestroy(pref);
    if (d != nullptr) cublasLtMatrixLayoutDestroy(d);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (op != nullptr) cublasLtMatmulDescDestroy(op);
  }
};

}  // namespace

absl::StatusOr<TargetSummary> SummarizeTargets(const void* targets, DType target_dtype, int64_t bt,
                                               int64_t v, int64_t ignore_index,
                                               const float* class_weights,
                                               std::vector<int32_t>* targets32) {
  if (target_dtype != DType::kI32 && target_dtype != DType::kI64) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda: target_dtype must be int32 or int64; got ", DTypeName(target_dtype)));
  }
  if (bt > 0 && targets == nullptr) {
    return absl::InvalidArgumentError("cuda: targets must be non-null");
  }
  TargetSummary s;
  targets32->assign(bt, -1);
  for (int64_t i = 0; i < bt; ++i) {
    const int64_t t = LoadAsInt(targets, target_dtype, i);
    if (t == ignore_index) continue;
    if (t < 0 || t >= v) {
      return absl::InvalidArgumentError(absl::StrCat("cuda: targets[", i, "] = ", t,
                                                     " is outside [0, ", v,
                                                     ") and is not ignore_index ", ignore_index));
    }
    (*targets32)[i] = static_cast<int32_t>(t);
    ++s.tokens;
    s.weight_sum += class_weights != nullptr ? class_weights[t] : 1.0;
  }
  if (class_weights != nullptr) {
    for (int64_t j = 0; j < v; ++j) {
      s.class_weight_sum += class_weights[j];
      s.class_weight_max_abs =
          std::max(s.class_weight_max_abs, std::fabs(static_cast<double>(class_weights[j])));
    }
  } else {
    s.class_weight_sum = static_cast<double>(v);
  }
  return s;
}

uint64_t DefaultChunkBudget(int64_t bt, int64_t v, DType dtype, uint64_t gemm_workspace_bytes) {
  const uint64_t rows = static_cast<uint64_t>(std::clamp<int64_t>(bt, 1, kMinDefaultChunkRows));
  const uint64_t want = RoundUp(rows * static_cast<uint64_t>(std::max<int64_t>(v, 1)) *
                                    DTypeSize(dtype),
                                kAlign) +
                        2 * RoundUp(gemm_workspace_bytes, kAlign);
  return std::clamp(want, kDefaultChunkBudgetBytes, kMaxDefaultChunkBudgetBytes);
}

ChunkPlan PlanChunks(int64_t bt, int64_t v, DType dtype, uint64_t budget_bytes,
                     int64_t requested_rows, Schedule schedule, uint64_t gemm_workspace_bytes) {
  const uint64_t fixed = 2 * RoundUp(gemm_workspace_bytes, kAlign);
  const uint64_t row_bytes = static_cast<uint64_t>(std::max<int64_t>(v, 1)) * DTypeSize(dtype);
  int64_t c = 0;
  if (requested_rows > 0) {
    c = std::min<int64_t>(requested_rows, std::max<int64_t>(bt, 1));
  } else {
    const uint64_t avail = budget_bytes > fixed ? budget_bytes - fixed : 0;
    const int64_t cmax = std::max<int64_t>(1, static_cast<int64_t>(avail / row_bytes));
    if (cmax >= bt) {
      c = std::max<int64_t>(bt, 1);
    } else {
      const int64_t n = (bt + cmax - 1) / cmax;
      c = (bt + n - 1) / n;
      // A multiple of 64 keeps the GEMM tiles full; take it only where it still fits.
      const int64_t rounded = (c + 63) / 64 * 64;
      if (c > 64 && rounded <= cmax) c = rounded;
    }
  }
  ChunkPlan plan;
  plan.chunk_rows = c;
  plan.schedule = schedule;
  plan.gemm_workspace_bytes = RoundUp(gemm_workspace_bytes, kAlign);
  plan.workspace_bytes = RoundUp(static_cast<uint64_t>(c) * row_bytes, kAlign) + fixed;
  return plan;
}

GradScales ComputeGradScales(const LossOptions& o, const TargetSummary& s) {
  GradScales g;
  // The class weights multiply the stored gradient (cw_t (p - [j == t]), smoothing's cw_j):
  // their largest magnitude goes into the GEMMs' alpha with the rest, so that an fp16 G keeps
  // its precision whatever their scale. Weights normalised to sum to 1 over the vocabulary
  // (1e-6 each) had left G below fp16's smallest values (cuda_backend_test's
  // mean_tiny_weights_smooth case: dX and dW off by far more than fp16 rounding).
  const double cw = ClassWeightScale(s.class_weight_max_abs, o.z_loss_scale);
  if (o.reduction == Reduction::kNone) {
    // The per-row upstream gradient carries the scale; its largest magnitude, as a power of
    // two, leaves the stored gradient for the GEMMs' alpha too.
    const double scale = 1.0 / PowerOfTwoAbove(s.row_grad_max_abs);
    g.ce = g.z = static_cast<float>(scale / cw);
    g.alpha = static_cast<float>(cw / scale);
    return g;
  }
  double ce = o.grad_scale, z = o.grad_scale;
  if (o.reduction == Reduction::kMean) {
    ce = s.weight_sum != 0 ? o.grad_scale / s.weight_sum : 0.0;
    z = s.tokens != 0 ? o.grad_scale / static_cast<double>(s.tokens) : 0.0;
  }
  const double alpha = ((ce != 0 && std::isfinite(ce)) ? ce : 1.0) * cw;
  g.alpha = static_cast<float>(alpha);
  g.ce = static_cast<float>(ce / alpha);
  g.z = static_cast<float>(z / alpha);
  return g;
}

namespace {

// The cross-entropy parameters of rows [r0, r0 + n) of a problem; the caller says where the
// logits are (logits, or the blocked layout's segments).
CrossEntropyParams RowParams(const DeviceLossArgs& a, const GradScales& scales, bool write_grad,
                             int64_t r0, int64_t n) {
  CrossEntropyParams p{};
  p.elem = static_cast<int32_t>(a.dtype);
  p.rows = n;
  p.v = a.v;
  p.bias = a.bias;
  p.targets = a.targets + r0;
  p.class_weights = a.class_weights;
  p.row_scale = a.options.reduction == Reduction::kNone && a.row_grad != nullptr
                    ? a.row_grad + r0
                    : nullptr;
  p.ce_scale = scales.ce;
  p.z_scale = scales.z;
  p.label_smoothing = a.options.label_smoothing;
  p.z_loss_scale = a.options.z_loss_scale;
  p.token_scaling = a.options.token_scaling ? 1 : 0;
  p.softcap = a.options.softcap;
  p.class_weight_sum = static_cast<float>(a.summary.class_weight_sum);
  p.write_grad = write_grad ? 1 : 0;
  p.row_lse = a.row_lse + r0;
  p.row_ce = a.row_ce + r0;
  p.row_z = a.row_z + r0;
  p.row_pred = a.row_pred + r0;
  return p;
}

}  // namespace

int64_t RowSplit(int64_t rows) { return rows >= 512 ? (rows / 2 + 63) / 64 * 64 : rows; }

VocabBlock WholeBlock(const ChunkPlan& plan, int64_t v, int b) {
  const int64_t first = v - (plan.blocks - 1) * plan.block_cols;
  VocabBlock block;
  block.col0 = b == 0 ? 0 : first + (b - 1) * plan.block_cols;
  block.cols = b == 0 ? first : plan.block_cols;
  return block;
}

ChunkPlan PlanWhole(int64_t bt, int64_t h, int64_t v, DType dtype, bool want_dx, DType dx_dtype,
                    uint64_t budget_bytes, uint64_t gemm_workspace_bytes) {
  ChunkPlan plan;  // blocks == 0: the layout does not apply
  const uint64_t elem = DTypeSize(dtype);
  if (bt <= 0 || h <= 0 || v <= 0 || h % 64 != 0 ||
      static_cast<uint64_t>(bt) * elem > 4 * static_cast<uint64_t>(h)) {
    return plan;
  }
  const uint64_t gws = RoundUp(gemm_workspace_bytes, kAlign);
  const uint64_t dx_acc =
      want_dx && dx_dtype != DType::kF32 ? RoundUp(static_cast<uint64_t>(bt) * h * 4, kAlign) : 0;
  const uint64_t fixed = 2 * gws + dx_acc + kAlign;
  if (budget_bytes <= fixed) return plan;
  const int64_t max_cols =
      static_cast<int64_t>((budget_bytes - fixed) / (static_cast<uint64_t>(bt) * elem)) / 64 * 64;
  if (max_cols < 64) return plan;
  const int64_t n0 = (v + max_cols - 1) / max_cols;
  // Equal blocks of a multiple of 64 columns where they can be; block 0 takes the rest.
  const int64_t nb = std::min<int64_t>(max_cols, ((v + n0 - 1) / n0 + 63) / 64 * 64);
  const int64_t n = (v + nb - 1) / nb;
  if (n > kMaxSegments) return plan;
  plan.chunk_rows = bt;
  plan.blocks = static_cast<int32_t>(n);
  plan.block_cols = nb;
  plan.gemm_workspace_bytes = gws;
  plan.workspace_bytes = RoundUp(static_cast<uint64_t>(bt) * nb * elem, kAlign) + dx_acc + 2 * gws;
  return plan;
}

absl::StatusOr<std::unique_ptr<FusedLoss>> FusedLoss::Create(int device) {
  std::unique_ptr<FusedLoss> f(new FusedLoss());
  f->device_ = device;
  LOSSD_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&f->main_, cudaStreamNonBlocking));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&f->ce_, cudaStreamNonBlocking));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&f->side_, cudaStreamNonBlocking));
  for (cudaEvent_t* e :
       {&f->start_, &f->logits_done_[0], &f->logits_done_[1], &f->ce_done_[0], &f->ce_done_[1],
        &f->dw_done_[0], &f->dw_done_[1], &f->ce_end_, &f->side_end_, &f->dx_last_}) {
    LOSSD_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  }
  LOSSD_CUBLAS_RETURN_IF_ERROR(cublasLtCreate(&f->lt_));
  LOSSD_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&f->sm_count_, cudaDevAttrMultiProcessorCount, device));
  return f;
}

FusedLoss::~FusedLoss() {
  // Teardown errors have no caller to go to; the device is left as it is.
  cudaSetDevice(device_);
  if (lt_ != nullptr) cublasLtDestroy(lt_);
  for (cudaEvent_t e : {start_, logits_done_[0], logits_done_[1], ce_done_[0], ce_done_[1],
                        dw_done_[0], dw_done_[1], ce_end_, side_end_, dx_last_}) {
    if (e != nullptr) cudaEventDestroy(e);
  }
  if (side_ != nullptr) cudaStreamDestroy(side_);
  if (ce_ != nullptr) cudaStreamDestroy(ce_);
  if (main_ != nullptr) cudaStreamDestroy(main_);
}

struct FusedLoss::Spec {
  bool trans_a, trans_b;
  int64_t m, n, k;
  const void* a;
  int64_t lda;
  const void* b;
  int64_t ldb;
  cudaDataType ab_type;
  float beta;
  void* d;
  int64_t ldd;
  cudaDataType d_type;
  uint64_t ws_bytes;
  int32_t sm_target;
  // Non-null: cuBLASLt's bias epilogue adds bias[i] to row i of D (m values, D's type) before D
  // is rounded to its type, so the stored logits are X W^T + b rounded once, as DESIGN.md says.
  const void* bias;
};

namespace {

// The cuBLASLt descriptors and preference of one GEMM (fp32 compute, D = alpha op(A) op(B) +
// beta D), with the pointers' alignments told to the heuristic.
template <typename SpecT>
absl::Status Describe(const SpecT& g, LtDescriptors* desc) {
  LOSSD_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescCreate(&desc->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_a = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  LOSSD_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulDescSetAttribute(desc->op, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  LOSSD_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulDescSetAttribute(desc->op, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  if (g.sm_target > 0) {
    LOSSD_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(
        desc->op, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &g.sm_target, sizeof(g.sm_target)));
  }
  if (g.bias != nullptr) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    LOSSD_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(
        desc->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
    LOSSD_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(
        desc->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias, sizeof(g.bias)));
  }
  LOSSD_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(
      &desc->a, g.ab_type, g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, g.lda));
  LOSSD_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(
      &desc->b, g.ab_type, g.trans_b ? g.n : g.k, g.trans_b ? g.k : g.n, g.ldb));
  LOSSD_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&desc->d, g.d_type, g.m, g.n, g.ldd));
  const uint32_t align_a = PointerAlignment(g.a), align_b = PointerAlignment(g.b),
                 align_d = PointerAlignment(g.d);
  LOSSD_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceCreate(&desc->pref));
  LOSSD_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(
      desc->pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &g.ws_bytes, sizeof(g.ws_bytes)));
  // Split-K parts are added through the workspace, in fp32 (the compute type) or, for an
  // fp32 D, in D's type, which is the same. Parts in a 16-bit D's type would round every part,
  // against the fp32 accumulation the numerics promise; parts added in place in D are ordered
  // by counters whose order this code does not control. Both are kept out, for every GEMM
  // and also where nothing is tuned.
  const uint32_t schemes =
      CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE |
      (g.d_type == CUDA_R_32F ? CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE : 0);
  LOSSD_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(
      desc->pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes, sizeof(schemes)));
  LOSSD_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(
      desc->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof(align_a)));
  LOSSD_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(
      desc->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof(align_b)));
  LOSSD_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(
      desc->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_d, sizeof(align_d)));
  LOSSD_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(
      desc->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d, sizeof(align_d)));
  return absl::OkStatus();
}

// Candidate `rank` (0 = the first choice) of cuBLASLt's heuristic for the described GEMM.
absl::Status HeuristicAlgo(cublasLtHandle_t lt, const LtDescriptors& desc, int64_t m, int64_t n,
                           int64_t k, int32_t rank, cublasLtMatmulAlgo_t* algo) {
  const int wanted = std::max(rank, 0) + 1;
  std::vector<cublasLtMatmulHeuristicResult_t> results(wanted);
  int found = 0;
  LOSSD_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulAlgoGetHeuristic(
      lt, desc.op, desc.a, desc.b, desc.d, desc.d, desc.pref, wanted, results.data(), &found));
  if (found == 0) {
    return absl::InternalError(absl::StrCat("cublasLtMatmulAlgoGetHeuristic: no algorithm for m=",
                                            m, " n=", n, " k=", k));
  }
  if (found < wanted) {
    return absl::NotFoundError(absl::StrCat("cublasLtMatmulAlgoGetHeuristic: ", found,
                                            " algorithms for m=", m, " n=", n, " k=", k,
                                            ", no rank ", rank));
  }
  *algo = results[wanted - 1].algo;
  return absl::OkStatus();
}

// Whether cuBLASLt runs `algo` (chosen for another problem of the same tuning class) on this
// exact problem within `ws_bytes` of workspace.
bool Accepts(cublasLtHandle_t lt, const LtDescriptors& desc, const cublasLtMatmulAlgo_t& algo,
             uint64_t ws_bytes) {
  cublasLtMatmulHeuristicResult_t r{};
  return cublasLtMatmulAlgoCheck(lt, desc.op, desc.a, desc.b, desc.d, desc.d, &algo, &r) ==
             CUBLAS_STATUS_SUCCESS &&
         r.workspaceSize <= ws_bytes;
}

// Destroys the timing events on every path out of TuneGemm.
struct EventPair {
  cudaEvent_t start = nullptr, stop = nullptr;
  ~EventPair() {
    if (start != nullptr) cudaEventDestroy(start);
    if (stop != nullptr) cudaEventDestroy(stop);
  }
};

}  // namespace

FusedLoss::AlgoKey FusedLoss::KeyOf(const Spec& g, int32_t rank) {
  return AlgoKey{g.trans_a,
                 g.trans_b,
                 static_cast<int>(g.ab_type),
                 static_cast<int>(g.d_type),
                 g.m,
                 g.n,
                 g.k,
                 g.lda,
                 g.ldb,
                 g.ldd,
                 static_cast<int>(PointerAlignment(g.a)),
                 static_cast<int>(PointerAlignment(g.b)),
                 static_cast<int>(PointerAlignment(g.d)) | (g.beta != 0) << 16 |
                     (g.bias != nullptr) << 17,
                 g.ws_bytes,
                 g.sm_target,
                 rank};
}

int64_t TuneClass(int64_t x) {
  if (x <= 64) return x;
  int64_t octave = 64;
  while (octave <= x / 2) octave *= 2;  // the power of two at or below x
  const int64_t step = octave / 8;
  return (x + step - 1) / step * step;
}

FusedLoss::AlgoKey FusedLoss::ClassOf(const Spec& g) {
  Spec c = g;
  c.m = TuneClass(g.m);
  c.n = TuneClass(g.n);
  c.k = TuneClass(g.k);
  return KeyOf(c, 0);
}

absl::Status FusedLoss::Gemm(cudaStream_t stream, void* ws, uint64_t ws_bytes, bool trans_a,
                             bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                             const void* a, int64_t lda, const void* b, int64_t ldb,
                             cudaDataType ab_type, float beta, void* d, int64_t ldd,
                             cudaDataType d_type, int32_t sm_target, int32_t algo_rank,
                             const void* bias) {
  return RunSpec(stream, ws, alpha,
                 Spec{trans_a, trans_b, m, n, k, a, lda, b, ldb, ab_type, beta, d, ldd, d_type,
                      ws_bytes, sm_target, bias},
                 algo_rank);
}

absl::Status FusedLoss::RunSpec(cudaStream_t stream, void* ws, float alpha, const Spec& g,
                                int32_t algo_rank) {
  LtDescriptors desc;
  LOSSD_RETURN_IF_ERROR(Describe(g, &desc));
  const AlgoKey key = KeyOf(g, algo_rank);
  cublasLtMatmulAlgo_t algo;
  auto it = algos_.find(key);
  if (it != algos_.end()) {
    algo = it->second;
  } else {
    // A new exact problem: its class's tuned choice where cuBLASLt takes it for this problem,
    // else the heuristic's. Both are the same on every call, so a problem that finds no room
    // in algos_ still runs the same algorithm each time.
    bool have = false;
    if (algo_rank == 0 && autotune_) {
      auto t = tuned_.find(ClassOf(g));
      have = t != tuned_.end() && Accepts(lt_, desc, t->second, g.ws_bytes);
      if (have) algo = t->second;
    }
    if (!have) {
      LOSSD_RETURN_IF_ERROR(HeuristicAlgo(lt_, desc, g.m, g.n, g.k, algo_rank, &algo));
    }
    if (algos_.size() < kMaxAlgoKeys) algos_.emplace(key, algo);
  }
  LOSSD_CUBLAS_RETURN_IF_ERROR(cublasLtMatmul(lt_, desc.op, &alpha, g.a, desc.a, g.b, desc.b,
                                              &g.beta, g.d, desc.d, g.d, desc.d, &algo, ws,
                                              g.ws_bytes, stream));
  return absl::OkStatus();
}

absl::Status FusedLoss::TuneGemm(cudaStream_t stream, void* ws, uint64_t ws_bytes, bool trans_a,
                                 bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                                 const void* a, int64_t lda, const void* b, int64_t ldb,
                                 cudaDataType ab_type, float beta, void* d, int64_t ldd,
                                 cudaDataType d_type, int32_t sm_target, const void* bias) {
  return TuneSpec(stream, ws, alpha,
                  Spec{trans_a, trans_b, m, n, k, a, lda, b, ldb, ab_type, beta, d, ldd, d_type,
                       ws_bytes, sm_target, bias});
}

absl::Status FusedLoss::TuneSpec(cudaStream_t stream, void* ws, float alpha, const Spec& g) {
  LtDescriptors desc;
  LOSSD_RETURN_IF_ERROR(Describe(g, &desc));
  std::vector<cublasLtMatmulHeuristicResult_t> results(kTuneCandidates);
  int found = 0;
  LOSSD_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulAlgoGetHeuristic(lt_, desc.op, desc.a, desc.b,
                                                              desc.d, desc.d, desc.pref,
                                                              kTuneCandidates, results.data(),
                                                              &found));
  if (found == 0) {
    return absl::InternalError(absl::StrCat(
        "cublasLtMatmulAlgoGetHeuristic: no algorithm for m=", g.m, " n=", g.n, " k=", g.k));
  }
  EventPair ev;
  LOSSD_CUDA_RETURN_IF_ERROR(cudaEventCreate(&ev.start));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaEventCreate(&ev.stop));
  // The candidates that launch (Describe has kept out the split-K reductions in place or in
  // 16 bits).
  std::vector<int> cand;
  for (int i = 0; i < found; ++i) {
    if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
    if (cublasLtMatmul(lt_, desc.op, &alpha, g.a, desc.a, g.b, desc.b, &g.beta, g.d, desc.d, g.d,
                       desc.d, &results[i].algo, ws, g.ws_bytes,
                       stream) != CUBLAS_STATUS_SUCCESS) {
      continue;
    }
    cand.push_back(i);
  }
  if (cand.empty()) {
    // Nothing to remember: storing an algorithm that did not launch would fail every later
    // request of this shape, where the next one may tune again (after a transient failure).
    return absl::InternalError(absl::StrCat("cublasLtMatmul: none of the ", found,
                                            " candidates for m=", g.m, " n=", g.n, " k=", g.k,
                                            " launched"));
  }
  int best = cand[0];
  if (cand.size() > 1) {
    // Warm-up first (an idle GPU raises its clocks over the first milliseconds, which would
    // favour whichever candidate runs last), then rounds that time every candidate once, so
    // a drift in clocks touches all of them alike; each candidate's median counts.
    for (int r = 0; r < 2; ++r) {
      for (int i : cand) {
        cublasLtMatmul(lt_, desc.op, &alpha, g.a, desc.a, g.b, desc.b, &g.beta, g.d, desc.d, g.d,
                       desc.d, &results[i].algo, ws, g.ws_bytes, stream);
      }
    }
    constexpr int kRounds = 5;
    std::vector<std::vector<float>> times(cand.size());
    for (int r = 0; r < kRounds; ++r) {
      for (size_t c = 0; c < cand.size(); ++c) {
        LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev.start, stream));
        LOSSD_CUBLAS_RETURN_IF_ERROR(cublasLtMatmul(lt_, desc.op, &alpha, g.a, desc.a, g.b,
                                                    desc.b, &g.beta, g.d, desc.d, g.d, desc.d,
                                                    &results[cand[c]].algo, ws, g.ws_bytes,
                                                    stream));
        LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev.stop, stream));
        LOSSD_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(ev.stop));
        float ms = 0;
        LOSSD_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, ev.start, ev.stop));
        times[c].push_back(ms);
      }
    }
    std::vector<float> median(cand.size());
    for (size_t c = 0; c < cand.size(); ++c) {
      std::sort(times[c].begin(), times[c].end());
      median[c] = times[c][kRounds / 2];
    }
    // The heuristic's first choice (when it is a candidate) unless another is faster by more
    // than the timing noise.
    size_t pick = 0;
    for (size_t c = 1; c < cand.size(); ++c) {
      if (median[c] < median[pick] * 0.97f) pick = c;
    }
    best = cand[pick];
  }
  // The choice for this exact problem (replacing an earlier one) and for its class, which
  // other problems of the class take without being timed.
  const AlgoKey key = KeyOf(g, 0);
  if (algos_.size() < kMaxAlgoKeys || algos_.count(key) != 0) algos_[key] = results[best].algo;
  const AlgoKey cls = ClassOf(g);
  if (tuned_.size() < kMaxTunedClasses || tuned_.count(cls) != 0) tuned_[cls] = results[best].algo;
  ++tunings_;
  return absl::OkStatus();
}

absl::Status FusedLoss::RunOrTune(bool tuning, cudaStream_t stream, void* ws, uint64_t ws_bytes,
                                  bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                                  const void* ap, int64_t lda, const void* bp, int64_t ldb,
                                  cudaDataType ab_type, float beta, void* dp, int64_t ldd,
                                  cudaDataType d_type, int32_t sms, int32_t rank,
                                  const void* bias) {
  const Spec g{ta,      tb,   m,  n,   k,      ap,       lda, bp,  ldb,
               ab_type, beta, dp, ldd, d_type, ws_bytes, sms, bias};
  if (!tuning) return RunSpec(stream, ws, alpha, g, rank);
  // Timed once per class, and no new class past the bound (its GEMMs take the heuristic's
  // first choice).
  if (rank != 0 || tuned_.count(ClassOf(g)) != 0 || tuned_.size() >= kMaxTunedClasses) {
    return absl::OkStatus();
  }
  return TuneSpec(main_, ws, alpha, g);
}

absl::Status FusedLoss::Enqueue(const DeviceLossArgs& a, const ChunkPlan& plan, void* workspace) {
  if (a.bt < 0 || a.h <= 0 || a.v <= 0 || a.v > 0x7fffffff || a.bt > 0x7fffffff) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda: bad shape bt=", a.bt, " h=", a.h, " v=", a.v));
  }
  if (!IsFloatDType(a.dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda: dtype must be bf16, fp16 or fp32; got ", DTypeName(a.dtype)));
  }
  if (a.dx != nullptr && a.dx_dtype != a.dtype && a.dx_dtype != DType::kF32) {
    return absl::InvalidArgumentError("cuda: gradient dtype must be the input dtype or fp32");
  }
  if (a.db_acc != nullptr && a.bias == nullptr) {
    return absl::InvalidArgumentError("cuda: db wanted but the problem has no bias");
  }
  if (plan.chunk_rows <= 0 || workspace == nullptr) {
    return absl::InvalidArgumentError("cuda: no chunk plan or workspace");
  }
  if (a.hooks != nullptr && plan.blocks > 0) {
    return absl::InvalidArgumentError(
        "cuda: rows that arrive during the compute need a row-chunk plan, not the whole-batch "
        "layout (each of its GEMMs reads every row of X)");
  }
  LOSSD_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  if (plan.blocks > 0) return EnqueueWhole(a, plan, workspace);
  const size_t elem = DTypeSize(a.dtype);
  const cudaDataType ab = CudaType(a.dtype);
  const GradScales scales = ComputeGradScales(a.options, a.summary);
  const bool want_dw = a.dw_acc != nullptr, want_db = a.db_acc != nullptr;
  const bool write_grad = a.dx != nullptr || want_dw || want_db;

  const uint64_t gws = plan.gemm_workspace_bytes;
  char* logits = static_cast<char*>(workspace);
  void* ws_main = logits + RoundUp(static_cast<uint64_t>(plan.chunk_rows) * a.v * elem, kAlign);
  void* ws_side = static_cast<char*>(ws_main) + gws;
  const int32_t rank_logits = algo_ranks_[static_cast<int>(GemmRole::kLogits)];
  const int32_t rank_dx = algo_ranks_[static_cast<int>(GemmRole::kDx)];
  const int32_t rank_dw = algo_ranks_[static_cast<int>(GemmRole::kDw)];

  const bool columns = plan.schedule == Schedule::kColumnHalves && a.v >= 256;
  const int64_t vsplit = columns ? (a.v / 2 + 63) / 64 * 64 : a.v;
  const int64_t vbegin[2] = {0, vsplit};
  const int64_t vcount[2] = {vsplit, a.v - vsplit};
  // The bias goes into the logits GEMM's epilogue (rounded with the logits, as on the CPU)
  // where every logits GEMM's slice of it is 16-byte aligned, which the epilogue needs; else
  // the CE kernel adds it to the stored logits in fp32.
  const bool gemm_bias = BiasInGemm(a.bias, elem, vbegin, columns ? 2 : 1);

  // The cross-entropy of rows [r0, r0 + n) of the chunk starting at c0, on ce_.
  auto cross_entropy = [&](int64_t c0, int64_t r0, int64_t n) -> absl::Status {
    CrossEntropyParams p = RowParams(a, scales, write_grad, c0 + r0, n);
    if (gemm_bias) p.bias = nullptr;  // already in the stored logits
    p.logits = logits + r0 * a.v * elem;
    return CudaStatus(LaunchCrossEntropy(p, ce_), "LaunchCrossEntropy");
  };
  // SM targets when the column-halves schedule pairs a main GEMM with a dW GEMM.
  const int32_t side_sms = plan.side_sms > 0 && plan.side_sms < sm_count_ ? plan.side_sms : 0;
  const int32_t main_sms = side_sms > 0 ? sm_count_ - side_sms : 0;
  // Every chunk GEMM goes through here. In the tuning pass (before any real work) a GEMM whose
  // key is new is timed instead, on main_ alone; a GEMM with a pinned rank is left as it is.
  bool tuning = false;
  auto gemm = [&](cudaStream_t stream, void* ws, bool ta, bool tb, int64_t m, int64_t n,
                  int64_t k, float alpha, const void* ap, int64_t lda, const void* bp,
                  int64_t ldb, float beta, void* dp, int64_t ldd, cudaDataType dt, int32_t sms,
                  int32_t rank, const void* bias = nullptr) -> absl::Status {
    return RunOrTune(tuning, stream, ws, gws, ta, tb, m, n, k, alpha, ap, lda, bp, ldb, ab, beta,
                     dp, ldd, dt, sms, rank, bias);
  };
  // z[r0:r0+n, v0:v0+nv] = X_c[r0:r0+n] W[v0:v0+nv]^T (+ b[v0:v0+nv] where the GEMM adds the
  // bias), as z^T (nv x n) = W^T-view * X_c^T.
  auto logits_gemm = [&](int64_t c0, int64_t r0, int64_t n, int64_t v0, int64_t nv, int32_t sms) {
    return gemm(main_, ws_main, true, false, nv, n, a.h, 1.0f, Offset(a.w, v0 * a.h, elem), a.h,
                Offset(a.x, (c0 + r0) * a.h, elem), a.h, 0.0f, logits + (r0 * a.v + v0) * elem,
                a.v, ab, sms, rank_logits, gemm_bias ? Offset(a.bias, v0, elem) : nullptr);
  };
  // dX_c^T (H x C) = W (H x V col-major) * G^T (V x C col-major).
  auto dx_gemm = [&](int64_t c0, int64_t rows, int32_t sms) -> absl::Status {
    if (a.dx == nullptr) return absl::OkStatus();
    const size_t dx_elem = DTypeSize(a.dx_dtype);
    char* dx = static_cast<char*>(a.dx) + c0 * a.h * dx_elem;
    return gemm(main_, ws_main, false, false, a.h, rows, a.v, scales.alpha, a.w, a.h, logits, a.v,
                0.0f, dx, a.h, CudaType(a.dx_dtype), sms, rank_dx);
  };
  // dW[v0:v0+nv]^T (H x nv) += X_c^T (H x C col-major) * G[:, v0:v0+nv]; chunks are added in
  // increasing row order, one GEMM per chunk and half: a fixed order.
  auto dw_gemm = [&](int64_t c0, int64_t rows, int64_t v0, int64_t nv,
                     int32_t sms) -> absl::Status {
    const float beta = (a.accumulate_dw || c0 > 0) ? 1.0f : 0.0f;
    return gemm(side_, ws_side, false, true, a.h, nv, rows, scales.alpha,
                Offset(a.x, c0 * a.h, elem), a.h, logits + v0 * elem, a.v, beta,
                a.dw_acc + v0 * a.h, a.h, CUDA_R_32F, sms, rank_dw);
  };
  // Tuning pass: the same GEMMs the chunks below issue, each new one timed on the real
  // buffers, serially on main_, before any real work. Logits and dX trials write the chunk
  // buffer and dX (both rewritten later); dW trials run with the chunk buffer zeroed, so
  // D = beta D + alpha X^T 0 leaves an accumulator as it was and a fresh dW is overwritten by
  // the first chunk. With hooks the trials run before any row of X has arrived (no hook is
  // called here): they read whatever the device X holds, which only changes what is timed,
  // not what is kept, except through the dW trials' X^T 0, which is 0 only for a finite X. So
  // the caller fills a streamed X with zeros before Enqueue and uploads rows only after it
  // (CudaBackend orders its copies after main_ at the first XReady).
  if (autotune_ && a.bt > 0) {
    tuning = true;
    for (int round = 0; round < 2; ++round) {
      if (round == 1) {
        if (!want_dw) break;
        LOSSD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(
            logits, 0, static_cast<size_t>(plan.chunk_rows) * a.v * elem, main_));
      }
      for (int64_t c0 = 0; c0 < a.bt; c0 += plan.chunk_rows) {
        const int64_t rows = std::min(plan.chunk_rows, a.bt - c0);
        if (round == 1) {
          for (int half = 0; half < (columns ? 2 : 1); ++half) {
            LOSSD_RETURN_IF_ERROR(
                dw_gemm(c0, rows, vbegin[half], vcount[half], columns ? side_sms : 0));
          }
          continue;
        }
        if (columns) {
          for (int half = 0; half < 2; ++half) {
            LOSSD_RETURN_IF_ERROR(logits_gemm(c0, 0, rows, vbegin[half], vcount[half],
                                                    half == 0 && c0 > 0 ? main_sms : 0));
          }
        } else {
          const int64_t split = RowSplit(rows);
          LOSSD_RETURN_IF_ERROR(logits_gemm(c0, 0, split, 0, a.v, 0));
          if (split < rows) {
            LOSSD_RETURN_IF_ERROR(logits_gemm(c0, split, rows - split, 0, a.v, 0));
          }
        }
        LOSSD_RETURN_IF_ERROR(dx_gemm(c0, rows, columns && want_dw ? main_sms : 0));
      }
    }
    tuning = false;
  }

  // The side streams start after whatever the caller queued on main_ (input copies).
  LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(start_, main_));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(side_, start_, 0));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(ce_, start_, 0));
  if (want_db && !a.accumulate_db) {
    LOSSD_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(a.db_acc, 0, static_cast<size_t>(a.v) * sizeof(float), side_));
  }
  if (want_dw && !a.accumulate_dw && a.bt == 0) {
    LOSSD_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(a.dw_acc, 0, static_cast<size_t>(a.v) * a.h * sizeof(float), side_));
  }

  // Overlapped path: main_ waits for rows [c0, c0 + rows) of X to be on the device before the
  // GEMM(s) that read them (row halves: each half's own rows). The dW GEMM on side_ reads the
  // same rows without a wait of its own: it follows ce_done_ (after the CE kernel), which
  // follows logits_done_ on main_, which follows this wait, so it is covered in both schedules.
  auto x_ready = [&](int64_t c0, int64_t rows) -> absl::Status {
    if (a.hooks == nullptr) return absl::OkStatus();
    absl::StatusOr<cudaEvent_t> arrived = a.hooks->XReady(c0, c0 + rows);
    if (!arrived.ok()) return arrived.status();
    if (*arrived == nullptr) return absl::OkStatus();
    return CudaStatus(cudaStreamWaitEvent(main_, *arrived, 0), "cudaStreamWaitEvent(X rows)");
  };
  // Tells the hooks that the chunk's dX GEMM is on main_.
  auto dx_enqueued = [&](int64_t c0, int64_t rows) -> absl::Status {
    if (a.hooks == nullptr || a.dx == nullptr) return absl::OkStatus();
    return a.hooks->DxEnqueued(c0, c0 + rows, main_);
  };

  auto db_sum = [&](int64_t rows) {
    return CudaStatus(LaunchColumnSumAccumulate(logits, static_cast<int32_t>(a.dtype), rows, a.v,
                                                scales.alpha, a.db_acc, side_),
                      "LaunchColumnSumAccumulate");
  };

  for (int64_t c0 = 0; c0 < a.bt; c0 += plan.chunk_rows) {
    const int64_t rows = std::min(plan.chunk_rows, a.bt - c0);
    if (columns) {
      LOSSD_RETURN_IF_ERROR(x_ready(c0, rows));
      // Each half of the buffer is rewritten once the previous chunk's dW half has read it
      // (the previous dX, on main_, is already ordered before).
      for (int half = 0; half < 2; ++half) {
        if (c0 > 0) LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(main_, dw_done_[half], 0));
        // The first half runs beside the previous chunk's second-half dW; the second alone.
        const int32_t sms = half == 0 && c0 > 0 ? main_sms : 0;
        LOSSD_RETURN_IF_ERROR(logits_gemm(c0, 0, rows, vbegin[half], vcount[half], sms));
      }
      LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(logits_done_[0], main_));
      LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(ce_, logits_done_[0], 0));
      LOSSD_RETURN_IF_ERROR(cross_entropy(c0, 0, rows));
      LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(ce_done_[0], ce_));
      LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(main_, ce_done_[0], 0));
      LOSSD_RETURN_IF_ERROR(dx_gemm(c0, rows, want_dw ? main_sms : 0));
      LOSSD_RETURN_IF_ERROR(dx_enqueued(c0, rows));
      if (want_dw || want_db) {
        LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(side_, ce_done_[0], 0));
        // db reads every column, so it goes before the first half is released.
        if (want_db) LOSSD_RETURN_IF_ERROR(db_sum(rows));
        for (int half = 0; half < 2; ++half) {
          if (want_dw) {
            LOSSD_RETURN_IF_ERROR(dw_gemm(c0, rows, vbegin[half], vcount[half], side_sms));
          }
          LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(dw_done_[half], side_));
        }
      }
    } else {
      const int64_t split = RowSplit(rows);
      const int64_t nsub = split < rows ? 2 : 1;
      const int64_t begin[2] = {0, split};
      const int64_t count[2] = {split, rows - split};
      // The chunk buffer is reused: wait until the previous chunk's dW/db read it.
      if (c0 > 0) LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(main_, dw_done_[0], 0));
      if (a.hooks != nullptr) {
        // Rows still arriving: each half starts once its own rows are in, and its CE is
        // queued before this thread waits for the next half's rows (the same kernels and
        // dependencies as below, so the same bits).
        for (int64_t s = 0; s < nsub; ++s) {
          LOSSD_RETURN_IF_ERROR(x_ready(c0 + begin[s], count[s]));
          LOSSD_RETURN_IF_ERROR(logits_gemm(c0, begin[s], count[s], 0, a.v, 0));
          LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(logits_done_[s], main_));
          LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(ce_, logits_done_[s], 0));
          LOSSD_RETURN_IF_ERROR(cross_entropy(c0, begin[s], count[s]));
        }
      } else {
        for (int64_t s = 0; s < nsub; ++s) {
          LOSSD_RETURN_IF_ERROR(logits_gemm(c0, begin[s], count[s], 0, a.v, 0));
          LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(logits_done_[s], main_));
        }
        for (int64_t s = 0; s < nsub; ++s) {
          LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(ce_, logits_done_[s], 0));
          LOSSD_RETURN_IF_ERROR(cross_entropy(c0, begin[s], count[s]));
        }
      }
      LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(ce_done_[0], ce_));
      // dX whole-chunk: a half-chunk dX GEMM has too few output tiles when H is small.
      LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(main_, ce_done_[0], 0));
      LOSSD_RETURN_IF_ERROR(dx_gemm(c0, rows, 0));
      LOSSD_RETURN_IF_ERROR(dx_enqueued(c0, rows));
      if (want_dw || want_db) {
        LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(side_, ce_done_[0], 0));
        // Overlapped, the last chunk's dX is what the caller still waits for on the wire:
        // its dX GEMM gets the whole GPU and its rows go out while this dW GEMM runs, instead
        // of both sharing the SMs and dX finishing last. Only the order of two independent
        // GEMMs changes, not what either computes.
        if (a.hooks != nullptr && a.dx != nullptr && c0 + rows >= a.bt) {
          LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(dx_last_, main_));
          LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(side_, dx_last_, 0));
        }
        if (want_dw) LOSSD_RETURN_IF_ERROR(dw_gemm(c0, rows, 0, a.v, 0));
        if (want_db) LOSSD_RETURN_IF_ERROR(db_sum(rows));
        LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(dw_done_[0], side_));
      }
    }
  }
  // Everything ends on main_.
  LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(side_end_, side_));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(main_, side_end_, 0));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(ce_end_, ce_));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(main_, ce_end_, 0));
  return absl::OkStatus();
}

absl::Status FusedLoss::EnqueueWhole(const DeviceLossArgs& a, const ChunkPlan& plan,
                                     void* workspace) {
  const int64_t bt = a.bt, h = a.h, v = a.v;
  const size_t elem = DTypeSize(a.dtype);
  const int n = plan.blocks;
  const int64_t nb = plan.block_cols;
  if (a.dw_acc == nullptr || a.accumulate_dw) {
    return absl::InvalidArgumentError(
        "cuda: the whole-batch layout needs a fresh dW (no accumulation into it)");
  }
  if (n > kMaxSegments || nb <= 0 || (n - 1) * nb >= v || n * nb < v || bt <= 0 ||
      static_cast<uint64_t>(bt) * elem > 4 * static_cast<uint64_t>(h) || h % 64 != 0 ||
      plan.chunk_rows != bt) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda: whole-batch plan (", n, " blocks of ", nb, " columns) does not fit bt=", bt,
        " h=", h, " v=", v));
  }
  const cudaDataType ab = CudaType(a.dtype);
  const GradScales scales = ComputeGradScales(a.options, a.summary);
  const bool want_dx = a.dx != nullptr, want_db = a.db_acc != nullptr;
  const bool dx_direct = want_dx && a.dx_dtype == DType::kF32;
  const uint64_t gws = plan.gemm_workspace_bytes;

  // Workspace: the last block of G, the fp32 dX sum (unless dX is fp32 itself), two GEMM
  // workspaces.
  char* last = static_cast<char*>(workspace);
  char* next = last + RoundUp(static_cast<uint64_t>(bt) * nb * elem, kAlign);
  float* dx_sum = nullptr;
  if (want_dx) {
    if (dx_direct) {
      dx_sum = static_cast<float*>(a.dx);
    } else {
      dx_sum = reinterpret_cast<float*>(next);
      next += RoundUp(static_cast<uint64_t>(bt) * h * 4, kAlign);
    }
  }
  void* ws_main = next;
  // Block b: columns [col0[b], col0[b] + cols[b]); its dW rows (region) and where its G lives:
  // the region of block b + 1, or the workspace for the last block.
  int64_t col0[kMaxSegments], cols[kMaxSegments];
  float* region[kMaxSegments];
  char* gbase[kMaxSegments];
  for (int b = 0; b < n; ++b) {
    const VocabBlock block = WholeBlock(plan, v, b);
    col0[b] = block.col0;
    cols[b] = block.cols;
    region[b] = a.dw_acc + col0[b] * h;
  }
  for (int b = 0; b < n; ++b) {
    gbase[b] = b + 1 < n ? reinterpret_cast<char*>(region[b + 1]) : last;
  }
  const int32_t rank_logits = algo_ranks_[static_cast<int>(GemmRole::kLogits)];
  const int32_t rank_dx = algo_ranks_[static_cast<int>(GemmRole::kDx)];
  const int32_t rank_dw = algo_ranks_[static_cast<int>(GemmRole::kDw)];
  bool tuning = false;
  // Z_b[r0:r0+rows] = X[r0:r0+rows] W_b^T, stored (rows, cols_b) row-major in block b.
  const bool gemm_bias = BiasInGemm(a.bias, elem, col0, n);  // as in Enqueue
  auto logits_gemm = [&](int b, int64_t r0, int64_t rows) {
    return RunOrTune(tuning, main_, ws_main, gws, true, false, cols[b], rows, h, 1.0f,
                     Offset(a.w, col0[b] * h, elem), h, Offset(a.x, r0 * h, elem), h, ab, 0.0f,
                     gbase[b] + r0 * cols[b] * elem, cols[b], ab, 0, rank_logits,
                     gemm_bias ? Offset(a.bias, col0[b], elem) : nullptr);
  };
  // dX[r0:r0+rows] (+)= G_b[r0:r0+rows] W_b into fp32, blocks added in increasing order.
  auto dx_gemm = [&](int b, int64_t r0, int64_t rows) -> absl::Status {
    if (!want_dx) return absl::OkStatus();
    return RunOrTune(tuning, main_, ws_main, gws, false, false, h, rows, cols[b], scales.alpha,
                     Offset(a.w, col0[b] * h, elem), h, gbase[b] + r0 * cols[b] * elem, cols[b],
                     ab, b > 0 ? 1.0f : 0.0f, dx_sum + r0 * h, h, CUDA_R_32F, 0, rank_dx);
  };
  // dW_b^T (H x cols_b) = X^T G_b over all BT rows: one GEMM, written over block b - 1's G.
  auto dw_gemm = [&](int b) {
    return RunOrTune(tuning, main_, ws_main, gws, false, true, h, cols[b], bt, scales.alpha, a.x,
                     h, gbase[b], cols[b], ab, 0.0f, region[b], h, CUDA_R_32F, 0, rank_dw);
  };
  const int64_t split = RowSplit(bt);
  const int halves = split < bt ? 2 : 1;
  const int64_t hbegin[2] = {0, split};
  const int64_t hcount[2] = {split, bt - split};

  // Tuning pass (as in Enqueue): every GEMM below timed once per shape on these very buffers
  // before any real work; nothing they write is read before the real GEMMs rewrite it.
  if (autotune_) {
    tuning = true;
    for (int s = 0; s < halves; ++s) {
      for (int b = 0; b < n; ++b) LOSSD_RETURN_IF_ERROR(logits_gemm(b, hbegin[s], hcount[s]));
    }
    for (int s = 0; s < halves; ++s) {
      for (int b = 0; b < n; ++b) LOSSD_RETURN_IF_ERROR(dx_gemm(b, hbegin[s], hcount[s]));
    }
    for (int b = 0; b < n; ++b) LOSSD_RETURN_IF_ERROR(dw_gemm(b));
    tuning = false;
  }

  LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(start_, main_));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(ce_, start_, 0));
  if (want_db && !a.accumulate_db) {
    LOSSD_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(a.db_acc, 0, static_cast<size_t>(v) * sizeof(float), main_));
  }
  // Logits of both row halves; the first half's CE runs under the second half's GEMMs, and the
  // second half's CE under the first half's dX GEMMs.
  for (int s = 0; s < halves; ++s) {
    for (int b = 0; b < n; ++b) LOSSD_RETURN_IF_ERROR(logits_gemm(b, hbegin[s], hcount[s]));
    LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(logits_done_[s], main_));
  }
  for (int s = 0; s < halves; ++s) {
    LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(ce_, logits_done_[s], 0));
    CrossEntropyParams p = RowParams(a, scales, /*write_grad=*/true, hbegin[s], hcount[s]);
    if (gemm_bias) p.bias = nullptr;  // already in the stored logits
    p.logits = nullptr;
    p.segments = n;
    for (int b = 0; b < n; ++b) {
      p.seg_base[b] = gbase[b] + hbegin[s] * cols[b] * elem;
      p.seg_col0[b] = col0[b];
      p.seg_cols[b] = cols[b];
    }
    LOSSD_CUDA_RETURN_IF_ERROR(LaunchCrossEntropy(p, ce_));
    LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(ce_done_[s], ce_));
  }
  for (int s = 0; s < halves; ++s) {
    LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(main_, ce_done_[s], 0));
    for (int b = 0; b < n; ++b) LOSSD_RETURN_IF_ERROR(dx_gemm(b, hbegin[s], hcount[s]));
  }
  if (want_dx && !dx_direct) {
    LOSSD_CUDA_RETURN_IF_ERROR(LaunchCastFromFloat(dx_sum, a.dx, static_cast<int32_t>(a.dx_dtype),
                                                   bt * h, main_));
  }
  // db reads every block of G; block b's G is overwritten by dW_{b+1}.
  if (want_db) {
    for (int b = 0; b < n; ++b) {
      LOSSD_CUDA_RETURN_IF_ERROR(LaunchColumnSumAccumulate(gbase[b], static_cast<int32_t>(a.dtype),
                                                           bt, cols[b], scales.alpha,
                                                           a.db_acc + col0[b], main_));
    }
  }
  for (int b = 0; b < n; ++b) LOSSD_RETURN_IF_ERROR(dw_gemm(b));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(ce_end_, ce_));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(main_, ce_end_, 0));
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace lossd
