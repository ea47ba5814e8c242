// SPDX-License-Identifier: Apache-2.0
// What kinds_bench's two-phase logprob row states, from its timings: the flops of both phases
// (the forward's logits GEMM, the backward's logits again, dX and dW: 8 BT H V) against the
// 6 BT H V of the GEMM floor and of a one-phase logprob with known upstream gradients, and the
// measured ratios beside the 8/6 the flops predict. Plain arithmetic and text, no device code:
// tested on the CPU (two_phase_row_test), timed on a GPU.
#ifndef LOSSD_BENCH_KERNEL_TWO_PHASE_ROW_H_
#define LOSSD_BENCH_KERNEL_TWO_PHASE_ROW_H_

#include <cstdint>
#include <cstdio>
#include <string>

namespace lossd {
namespace bench {

struct TwoPhaseTimes {
  int64_t bt = 0, h = 0, v = 0;
  double floor_ms = 0;        // the 3 GEMMs unchunked, cuBLASLt's first choice
  double tuned_floor_ms = 0;  // the same, fastest candidates
  double one_phase_ms = 0;    // logprob with upstream gradients in one call
  double forward_ms = 0;      // the two-phase forward alone (logits GEMM + row pass)
  double two_phase_ms = 0;    // forward then backward (logits again, dX, dW), timed together
};

// 2 BT H V per GEMM: one for the forward, three for the backward.
inline double TwoPhaseFlop(int64_t bt, int64_t h, int64_t v) {
  return 8.0 * static_cast<double>(bt) * static_cast<double>(h) * static_cast<double>(v);
}
inline double OnePhaseFlop(int64_t bt, int64_t h, int64_t v) {
  return 6.0 * static_cast<double>(bt) * static_cast<double>(h) * static_cast<double>(v);
}

// The summary line kinds_bench prints under its table.
inline std::string TwoPhaseLine(const TwoPhaseTimes& t) {
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "logprob two-phase at (%lld, %lld, %lld): forward %.2f ms + backward %.2f ms = "
                "%.2f ms, %.3fx the 6 BT H V floor (%.3fx tuned), %.3fx the one-phase logprob "
                "with gradients (%.2f ms); the flops predict %.3fx (8 vs 6 BT H V); %.0f TFLOP/s",
                static_cast<long long>(t.bt), static_cast<long long>(t.h),
                static_cast<long long>(t.v), t.forward_ms, t.two_phase_ms - t.forward_ms,
                t.two_phase_ms, t.two_phase_ms / t.floor_ms, t.two_phase_ms / t.tuned_floor_ms,
                t.two_phase_ms / t.one_phase_ms, t.one_phase_ms,
                TwoPhaseFlop(t.bt, t.h, t.v) / OnePhaseFlop(t.bt, t.h, t.v),
                TwoPhaseFlop(t.bt, t.h, t.v) / (t.two_phase_ms * 1e9));
  return buf;
}

}  // namespace bench
}  // namespace lossd

#endif  // LOSSD_BENCH_KERNEL_TWO_PHASE_ROW_H_
