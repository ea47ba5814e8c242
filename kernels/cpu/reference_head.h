// SPDX-License-Identifier: Apache-2.0
// The linear head that the float64 references other than cross-entropy share (log-probs,
// the policy loss, distillation): per row, z = softcap(x W^T + b) / T from the inputs as stored
// (bf16/fp16 widened exactly), and the way back from dL/dz to dX, dW, db. Test oracle code:
// one row of V logits at a time, in double, never rounded and never fast.
#ifndef LOSSD_KERNELS_CPU_REFERENCE_HEAD_H_
#define LOSSD_KERNELS_CPU_REFERENCE_HEAD_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "core/dtype.h"

namespace lossd {

// Views of one head's caller-owned inputs, all in host memory.
struct HeadInputs {
  int64_t bt = 0;  // rows (tokens)
  int64_t h = 0;   // hidden size
  int64_t v = 0;   // vocabulary size
  DType dtype = DType::kF32;   // of x, w and bias: bf16, fp16 or fp32
  const void* x = nullptr;     // (BT, H) row-major
  const void* w = nullptr;     // (V, H) row-major
  const void* bias = nullptr;  // (V); null = no bias
};

// INVALID_ARGUMENT unless the shapes are positive, x and w are non-null and the dtype is a
// float one; `name` ("head", "teacher") starts every message.
absl::Status CheckHeadInputs(const HeadInputs& head, const char* name);

// INVALID_ARGUMENT unless `temperature` is finite and > 0 and `softcap` finite and >= 0, each
// message naming options.<field> and the value.
absl::Status CheckTemperatureAndSoftcap(float temperature, float softcap);

// INVALID_ARGUMENT unless every one of the n values is finite (a null array passes).
absl::Status CheckFinite(const float* values,  // (n) or null
                         int64_t n, const char* name);

// Float64 gradients of one head's inputs.
struct HeadGradients {
  std::vector<double> dx;  // (BT, H) row-major
  std::vector<double> dw;  // (V, H) row-major
  std::vector<double> db;  // (V); empty when the head has no bias
};

// One row's logits and what its backward pass needs.
struct HeadRow {
  int64_t i = 0;
  std::vector<double> x;      // (H) row i of X, widened
  std::vector<double> z;      // (V) softcap(x W^T + b) / T
  std::vector<double> dz_du;  // (V) dz/du of the raw logit u = x W^T + b: (1 - tanh^2) / T
  double lse = 0;             // log sum_j exp z_j
};

// A head with W widened once (V x H doubles, the size of dW). Cheap to call from one thread;
// holds no row state.
class ReferenceHead {
 public:
  // softcap 0 = off; `head`'s buffers must outlive this object.
  ReferenceHead(const HeadInputs& head, double softcap, double temperature);

  const HeadInputs& inputs() const { return head_; }

  // Fills `row` with row i's logits (every field sized on first use).
  void Row(int64_t i, HeadRow* row) const;

  // Zeroed gradients at the head's sizes (db only with a bias).
  HeadGradients ZeroGradients() const;

  // Adds row's contribution given g = dL/dz (V): dX_i += g' W, dW += g'^T x_i, db += g', with
  // g' = g * dz/du.
  void AddGradients(const HeadRow& row, const std::vector<double>& g,  // (V)
                    HeadGradients* out) const;

 private:
  HeadInputs head_;
  double softcap_;
  double inv_temperature_;
  std::vector<double> w_;  // (V, H)
  std::vector<double> b_;  // (V); empty without bias
};

// softmax(z)_j = exp(z_j - lse) for every j.
void Softmax(const HeadRow& row, std::vector<double>* p);  // (V)

}  // namespace lossd

#endif  // LOSSD_KERNELS_CPU_REFERENCE_HEAD_H_
