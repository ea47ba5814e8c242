// SPDX-License-Identifier: Apache-2.0
// The GPU half of the fused linear + cross-entropy on device pointers: takes a chunk plan
// (chunk_plan.h) and enqueues per chunk the logits GEMM (cuBLASLt), the fused cross-entropy
// kernel (gradient in place over the logits), the dX GEMM and the fixed-order fp32 dW/db
// accumulation. Owns its streams, events and cuBLASLt handle; never allocates device memory
// (the caller passes the workspace) and never touches host tensors.
#ifndef LOSSD_KERNELS_CUDA_FUSED_LOSS_H_
#define LOSSD_KERNELS_CUDA_FUSED_LOSS_H_

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "kernels/cuda/chunk_plan.h"
#include "kernels/policy_math.h"

namespace lossd {
namespace cuda {

// RAII holders of one GEMM's cuBLASLt descriptors and of autotuning's timing events
// (fused_loss_gemm.cc).
struct LtDescriptors;
struct EventPair;
class RefExpGemm;         // ref_exp_gemm.h
struct RefExpGemmArgs;    // ref_exp_gemm.h

// Validates targets (each in [0, V) or ignore_index), converts them to int32 with -1 for an
// ignored row, and sums what the reductions need. INVALID_ARGUMENT names the first bad row.
absl::StatusOr<TargetSummary> SummarizeTargets(const void* targets,  // (BT) target_dtype, host
                                               DType target_dtype, int64_t bt, int64_t v,
                                               int64_t ignore_index,
                                               const float* class_weights,  // (V) host or null
                                               std::vector<int32_t>* targets32);  // (BT) out

// The host side of the overlapped path (LossProblem::rows): X arrives while Enqueue runs and
// dX leaves chunk by chunk. Enqueue calls both on its own thread, in increasing row order, for
// row-chunk plans only (a whole-batch plan reads all of X in every GEMM).
class ChunkHooks {
 public:
  virtual ~ChunkHooks() = default;
  // Called before the first GEMM that reads rows [row0, row1) of the device X is enqueued; may
  // block until those rows have arrived on the host. Returns an event that, once complete,
  // means the rows are on the device (null: they already are); Enqueue makes main_ wait on it
  // before that chunk's logits GEMM(s), and does so before it calls either hook again, so the
  // hook may re-record the same event next time. An error ends the Enqueue with it.
  virtual absl::StatusOr<cudaEvent_t> XReady(int64_t row0, int64_t row1) = 0;
  // Called right after the dX GEMM that writes rows [row0, row1) of the device dX was enqueued
  // on `stream` (only when dX is wanted): work the hook orders after `stream`'s current end
  // sees those rows final.
  virtual absl::Status DxEnqueued(int64_t row0, int64_t row1, cudaStream_t stream) = 0;
};

// The logprob and policy kinds' per-row inputs (row_loss_kernels.h says what each means), in
// device memory, and the power of two alpha that the host took out of their coefficients.
struct RowLossInputs {
  const float* coef_logp = nullptr;     // (BT) logprob: grad_scale dlogp_i / alpha, or null
  const float* coef_entropy = nullptr;  // (BT) logprob: grad_scale dentropy_i / alpha (policy: above), or null
  const float* row_weight = nullptr;    // (BT) policy: grad_scale w_i / alpha (0 if masked)
  const float* advantages = nullptr;    // (BT) policy
  const float* old_logp = nullptr;      // (BT) policy, or null
  const float* ref_logp = nullptr;      // (BT) policy, or null
  const float* is_ratio = nullptr;      // (BT) policy, or null (1)
  // Policy's row options (kernels/policy_math.h); the entropy bonus reaches G through
  // coef_entropy (grad_scale w_i (-entropy_coeff) / alpha), for policy as for logprob.
  policy_math::RowOptions policy;
  float alpha = 1;  // the dX, dW and db GEMMs' alpha
  // Distill: the teacher head (X's dtype; row-chunk plans whose workspace holds a second
  // logits buffer after the two GEMM workspaces), jsd_beta, and grad_scale / (n alpha).
  int64_t teacher_h = 0;
  const void* teacher_x = nullptr;     // (BT, teacher_h)
  const void* teacher_w = nullptr;     // (V, teacher_h)
  const void* teacher_bias = nullptr;  // (V), or null
  float jsd_beta = 0;
  float distill_coef = 0;  // w_s grad_scale / (n alpha)
  float hard_coef = 0;     // w_h grad_scale / (n alpha); targets then hold the labels
};

// Every tensor lives in device memory.
struct DeviceLossArgs {
  int64_t bt = 0, h = 0, v = 0;
  DType dtype = DType::kBF16;
  const void* x = nullptr;               // (BT, H) row-major, dtype
  const void* w = nullptr;               // (V, H) row-major, dtype
  const void* bias = nullptr;            // (V) dtype, or null
  const int32_t* targets = nullptr;      // (BT) in [0, V) or -1 (ignored)
  const float* class_weights = nullptr;  // (V), or null
  const float* row_grad = nullptr;       // (BT) upstream gradient for reduction none, or null
  LossOptions options;
  TargetSummary summary;
  // Per-row statistics, always written (the reductions are done by the caller on the host).
  float* row_lse = nullptr;     // (BT)
  float* row_ce = nullptr;      // (BT)
  float* row_z = nullptr;       // (BT)
  int32_t* row_pred = nullptr;  // (BT)
  void* dx = nullptr;           // (BT, H) row-major, dx_dtype, or null
  DType dx_dtype = DType::kBF16;
  float* dw_acc = nullptr;     // (V, H) row-major fp32, or null
  float* db_acc = nullptr;     // (V) fp32, or null (needs bias)
  bool accumulate_dw = false;  // true: add into dw_acc; false: overwrite it
  bool accumulate_db = false;  // true: add into db_acc; false: overwrite it
  // Null: x is complete on the device before Enqueue's work starts. Else x fills in as the
  // hooks say (row-chunk plans only); see ChunkHooks. Not owned.
  ChunkHooks* hooks = nullptr;
  // kLogprob, kPolicy and kDistill run row_loss_kernels.h's kernels in place of the
  // cross-entropy one (row-chunk plans only), with row_ce holding logp_i (distill: the row's
  // divergence) and row_z the entropy H_i; the cross-entropy options above are unused but for
  // softcap and temperature.
  LossKind kind = LossKind::kCrossEntropy;
  RowLossInputs row_loss;
};

// Which GEMM of a chunk a cuBLASLt algorithm choice is for.
enum class GemmRole : int32_t { kLogits = 0, kDx = 1, kDw = 2 };

// How many of cuBLASLt's heuristic candidates autotuning times per GEMM.
inline constexpr int kTuneCandidates = 8;
// Bounds on what a FusedLoss remembers, whatever shapes its clients send: algorithm choices by
// exact problem (past the bound a new shape asks the heuristic on every call instead, which
// gives the same choice each time) and autotuned tuning classes (past the bound a new class
// takes the heuristic's first choice, untimed).
inline constexpr size_t kMaxAlgoKeys = 4096;
inline constexpr size_t kMaxTunedClasses = 1024;

// The size autotuning files a GEMM dimension under: itself up to 64, else rounded up to the
// next of eight steps an octave (2048, 2304, ..., 3840, 4096, ...; at most 12.5% above it).
// The chunk plan follows BT, so a trainer whose BT moves from step to step (unpadded batches)
// makes new chunk GEMM shapes at every step; timing every one of them again cost each such
// step the whole tuning pass. GEMMs whose dimensions fall in the same classes share one timed
// choice, which cuBLASLt checks for each exact problem before it runs (bench/RESULTS.md,
// "Autotuning a moving BT").
int64_t TuneClass(int64_t x);
class FusedLoss {
 public:
  // Makes `device` current for the calling thread and creates streams, events and the handle.
  static absl::StatusOr<std::unique_ptr<FusedLoss>> Create(int device);
  ~FusedLoss();
  FusedLoss(const FusedLoss&) = delete;
  FusedLoss& operator=(const FusedLoss&) = delete;

