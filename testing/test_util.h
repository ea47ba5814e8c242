// SPDX-License-Identifier: Apache-2.0
// Shared test helpers for every backend: a random problem generator (host buffers it owns),
// poisoned host output buffers, the tolerance table per dtype, and comparisons against the
// float64 reference that report mismatch count, worst index and max abs/rel error.
// Test-only; never linked into the server.
#ifndef LOSSD_TESTING_TEST_UTIL_H_
#define LOSSD_TESTING_TEST_UTIL_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/reference.h"
#include "core/dtype.h"
#include "core/loss_problem.h"

namespace lossd {

// What RandomProblem::Make draws. Inputs are random, never zero-filled; X ~ N(0, 1) and
// W ~ N(0, logit_scale^2 / H), so the raw logits are ~ N(0, logit_scale^2) and the softmax is
// far from flat.
struct RandomProblemSpec {
  int64_t bt = 4;
  int64_t h = 8;
  int64_t v = 16;
  DType dtype = DType::kBF16;
  DType target_dtype = DType::kI64;
  LossOptions options;
  bool bias = false;           // bias ~ N(0, 0.5^2)
  bool class_weights = false;  // cw in [0.25, 2) times class_weight_scale
  double class_weight_scale = 1.0;
  bool signed_class_weights = false;  // cw in [-1, 2) times the scale instead: some negative
  bool grad_output = false;    // (BT) in [-2, 2), used with reduction none
  double ignore_fraction = 0;  // share of rows whose target is options.ignore_index
  double argmax_fraction = 0.25;  // share of the other rows whose target is the row's argmax
  double logit_scale = 2.0;
  uint64_t seed = 1;
};

// One combination of loss options of the backend tests' matrices (the CPU and the CUDA
// backend's alike); the fields in this order, so that a case reads as one initializer.
struct OptionCase {
  const char* name = "";
  Reduction reduction = Reduction::kMean;
  float eps = 0, zs = 0, cap = 0;  // label smoothing, z-loss scale, softcap
  bool bias = false, weights = false, grad_output = false;
  double ignore = 0;        // share of ignored rows
  int64_t chunk_rows = 0;   // LossOptions.chunk_rows (0: the backend's choice)
  DType target_dtype = DType::kI64;
  bool grad_f32 = false;    // dX and dW asked for in fp32
  bool accumulate = false;  // dW added to what the output holds
  double weight_scale = 1;  // class weights times this (tiny ones: normalised to sum ~1)
  bool signed_weights = false;  // class weights of both signs (torch.randn's, say)
  bool token_scaling = false;   // LossOptions::token_scaling
};

// The RandomProblemSpec of case `c` at shape (bt, h, v): its options, bias, class weights,
// grad_output and ignored share, with options.grad_scale = grad_scale.
RandomProblemSpec SpecOf(int64_t bt, int64_t h, int64_t v, DType dtype, const OptionCase& c,
                         float grad_scale, uint64_t seed);

// The RandomProblemSpec of shape (bt, h, v) in `dtype`, every other field at its default.
RandomProblemSpec ShapeSpec(int64_t bt, int64_t h, int64_t v, DType dtype = DType::kBF16);

// Statistics of the raw logits x W^T + b (before softcap) that the tolerances are made of.
struct LogitStats {
  std::vector<double> row_abs_max;  // (BT) max_j |z_ij|
  double rms_row_abs_max = 0;       // sqrt(mean_i row_abs_max_i^2)
  double abs_max = 0;               // max over everything
};

// Computes LogitStats in double from the stored inputs (cost BT*V*H, like the reference).
LogitStats ComputeLogitStats(const LossProblem& p);

// One random problem; owns every host buffer its LossProblem views. Movable, not copyable
// (problem() points into the buffers).
class RandomProblem {
 public:
  static RandomProblem Make(const RandomProblemSpec& spec);

