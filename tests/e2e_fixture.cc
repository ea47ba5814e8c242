// SPDX-License-Identifier: Apache-2.0
#include "tests/e2e_fixture.h"

#include <cmath>

namespace lossd {

RandomProblemSpec SmallSpec(DType dtype, uint64_t seed) {
  RandomProblemSpec s;
  s.bt = 47;
  s.h = 31;
  s.v = 123;
  s.dtype = dtype;
  s.seed = seed;
  s.ignore_fraction = 0.1;
  return s;
}

RandomProblemSpec WideSpec(DType dtype, uint64_t seed, int64_t h, int64_t v) {
  RandomProblemSpec s = SmallSpec(dtype, seed);
  s.h = h;
  s.v = v;
  return s;
}

void ExpectServes(Harness& h) {
  RandomProblem rp = RandomProblem::Make(SmallSpec(DType::kBF16, 99));
  ComputeReply r = RunCompute(h.stub(), HeaderFor(rp), PartsFor(rp, 1 << 20));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_TRUE(std::isfinite(r.summary.loss()));
}

}  // namespace lossd