  int device() const { return device_; }
  // Everything Enqueue does is finished once this stream is.
  cudaStream_t stream() const { return main_; }

  // Enqueues forward + backward; `workspace` holds plan.workspace_bytes device bytes, 256-byte
  // aligned. A whole-batch plan (plan.blocks > 0) needs a fresh dW (accumulate_dw false) of
  // the plan's shape. Deterministic: the same inputs and plan give bit-identical outputs. Not
  // thread-safe: one caller at a time.
  absl::Status Enqueue(const DeviceLossArgs& a, const ChunkPlan& plan, void* workspace);

  // Which of cuBLASLt's heuristic candidates (0 = its first choice) each chunk GEMM uses; a
  // rank the heuristic does not offer is NOT_FOUND at Enqueue. For benchmarks that compare
  // algorithms; fixed for the life of the object, so results stay deterministic.
  void set_algo_rank(GemmRole role, int32_t rank) { algo_ranks_[static_cast<int>(role)] = rank; }

  // On: the first Enqueue of a shape times cuBLASLt's first kTuneCandidates heuristic
  // candidates for each of its GEMMs (before any real work, on the real buffers) and keeps the
  // fastest for the life of the object. On an H200 that took the fused op at (8192, 4096,
  // 128256) from 43.1 to 40.1 ms and at (8192, 2304, 256000) from 56.5 to 50.6 ms
  // (bench/RESULTS.md). The choice is made once, so
  // a process stays deterministic; another process may choose differently (results then differ
  // at the rounding level). Off: the heuristic's first choice, the same in every process.
  // The candidates are timed once per tuning class (TuneClass of m, n and k; the same types,
  // strides, alignments and options), not per exact shape: a new BT within the classes already
  // timed costs no tuning.
  void set_autotune(bool on) { autotune_ = on; }
  // How many GEMM choices autotuning has timed and kept so far (for tests and benchmarks).
  int64_t tunings() const { return tunings_; }

