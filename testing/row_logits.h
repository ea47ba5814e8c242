// SPDX-License-Identifier: Apache-2.0
// The raw logits of one row (x_i W^T + b) in double, from a problem's stored inputs, and the
// softcap applied to one: what test_util's generator and comparisons share. Test-only, private
// to //testing:test_util; never a reference of its own (kernels/cpu/reference is that).
#ifndef LOSSD_TESTING_ROW_LOGITS_H_
#define LOSSD_TESTING_ROW_LOGITS_H_

#include <cmath>
#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "core/loss_problem.h"
#include "testing/test_util.h"

namespace lossd {
namespace test_util_internal {

// Raw logits (x_i W^T + b) in double from the stored inputs, with W and b widened once.
class RowLogitCalculator {
 public:
  explicit RowLogitCalculator(const LossProblem& p)
      : p_(p), w_(Widen(p.w, p.dtype, p.v * p.h)), x_(p.h) {
    bias_ = p.bias != nullptr ? Widen(p.bias, p.dtype, p.v) : std::vector<double>(p.v, 0.0);
  }
  // (V) logits of row i.
  void Row(int64_t i, std::vector<double>* z) {
    for (int64_t k = 0; k < p_.h; ++k) x_[k] = LoadAsFloat(p_.x, p_.dtype, i * p_.h + k);
    z->resize(p_.v);
    for (int64_t j = 0; j < p_.v; ++j) {
      // Four partial sums: faster, and no less exact in double at these sizes.
      const double* wj = &w_[j * p_.h];
      double a[4] = {0, 0, 0, 0};
      int64_t k = 0;
      for (; k + 4 <= p_.h; k += 4) {
        for (int l = 0; l < 4; ++l) a[l] += x_[k + l] * wj[k + l];
      }
      for (; k < p_.h; ++k) a[0] += x_[k] * wj[k];
      (*z)[j] = bias_[j] + ((a[0] + a[1]) + (a[2] + a[3]));
    }
  }

 private:
  const LossProblem& p_;
  std::vector<double> w_, bias_, x_;
};

inline void RowLogits(const LossProblem& p, int64_t i, std::vector<double>* z) {
  RowLogitCalculator(p).Row(i, z);
}

inline double Softcapped(double z, double cap) { return cap > 0 ? cap * std::tanh(z / cap) : z; }

}  // namespace test_util_internal
}  // namespace lossd

#endif  // LOSSD_TESTING_ROW_LOGITS_H_