  RandomProblem(RandomProblem&&) = default;
  RandomProblem& operator=(RandomProblem&&) = default;
  RandomProblem(const RandomProblem&) = delete;
  RandomProblem& operator=(const RandomProblem&) = delete;

  // Views of this object's buffers (all host memory); rebuilt on every call.
  LossProblem problem() const;
  const RandomProblemSpec& spec() const { return spec_; }
  const LogitStats& stats() const { return stats_; }

  // Raw buffers, editable by tests (e.g. to force a target); call RecomputeStats() after
  // changing x, w or bias.
  std::vector<uint8_t> x;             // (BT, H) dtype
  std::vector<uint8_t> w;             // (V, H) dtype
  std::vector<uint8_t> bias;          // (V) dtype, empty = none
  std::vector<int64_t> targets;       // (BT) the values; stored as target_dtype below
  std::vector<float> class_weights;   // (V) empty = none
  std::vector<float> grad_output;     // (BT) empty = none
  void RecomputeStats() { stats_ = ComputeLogitStats(problem()); }

 private:
  RandomProblem() = default;
  RandomProblemSpec spec_;
  LogitStats stats_;
  // targets as int32 when spec_.target_dtype is kI32, refreshed by problem() so that tests
  // may edit `targets`.
  mutable std::vector<int32_t> targets32_;
};

// Host output buffers for one problem, poisoned (NaN floats, 0xFF bytes) on creation and by
// Poison(), so an element a backend never writes fails every comparison.
class HostOutputs {
 public:
  // want_grads: dx, dw (and db when the problem has a bias). accumulate: dw_accum/db_accum
  // (zeroed, not poisoned) instead of dw/db.
  HostOutputs(const LossProblem& p, DType grad_dtype, bool want_grads = true,
              bool accumulate = false);
  LossOutputs outputs();  // views of the buffers below (host memory)
  void Poison();