  // The reference-exp path (fused_loss_ref_exp.cc): no pass over the logits in the backward,
  // and the softmax taken from the fp32 accumulator rather than bf16 logits. Available where
  // the CUTLASS kernel is compiled in (ref_exp_gemm.h) and the device is compute capability
  // 9.0. Enqueue takes it for a plan with ChunkPlan::ref_exp and a problem it covers
  // (RefExpCovers); on by default, off sends every problem down the other paths.
  bool ref_exp_available() const { return ref_exp_gemm_ != nullptr; }
  void set_ref_exp(bool on) { ref_exp_ = on; }
  // Vocabulary rows the reference's sample takes, 1 to kRefExpSample (the default; the layout
  // always holds kRefExpSample): fewer make the sample's GEMM cheaper and flag more rows for
  // the per-row redo. For benchmarks.
  void set_ref_exp_sample(int64_t n) { ref_exp_sample_ = n; }
  bool ref_exp() const { return ref_exp_ && ref_exp_available(); }
  // Whether the path computes this problem: cross-entropy, bf16, no bias, softcap or label
  // smoothing (class weights, z-loss, token scaling, every reduction and upstream gradient
  // are covered), H and V multiples of 8, X and W 16-byte aligned.
  static bool RefExpCovers(const DeviceLossArgs& a);
  // Chunks the path has run; rows it recomputed with their own largest logit as the
  // reference because their exp may have overflowed (a logit ~88 above the row's reference);
  // and chunks it redid whole through the cross-entropy kernel (more than kRefExpRedoMax such
  // rows, or a row of non-finite logits). For tests, benchmarks and the logs.
  int64_t ref_exp_chunks() const { return ref_exp_chunks_; }
  int64_t ref_exp_fallbacks() const { return ref_exp_fallbacks_; }
  int64_t ref_exp_redone_rows() const { return ref_exp_redone_rows_; }

  // Times the candidates for this GEMM on `stream` with these very pointers and keeps the
  // fastest for its key (replacing an earlier choice); later Gemm calls with the same key (and
  // algo_rank 0) use it. D is written (the caller passes a D that may be scratch, or B = 0 with
  // beta = 1, which leaves D as it was). Blocks until the trials are done.
  absl::Status TuneGemm(cudaStream_t stream, void* ws, uint64_t ws_bytes, bool trans_a,
                        bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                        const void* a,  // op(A): (m, k) column-major, lda
                        int64_t lda,
                        const void* b,  // op(B): (k, n) column-major, ldb
                        int64_t ldb, cudaDataType ab_type, float beta,
                        void* d,  // (m, n) column-major, ldd
                        int64_t ldd, cudaDataType d_type, int32_t sm_target = 0,
                        const void* bias = nullptr);

