// SPDX-License-Identifier: Apache-2.0
// The CPU backend's row pass: for one row of logits (x W^T in fp32), the bias, the rounding to
// the input dtype, softcap, max, log-sum-exp, loss, z-loss and argmax, and G = dL/dz written
// over the row. Pure arithmetic on one row: it never allocates, never reads another row, and
// its results do not depend on the instruction set it runs on (no FMA contraction).
#ifndef LOSSD_KERNELS_CPU_ROW_PASS_H_
#define LOSSD_KERNELS_CPU_ROW_PASS_H_

#include <cstdint>

#include "core/dtype.h"

namespace lossd {

// Per-problem constants of the row pass.
struct RowPassParams {
  int64_t v = 0;
  DType dtype = DType::kBF16;
  const float* cw = nullptr;    // (V) class weights, null = ones
  const float* bias = nullptr;  // (V) fp32, null = none
  double cw_sum = 0;            // S = sum_j cw[j]
  double eps = 0, zs = 0, cap = 0;
  bool token_scaling = false;  // LossOptions::token_scaling
  bool want_grad = false;
};

// What the row pass reports for one row.
struct RowResult {
  double ce = 0, zl = 0;
  float lse = 0;
  int64_t argmax = 0;
};

// One row: z (V) holds x W^T in fp32; the bias is added and the sum rounded to the input
// dtype here (the stored logits, done while the row is in cache), and z is overwritten with
// G = dL/dz (rounded to the input dtype) when want_grad. t < 0 marks an ignored row, whose G is
// zero. sc and sz scale the cross-entropy and z-loss gradients.
// Compiled for AVX-512, AVX2 and baseline x86-64, picked at load time. Without FMA
// contraction (ISO C++ mode) every variant rounds alike, so results do not depend on it.
RowResult RowPass(const RowPassParams& rp,
                  float* z,  // (V) fp32, overwritten with G when rp.want_grad
                  int64_t t, double sc, double sz);

}  // namespace lossd

#endif  // LOSSD_KERNELS_CPU_ROW_PASS_H_