  DType grad_dtype;
  std::vector<float> loss, z_loss, lse;
  std::vector<int64_t> predictions;
  float accuracy = 0;
  int64_t tokens = 0;
  std::vector<uint8_t> dx, dw, db;         // grad_dtype
  std::vector<float> dw_accum, db_accum;   // fp32
  bool accumulate;
};

// The tolerance table. Every bound is derived from how a backend computes: logits made by an
// fp32-accumulating GEMM from the stored inputs and then stored in the input dtype (relative
// rounding logit_u), the gradient G stored in the input dtype too, outputs rounded to the
// gradient dtype (grad_u), and fp32 arithmetic elsewhere (fp32_rel).
struct Tolerance {
  double logit_u;   // unit roundoff of a stored logit: bf16 2^-8, fp16 2^-11, fp32 2^-24
  double grad_u;    // unit roundoff of the gradient dtype
  double fp32_rel;  // fp32 row-pass and GEMM arithmetic, relative (and absolute at scale 1)
};
Tolerance ToleranceFor(DType input, DType grad);

// The checked entry for tests and benchmarks that hand a backend a problem directly, which may
// be a bad one: the one validation (core/loss_problem_check.h) first, as the engine does, and
// the backend, which assumes a valid problem, only when it passes.
absl::Status ValidateThenCompute(Backend& backend, const LossProblem& p, const LossOutputs& out,
                                 LossStats* stats);

// Result of one comparison. Mismatches are elements outside their bound (NaN always is).
struct CompareResult {
  std::string name;
  int64_t count = 0;
  int64_t mismatches = 0;
  int64_t worst_index = -1;  // element with the largest error / bound ratio
  double max_abs = 0;        // largest |got - ref|
  double max_rel = 0;        // largest |got - ref| / |ref| (ref != 0)
  double rel_norm = 0;       // ||got - ref|| / ||ref|| (gradients)
  double tolerance = 0;      // bound on rel_norm (gradients) or at worst_index
  bool ok() const { return mismatches == 0; }
  std::string ToString() const;
};

// Elementwise: |got_k - ref_k| <= bound_k for every k.
CompareResult CompareElementwise(const std::string& name, const std::vector<double>& ref,
                                 const std::vector<double>& got,
                                 const std::vector<double>& bound);
// Relative norm: ||got - ref||_2 <= tol * ||ref||_2, every element finite. A zero reference
// must be matched exactly.
CompareResult CompareRelNorm(const std::string& name, const std::vector<double>& ref,
                             const std::vector<double>& got, double tol);

// Widens n elements of a float tensor of dtype t.
std::vector<double> Widen(const void* data, DType t, size_t n);

// First-order bounds of what rounding the stored logits (relative u, |dz_j| <= u |z_j|)
// changes: per row, |d lse| <= L_i = sum_j p_j |d zf_j| (zf the softcapped logits), the CE
// part <= (1-eps) cw_t (|d zf_t| + L_i) + (eps/V) sum_j cw_j (|d zf_j| + L_i), the z-loss part
// <= 2 zs |lse_i| L_i; and ||dG|| / ||G|| over the whole batch (G = dL/dz with every option,
// including G's own storage rounding u |G|). With token scaling, each row's bounds are those
// of s_i times its loss and gradient: s_i (bound) + |unscaled value| ds_i, where ds_i =
// s_i (|d zf_t| + L_i + u + 2^-21 (1 + |lse_i|)) bounds s_i's own error (the logits' rounding,
// its rounding to the input dtype, fp32 arithmetic).
struct ErrorBounds {
  std::vector<double> ce, zl, lse;  // (BT) each; ignored rows 0 (lse: every row)
  double grad_rel = 0;
};
ErrorBounds ComputeErrorBounds(const LossProblem& p, const ReferenceOutputs& ref, double u);

// Every output in `got` (host buffers; null ones skipped) against the reference, with bounds
// from ToleranceFor(p.dtype, got.grad_dtype) and ComputeErrorBounds(p, ref, logit_u):
//   loss/z-loss per token: the row bounds + fp32_rel (|ref| + 1); the scalar forms: 4 times
//     the root sum of squares of the row bounds, reduced as the loss is (rows' rounding
//     errors are independent), + fp32_rel (|ref| + 1);
//   lse: L_i + fp32_rel (|lse| + 1);
//   predictions: a different argmax is accepted when its reference logit is within the two
//     logits' rounding of the maximum; accuracy must equal the backend's own predictions'
//     accuracy, and the reference's within the accepted flips; tokens exactly;
//   dx, dw, db, dw_accum, db_accum: relative norm 2 grad_rel + grad_u + fp32_rel +
//     4 sqrt(max(V, BT)) 2^-24 (the GEMMs with random X and W carry G's relative error over
//     about unchanged, 2x margin; plus their own fp32 rounding), every
//     element finite, dx rows of ignored targets exactly 0. dw_accum/db_accum are expected to
//     have started at zero.
// `stats` is used for the predictions' fp32 slack and the report.
::testing::AssertionResult MatchesReference(const LossProblem& p, const LogitStats& stats,
                                            const ReferenceOutputs& ref,
                                            const LossOutputs& got);

// Every output buffer of `a` and `b` byte for byte (NaN payloads included); the failure names
// each buffer that differs and its first differing byte.
::testing::AssertionResult BitIdentical(const HostOutputs& a, const HostOutputs& b);

// A RowStream for tests of the overlapped path (LossProblem::rows). Holds its own copy of X,
// every byte poisoned (0xFF: NaN in bf16, fp16 and fp32) until a helper thread releases it:
// the real rows go in a few uneven steps with a pause between them, starting at construction.
// A backend that reads a row before WaitX covered it computes with NaN, which a bit-exact
// comparison with the whole problem catches. Records every WaitX and DxReady call.
class TrickleRows : public RowStream {
 public:
  struct Spec {
    int steps = 5;  // releases (fewer when BT is smaller), cut at random rows
    absl::Duration pause = absl::Milliseconds(1);
    // >= 0: release only rows [0, fail_after), then fail every wait for more with `failure`
    // (the sender went away).
    int64_t fail_after = -1;
    absl::Status failure = absl::CancelledError("test: the sender went away");
    uint64_t seed = 1;
  };
  // x: (BT, row_bytes) host, the real rows; copied, so the caller's buffer may go.
  TrickleRows(const void* x, int64_t bt, size_t row_bytes, const Spec& spec);
  // The rows of `whole`'s X (whole.bt rows of whole.h elements of whole.dtype).
  TrickleRows(const LossProblem& whole, const Spec& spec);
  ~TrickleRows() override;  // joins the helper thread
  TrickleRows(const TrickleRows&) = delete;
  TrickleRows& operator=(const TrickleRows&) = delete;