  // D = alpha op(A) op(B) + beta D (+ bias[i] on row i where `bias` is set: m values of D's
  // type, 16-byte aligned, added before D is rounded) on `stream`, column-major (cuBLASLt's
  // view of row-major tensors), fp32 accumulation, with `ws_bytes` of device workspace at `ws`.
  // The algorithm is chosen once per problem key and reused. Public so that benchmarks time the
  // same GEMMs.
  absl::Status Gemm(cudaStream_t stream, void* ws, uint64_t ws_bytes, bool trans_a, bool trans_b,
                    int64_t m, int64_t n, int64_t k, float alpha,
                    const void* a,  // op(A): (m, k) column-major, lda
                    int64_t lda,
                    const void* b,  // op(B): (k, n) column-major, ldb
                    int64_t ldb, cudaDataType ab_type, float beta,
                    void* d,  // (m, n) column-major, ldd
                    int64_t ldd, cudaDataType d_type, int32_t sm_target = 0,
                    int32_t algo_rank = 0, const void* bias = nullptr);

 private:
  // One GEMM's arguments but alpha (the one host scalar, not part of an algorithm's key):
  // D (m, n) = alpha op(A) op(B) + beta D, column-major, as Gemm takes them.
  struct Spec {
    bool trans_a, trans_b;
    int64_t m, n, k;
    const void* a;  // op(A): (m, k) column-major, lda
    int64_t lda;
    const void* b;  // op(B): (k, n) column-major, ldb
    int64_t ldb;
    cudaDataType ab_type;
    float beta;
    void* d;  // (m, n) column-major, ldd
    int64_t ldd;
    cudaDataType d_type;
    uint64_t ws_bytes;
    int32_t sm_target;
    // Non-null: cuBLASLt's bias epilogue adds bias[i] to row i of D (m values, D's type) before
    // D is rounded to its type, so the stored logits are X W^T + b rounded once, as DESIGN.md
    // says.
    const void* bias;
  };
  // What the steps of one row-chunk Enqueue (fused_loss_chunks.cc, fused_loss_internal.h), one
  // reference-exp Enqueue (fused_loss_ref_exp.cc) or one whole-batch Enqueue
  // (fused_loss_whole.cc) share, with the GEMMs and kernels they issue.
  class ChunkPass;
  class RefExpPass;
  class WholePass;

