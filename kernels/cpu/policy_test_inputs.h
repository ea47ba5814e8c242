// Test-only: random fp32 inputs of a policy problem for the float64 reference's tests
// (policy_reference_test.cc, policy_reference_types_test.cc). Never zero-filled.
#ifndef LOSSD_KERNELS_CPU_POLICY_TEST_INPUTS_H_
#define LOSSD_KERNELS_CPU_POLICY_TEST_INPUTS_H_

#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "core/dtype.h"
#include "kernels/cpu/logprob_reference.h"
#include "kernels/cpu/policy_reference.h"
#include "kernels/cpu/reference_head.h"

namespace lossd {

// Random fp32 inputs of B sequences of S tokens, owned, never zero-filled: X, W, b in
// [-1, 1), advantages of magnitude [0.3, 1.3) with the signs given.
struct Inputs {
  int64_t batch, seq, h, v, bt;
  std::vector<float> x, w, b, advantages, old_logp, ref_logp;
  std::vector<int64_t> targets;
  std::vector<uint8_t> mask;

  Inputs(int64_t batch_, int64_t seq_, int64_t h_, int64_t v_, uint32_t seed)
      : batch(batch_), seq(seq_), h(h_), v(v_), bt(batch_ * seq_) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f), mag(0.3f, 1.3f);
    x.resize(bt * h);
    w.resize(v * h);
    b.resize(v);
    for (auto* a : {&x, &w, &b}) {
      for (float& e : *a) e = u(rng);
    }
    advantages.resize(bt);
    for (int64_t i = 0; i < bt; ++i) advantages[i] = (i % 3 == 0 ? -1.0f : 1.0f) * mag(rng);
    std::uniform_int_distribution<int64_t> t(0, v - 1);
    targets.resize(bt);
    for (int64_t& e : targets) e = t(rng);
    mask.assign(bt, 1);
    old_logp.resize(bt);
    ref_logp.resize(bt);
  }

  PolicyProblem Problem(bool bias) {
    PolicyProblem p;
    p.head = HeadInputs{bt, h, v, DType::kF32, x.data(), w.data(), bias ? b.data() : nullptr};
    p.batch = batch;
    p.targets = targets.data();
    p.mask = mask.data();
    p.advantages = advantages.data();
    p.old_logp = old_logp.data();
    p.ref_logp = ref_logp.data();
    return p;
  }

  // The current log-probs at p's temperature and softcap (the logprob reference's).
  std::vector<double> CurrentLogprobs(const PolicyProblem& p) const {
    LogprobProblem lp;
    lp.head = p.head;
    lp.targets = p.targets;
    lp.options.temperature = p.options.temperature;
    lp.options.softcap = p.options.softcap;
    lp.options.ignore_index = -1;  // the masked rows' targets below
    LogprobReferenceOutputs r;
    EXPECT_TRUE(LogprobReference(lp, &r).ok());
    return r.logp;
  }
};

}  // namespace lossd

#endif  // LOSSD_KERNELS_CPU_POLICY_TEST_INPUTS_H_