  // (BT, row_bytes): what to give the backend as LossProblem::x.
  const void* x() const { return buf_.data(); }
  // `p` with its X read through this stream: x is x(), rows is this.
  LossProblem Streamed(const LossProblem& p) {
    LossProblem streamed = p;
    streamed.x = x();
    streamed.rows = this;
    return streamed;
  }
  absl::Status WaitX(int64_t rows) override;
  void DxReady(int64_t rows) override;

  std::vector<int64_t> waits() const;     // every WaitX argument, in call order
  std::vector<int64_t> dx_ready() const;  // every DxReady argument, in call order
  // After a successful Compute of `bt` rows: WaitX asked for non-decreasing rows, none past
  // BT, the last BT; DxReady came `dx_calls` times (0: never, no dX wanted) with strictly
  // increasing rows, the first above 0, the last BT.
  ::testing::AssertionResult CallsAreValid(int64_t bt, size_t dx_calls) const;
  // Blocks until the helper thread has released all it will.
  void Drain();

 private:
  void Release();  // the helper thread

  const int64_t bt_;
  const size_t row_bytes_;
  const Spec spec_;
  std::vector<uint8_t> real_;  // (BT, row_bytes)
  // (BT, row_bytes): rows [released_, BT) are 0xFF. Written by the helper thread before it
  // publishes the rows under mu_, read by the backend after WaitX: ordered by mu_.
  std::vector<uint8_t> buf_;
  mutable absl::Mutex mu_;
  int64_t released_ ABSL_GUARDED_BY(mu_) = 0;
  bool done_ ABSL_GUARDED_BY(mu_) = false;  // the helper thread released its last step
  std::vector<int64_t> waits_ ABSL_GUARDED_BY(mu_);
  std::vector<int64_t> dx_ready_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

// The checks every backend shares for a compute whose rows of X stop coming: `whole`'s X goes
// out through a TrickleRows that fails every wait past `fail_after` rows with `failure`, and
// `compute` (a backend's Compute, outputs in bf16) must end with that very status, must have
// waited past the released rows, and must not have reported dX for rows it never had. Returns
// the TrickleRows, for the backend's own checks.
std::unique_ptr<TrickleRows> ExpectComputeEndsWithTheFailedWait(
    const std::function<absl::Status(const LossProblem&, const LossOutputs&)>& compute,
    const LossProblem& whole, const absl::Status& failure, int64_t fail_after);

// True when any of the n elements of `data` (dtype t, host) is NaN or Inf.
bool HasNonFinite(const void* data, DType t, int64_t n);

// The check every backend shares for LossStats::nonfinite on returned gradients: a problem of
// `spec` (finite inputs, reduction sum) reports none, and the same problem with grad_scale
// 3e38, whose dW overflows fp32, reports exactly the outputs (dX, dW, db in spec.dtype) in
// which a scan of the returned bytes finds NaN or Inf. `compute` is a backend's Compute.
void ExpectOverflowingGradientsReported(
    const std::function<absl::Status(const LossProblem&, const LossOutputs&, LossStats*)>&
        compute,
    RandomProblemSpec spec);

}  // namespace lossd

#endif  // LOSSD_TESTING_TEST_UTIL_H_