  FusedLoss() = default;
  // The row-chunk path: TuneChunks (autotune only), StartChunks, then per chunk ColumnChunk or
  // RowChunk (the plan's schedule), on the three streams.
  absl::Status EnqueueChunks(const DeviceLossArgs& a, const ChunkPlan& plan, void* workspace);
  absl::Status TuneChunks(ChunkPass& c);
  absl::Status StartChunks(const ChunkPass& c);
  absl::Status ColumnChunk(ChunkPass& c, int64_t c0, int64_t rows);
  absl::Status RowChunk(ChunkPass& c, int64_t c0, int64_t rows);
  absl::Status RowHalvesForward(ChunkPass& c, int64_t c0, int64_t rows);
  absl::Status RowHalvesBackward(ChunkPass& c, int64_t c0, int64_t rows);
  // The reference-exp path (plan.ref_exp and RefExpCovers): TuneChunks and TuneRefExp
  // (autotune only), StartChunks, then per chunk RefExpChunk, all on main_ but a chunk that
  // falls back to RowChunk.
  absl::Status EnqueueRefExp(const DeviceLossArgs& a, const ChunkPlan& plan, void* workspace);
  absl::Status TuneRefExp(RefExpPass& r);
  absl::Status RefExpForward(RefExpPass& r, int64_t c0, int64_t rows);
  absl::Status RefExpChunk(RefExpPass& r, int64_t c0, int64_t rows);
  absl::Status RunRefExpGemm(const RefExpGemmArgs& g, void* workspace);
  absl::Status RefExpScaledDx(RefExpPass& r, int64_t c0, int64_t rows);
  absl::Status RefExpRedoRows(RefExpPass& r, int64_t c0, int64_t rows, int64_t n);
  // Makes main_ wait for everything queued on side_ and ce_: an Enqueue ends on main_.
  absl::Status JoinStreams();
  // The whole-batch path (plan.blocks > 0).
  absl::Status EnqueueWhole(const DeviceLossArgs& a, const ChunkPlan& plan, void* workspace);
  absl::Status TuneWhole(WholePass& w);
  absl::Status WholeCrossEntropy(WholePass& w);
  // Gemm (tuning false), or in a tuning pass TuneGemm on main_ when the key is new and the rank
  // is not pinned.
  absl::Status RunOrTune(bool tuning, cudaStream_t stream, void* ws, float alpha, const Spec& g,
                         int32_t rank);
  // Gemm and TuneGemm on a Spec (alpha, the one host scalar, is not part of its key).
  absl::Status RunSpec(cudaStream_t stream, void* ws, float alpha, const Spec& g,
                       int32_t algo_rank);
  absl::Status TuneSpec(cudaStream_t stream, void* ws, float alpha, const Spec& g);
  // TuneSpec's timing: runs the launchable candidates `cand` (indices into `results`, at least
  // two) of the described GEMM in rounds on `stream` and sets *pick to the index into `cand`
  // of the one to keep.
  absl::Status FastestCandidate(cudaStream_t stream, void* ws, float alpha, const Spec& g,
                                const LtDescriptors& desc,
                                const std::vector<cublasLtMatmulHeuristicResult_t>& results,
                                const std::vector<int>& cand, const EventPair& ev, size_t* pick);
  using AlgoKey = std::tuple<int, int, int, int, int64_t, int64_t, int64_t, int64_t, int64_t,
                             int64_t, int, int, int, uint64_t, int32_t, int32_t>;
  static AlgoKey KeyOf(const Spec& g, int32_t rank);
  // KeyOf(g, 0) with m, n and k replaced by their TuneClass.
  static AlgoKey ClassOf(const Spec& g);

  int device_ = 0;
  int sm_count_ = 0;
  cudaStream_t main_ = nullptr;               // logits GEMM, dX GEMM
  cudaStream_t ce_ = nullptr;                 // cross-entropy kernels
  cudaStream_t side_ = nullptr;               // dW / db accumulation
  cudaEvent_t start_ = nullptr;               // caller's work on main_ before Enqueue
  std::array<cudaEvent_t, 2> logits_done_{};  // per half
  std::array<cudaEvent_t, 2> ce_done_{};      // per half
  std::array<cudaEvent_t, 2> dw_done_{};      // per half (one for the row-halves schedule)
  cudaEvent_t ce_end_ = nullptr, side_end_ = nullptr;
  cudaEvent_t dx_last_ = nullptr;  // overlapped path: the last chunk's dX GEMM is done
  cublasLtHandle_t lt_ = nullptr;
  // Heuristic choices by problem key: picked once, so every run uses the same algorithm.
  std::map<AlgoKey, cublasLtMatmulAlgo_t> algos_;
  std::array<int32_t, 3> algo_ranks_{};  // by GemmRole
  bool autotune_ = false;
  // Autotuned choices by tuning class (ClassOf), at most kMaxTunedClasses.
  std::map<AlgoKey, cublasLtMatmulAlgo_t> tuned_;
  int64_t tunings_ = 0;
  // The reference-exp path: its GEMM (null where not compiled in or not an sm_90 device), the
  // pinned word a chunk's flagged-row count comes back in, the event after the combine.
  std::unique_ptr<RefExpGemm> ref_exp_gemm_;
  bool ref_exp_ = true;
  int64_t ref_exp_sample_ = kRefExpSample;
  unsigned int* flagged_host_ = nullptr;
  cudaEvent_t combined_ = nullptr;
  int64_t ref_exp_chunks_ = 0, ref_exp_fallbacks_ = 0, ref_exp_redone_rows_ = 0;
};

}  // namespace cuda
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_FUSED_LOSS_H_
