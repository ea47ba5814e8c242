// The GPU engine of the fused linear + cross-entropy on device pointers: plans chunks from a
// memory budget, and enqueues per chunk the logits GEMM (cuBLASLt), the fused cross-entropy
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

namespace lossd {
namespace cuda {

// Host-side facts about the targets that the mean reduction needs before any gradient row.
struct TargetSummary {
  int64_t tokens = 0;           // non-ignored rows
  double weight_sum = 0;        // sum of cw[t_i] over non-ignored rows (tokens without weights)
  double class_weight_sum = 0;  // sum_j cw_j (V without weights)
  // max_j |cw_j| (0 without weights): the class weights scale the stored gradient, so this
  // is taken out of it as a power of two too (see ComputeGradScales).
  double class_weight_max_abs = 0;
  // max_i |row_grad_i| for reduction none with an upstream gradient (0 otherwise): taken out
  // of the stored gradient as a power of two, so small upstream gradients do not underflow fp16.
  double row_grad_max_abs = 0;
};

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
};

// How one chunk's work is spread over the three streams. Both are deterministic (each GEMM
// and kernel sees the same inputs whatever overlaps it); they differ in what overlaps what.
enum class Schedule : int32_t {
  // The logits GEMM and the CE kernel in two row halves (the first half's CE runs under the
  // second half's GEMM); dX and dW whole-chunk on two streams, side by side.
  kRowHalves = 0,
  // The logits GEMM and the dW GEMM in two column (vocabulary) halves: the next chunk's
  // first-half logits GEMM (compute-bound) runs under this chunk's second-half dW GEMM, whose
  // fp32 accumulator read and write are memory-bound; dX runs under the first-half dW.
  kColumnHalves = 1,
};

// What the backend uses unless told otherwise: with autotuned GEMMs, row halves measured
// faster at three of the four benchmark shapes with BT >= 8192 (bench/RESULTS.md).
inline constexpr Schedule kDefaultSchedule = Schedule::kRowHalves;
inline constexpr int32_t kDefaultSideSms = 0;

struct ChunkPlan {
  int64_t chunk_rows = 0;  // C
  Schedule schedule = Schedule::kRowHalves;
  // Column halves only: > 0 asks cuBLASLt to size the dW GEMMs for this many SMs and the main
  // stream's GEMMs that run beside them for the rest, so that the two really run side by side
  // (a hint to cuBLASLt's heuristics, not a hard partition). 0: every GEMM sized for the GPU.
  int32_t side_sms = 0;
  // cuBLASLt workspace per stream (two streams run GEMMs side by side); part of the budget.
  uint64_t gemm_workspace_bytes = 0;
  uint64_t workspace_bytes = 0;  // device bytes Enqueue needs as `workspace`
  // Whole-batch layout (PlanWhole) when blocks > 0: no row chunks (chunk_rows = BT); the
  // logits of all rows live in the fp32 dW buffer, split into `blocks` vocabulary blocks
  // (block 0 takes what is left over; the others `block_cols` columns each).
  int32_t blocks = 0;
  int64_t block_cols = 0;
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
// Bytes of cuBLASLt workspace per stream unless the plan says otherwise.
inline constexpr uint64_t kGemmWorkspaceBytes = 4ull << 20;
// Default budget for the chunk buffer plus GEMM workspaces.
inline constexpr uint64_t kDefaultChunkBudgetBytes = 512ull << 20;
// Wide vocabularies: the default budget grows to hold this many rows of logits (or all of BT),
// up to kMaxDefaultChunkBudgetBytes.
inline constexpr int64_t kMinDefaultChunkRows = 2048;
inline constexpr uint64_t kMaxDefaultChunkBudgetBytes = 2048ull << 20;

// The budget the backend plans with when none is given: kDefaultChunkBudgetBytes, or where
// that holds fewer than kMinDefaultChunkRows rows of logits (V above about 128K for 16-bit
// logits), enough for min(BT, kMinDefaultChunkRows) rows, at most kMaxDefaultChunkBudgetBytes.
// Why rows and not bytes: every chunk after the first reads and writes back the fp32 dW
// (8 V H bytes against the chunk's 6 C V H flops), so the share of that traffic depends on C
// alone, whatever V is; at (8192, 2304, 256000) 1024-row chunks measured 5-6% slower than
// 2048-row ones (bench/RESULTS.md).
uint64_t DefaultChunkBudget(int64_t bt, int64_t v, DType dtype,
                            uint64_t gemm_workspace_bytes = kGemmWorkspaceBytes);

// The largest chunk whose C x V logits buffer (input dtype) and GEMM workspaces fit in
// `budget_bytes`, balanced so the chunks are of equal size (a multiple of 64 rows where it
// can be). `requested_rows` > 0 overrides the budget. Never returns fewer than 1 row.
// `gemm_workspace_bytes` is the cuBLASLt workspace per stream (two of them are in the budget).
ChunkPlan PlanChunks(int64_t bt, int64_t v, DType dtype, uint64_t budget_bytes,
                     int64_t requested_rows, Schedule schedule = Schedule::kRowHalves,
                     uint64_t gemm_workspace_bytes = kGemmWorkspaceBytes);

// The whole-batch layout, for a fresh dW (not added into an accumulator) where it fits:
// the logits of every row, in vocabulary blocks, live in the fp32 dW buffer itself, block b
// in the dW rows of block b + 1 (the last block in the workspace), so that dW_b = X^T G_b is
// one GEMM over all BT rows, written over the rows that held block b - 1 (already used). No
// fp32 accumulator is read back; dX is summed over the blocks in an fp32 buffer. Applies when
// a block of BT rows fits in the dW rows of the same width (BT * elem <= 4 H), H % 64 == 0,
// and the last block, the fp32 dX (unless dX is already fp32) and the two GEMM workspaces fit
// in `budget_bytes` with at most kMaxSegments blocks. Otherwise returns blocks == 0 (use
// PlanChunks).
ChunkPlan PlanWhole(int64_t bt, int64_t h, int64_t v, DType dtype, bool want_dx, DType dx_dtype,
                    uint64_t budget_bytes, uint64_t gemm_workspace_bytes = kGemmWorkspaceBytes);

// Block b (0 <= b < plan.blocks) of a whole-batch plan over V columns: columns
// [col0, col0 + cols). Block 0 takes what is left over; the others plan.block_cols each.
struct VocabBlock {
  int64_t col0 = 0, cols = 0;
};
VocabBlock WholeBlock(const ChunkPlan& plan, int64_t v, int b);

// Where a batch of `rows` rows splits into the two row halves whose CE runs under the other
// half's GEMMs; `rows` itself (no split) below a few hundred rows, where the GEMMs would lose
// more than the overlap gains.
int64_t RowSplit(int64_t rows);

// Gradient multipliers of one problem: the kernel's ce/z scales and the GEMMs' alpha. The
// common factor alpha is taken out of the stored gradient so fp16 gradients do not underflow:
// grad_scale / N for the mean, and for reduction none the power of two at or above the largest
// upstream |row_grad| (a power of two, so bf16 and fp32 results are unchanged by it).
struct GradScales {
  float ce = 1, z = 1, alpha = 1;
};
GradScales ComputeGradScales(const LossOptions& o, const TargetSummary& s);

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
  FusedLoss() = default;
  absl::Status EnqueueWhole(const DeviceLossArgs& a, const ChunkPlan& plan, void* workspace);
  // Gemm (tuning false), or in a tuning pass TuneGemm on main_ when the key is new and the rank
  // is not pinned.
  absl::Status RunOrTune(bool tuning, cudaStream_t stream, void* ws, uint64_t ws_bytes, bool ta,
                         bool tb, int64_t m, int64_t n, int64_t k, float alpha, const void* ap,
                         int64_t lda, const void* bp, int64_t ldb, cudaDataType ab_type,
                         float beta, void* dp, int64_t ldd, cudaDataType d_type, int32_t sms,
                         int32_t rank, const void* bias = nullptr);
  struct Spec;  // one GEMM's arguments (fused_loss.cc)
  // Gemm and TuneGemm on a Spec (alpha, the one host scalar, is not part of its key).
  absl::Status RunSpec(cudaStream_t stream, void* ws, float alpha, const Spec& g,
                       int32_t algo_rank);
  absl::Status TuneSpec(cudaStream_t stream, void* ws, float alpha, const Spec& g);
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
};

}  // namespace cuda
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_FUSED_LOSS_H_
