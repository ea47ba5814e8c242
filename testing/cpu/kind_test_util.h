// SPDX-License-Identifier: Apache-2.0
// Test helpers for the loss kinds beyond cross-entropy (logprob, policy, distill) against their
// float64 references: poisoned output buffers with every kind's outputs, random per-token
// inputs, the logits' sizes the tolerances are made of, the gradients' comparison, and the
// cases every kind's test runs alike (the matrix's compute-and-compare, determinism, streamed
// rows, refusals).
#ifndef LOSSD_TESTING_CPU_KIND_TEST_UTIL_H_
#define LOSSD_TESTING_CPU_KIND_TEST_UTIL_H_

#include <cstdint>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "kernels/backend.h"
#include "kernels/cpu/reference_head.h"
#include "testing/test_util.h"

namespace lossd {

// Host output buffers of every kind, poisoned (NaN floats, 0xFF bytes) on creation, so an
// element a backend never writes fails every comparison. Accumulators start at random values
// (accum_start) instead: what a backend adds to them is got - accum_start.
class KindOutputs {
 public:
  KindOutputs(const LossProblem& p, DType grad_dtype, bool accumulate = false);
  LossOutputs outputs();  // views of the buffers below
  DType grad_dtype;
  bool accumulate;
  bool want_logp = true, want_entropy = true;  // logp / entropy given to the backend
  std::vector<float> loss, lse, logp, entropy;
  std::vector<int64_t> predictions;
  float accuracy = 0, kl = 0, clip_fraction = 0;
  int64_t tokens = 0;
  std::vector<uint8_t> dx, dw, db;        // grad_dtype
  std::vector<float> dw_accum, db_accum;  // fp32
  std::vector<float> dw_start, db_start;  // the accumulators' random start
};

// n values uniform in [lo, hi), from `seed`.
std::vector<float> RandomFloats(int64_t n, float lo, float hi, uint64_t seed);
// n values ~ N(0, std^2) stored in dtype t, from `seed`.
std::vector<uint8_t> RandomStored(int64_t n, double std, DType t, uint64_t seed);

// The raw logits u = x_i W^T + b of a head in double from the stored inputs, and their sizes.
struct RawLogits {
  std::vector<double> u;        // (BT, V)
  std::vector<double> abs_max;  // (BT) max_j |u_ij|
  std::vector<double> rms;      // (BT) sqrt(mean_j u_ij^2)
  std::vector<int64_t> argmax;  // (BT) first index of the max
};
RawLogits ComputeRawLogits(const HeadInputs& head);

// Whether `got` is an acceptable argmax of row i: the max itself, or a logit within the two
// logits' rounding (relative u to the stored logits, 2 u abs_max_i, plus fp32 slack) of it.
bool ArgmaxAcceptable(const RawLogits& l, int64_t v, int64_t i, int64_t got, double u);
// sqrt(mean of squares).
double Rms(const std::vector<double>& v);

// The unit roundoff of a stored value of dtype t: bf16 2^-8, fp16 2^-11, fp32 2^-24.
double UnitRoundoff(DType t);

// The relative-norm tolerance of a gradient whose G has relative error g_rel from the stored
// logits' rounding: 2 g_rel (2x margin on the first-order bound) + G's storage rounding 2u +
// the gradient dtype's grad_u + fp32 arithmetic and the GEMMs' 4 sqrt(max(V, BT)) 2^-24.
// At most kMaxGradientTolerance: the worst case of a few 16-bit rows with large logits can
// pass 1, which would accept any gradient of about the right size; their measured errors
// are below 0.02 (the tests print every margin).
inline constexpr double kMaxGradientTolerance = 0.125;
double GradientTolerance(const LossProblem& p, DType grad_dtype, double g_rel);

// dx, dw and db (or the accumulators, less their start) of `got` against `ref` scaled by
// `scale`, each by relative norm within `tol`, every element finite; the result's message
// carries every comparison's numbers.
::testing::AssertionResult GradientsMatch(const LossProblem& p, const KindOutputs& got,
                                          const HeadGradients& ref, double scale, double tol);

// Every output buffer of a and b byte for byte.
::testing::AssertionResult KindOutputsIdentical(const KindOutputs& a, const KindOutputs& b);

// A kind's comparison's verdict: `errors` (a line per output outside its bound) and the
// gradients'; a success carries `summary` and the gradients' margins, for the log.
::testing::AssertionResult KindVerdict(std::string errors, const ::testing::AssertionResult& grads,
                                       const std::string& summary = "");

// The spec of a random (bt, h, v) head of `dtype` from `seed`; each kind's test adds its own.
RandomProblemSpec HeadSpec(int64_t bt, int64_t h, int64_t v, DType dtype, uint64_t seed);

// The matrices' test names, <shape>_<dtype>_<case>, of a (Shape, DType, Case) parameter whose
// Shape and Case have a name.
template <typename Param>
std::string MatrixCaseName(const ::testing::TestParamInfo<Param>& info) {
  return std::string(std::get<0>(info.param).name) + "_" +
         std::string(DTypeName(std::get<1>(info.param))) + "_" + std::get<2>(info.param).name;
}

// Computes p into `got` on a two-thread CPU backend: it succeeds, `matches` holds (its margins
// printed), and the workspace it used is the one it reports. `stats` (if given) gets the
// Compute's. Call through ASSERT_NO_FATAL_FAILURE.
void ExpectComputeMatches(
    const LossProblem& p, KindOutputs& got,
    const std::function<::testing::AssertionResult(const KindOutputs&)>& matches,
    LossStats* stats = nullptr);

// A kind's output buffers for a problem: KindOutputs with only the kind's own outputs wanted.
using MakeKindOutputs = std::function<KindOutputs(const LossProblem&)>;

// p on one thread, then twice on one three-thread backend: every output byte for byte.
void ExpectBitIdenticalAcrossThreads(const LossProblem& p, const MakeKindOutputs& make);

// p given whole, and with its X arriving while the Compute runs (TrickleRows): the same bits,
// the stream's calls valid with `dx_calls` DxReady calls.
void ExpectStreamedRowsIdentical(const LossProblem& p, const MakeKindOutputs& make,
                                 size_t dx_calls);

// A problem the backend refuses: `edit` (and `edit_outputs`) make it bad; the error names
// `field`.
struct Refusal {
  const char* field;
  std::function<void(LossProblem&)> edit;
  std::function<void(KindOutputs&)> edit_outputs = nullptr;
};
// Each refusal applied to p, through the one validation as the engine calls a backend: invalid
// argument, naming its field.
void ExpectRefusals(const LossProblem& p, const std::vector<Refusal>& refusals,
                    const MakeKindOutputs& make);

}  // namespace lossd

#endif  // LOSSD_TESTING_CPU_KIND_TEST_UTIL_H_
