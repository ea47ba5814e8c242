// SPDX-License-Identifier: Apache-2.0
// FusedLoss's GEMM layer: one cuBLASLt matmul per Spec, its algorithm chosen once per problem
// key (the heuristic's, or autotuned per tuning class) so that every run of a key is the same.
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/fused_loss.h"
#include "kernels/cuda/fused_loss_internal.h"

namespace lossd {
namespace cuda {

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

// Destroys the timing events on every path out of TuneGemm.
struct EventPair {
  cudaEvent_t start = nullptr, stop = nullptr;
  ~EventPair() {
    if (start != nullptr) cudaEventDestroy(start);
    if (stop != nullptr) cudaEventDestroy(stop);
  }
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
    size_t pick = 0;
    LOSSD_RETURN_IF_ERROR(
        FastestCandidate(stream, ws, alpha, g, desc, results, cand, ev, &pick));
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

absl::Status FusedLoss::FastestCandidate(
    cudaStream_t stream, void* ws, float alpha, const Spec& g, const LtDescriptors& desc,
    const std::vector<cublasLtMatmulHeuristicResult_t>& results, const std::vector<int>& cand,
    const EventPair& ev, size_t* pick) {
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
  *pick = 0;
  for (size_t c = 1; c < cand.size(); ++c) {
    if (median[c] < median[*pick] * 0.97f) *pick = c;
  }
  return absl::OkStatus();
}

absl::Status FusedLoss::RunOrTune(bool tuning, cudaStream_t stream, void* ws, float alpha,
                                  const Spec& g, int32_t rank) {
  if (!tuning) return RunSpec(stream, ws, alpha, g, rank);
  // Timed once per class, and no new class past the bound (its GEMMs take the heuristic's
  // first choice).
  if (rank != 0 || tuned_.count(ClassOf(g)) != 0 || tuned_.size() >= kMaxTunedClasses) {
    return absl::OkStatus();
  }
  return TuneSpec(main_, ws, alpha, g);
}

}  // namespace cuda
}  // namespace lossd
