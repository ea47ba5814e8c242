// SPDX-License-Identifier: Apache-2.0
// Test-only: what the float64 policy reference's tests (policy_reference_test.cc,
// policy_reference_types_test.cc) share: random fp32 inputs of a policy problem, never
// zero-filled; the finite-difference cases' old and reference log-probs, frozen problem and
// gradient check; and the comparisons and refusal check of their hand cases.
#ifndef LOSSD_TESTING_CPU_POLICY_TEST_UTIL_H_
#define LOSSD_TESTING_CPU_POLICY_TEST_UTIL_H_

#include <cstdint>
#include <functional>
#include <random>
#include <string>
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

  // Masks `row`, its target -1: a masked row's target is never read.
  void MaskUnread(int64_t row) {
    mask[row] = 0;
    targets[row] = -1;
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

// The finite-difference cases: the KL term off (beta 0), on with reference log-probs, or on
// without them (the current log-probs detached stand in).
enum KlCase { kNoKl, kKlWithRef, kBetaWithoutRef };

// The finite-difference cases' ratios r_i = exp(logp_i - old_i) (B = 2 sequences of S = 4):
// away from every kink the tests set (clip bounds 0.8 and 1.28, cispo's 1.3, delta 1.35) by
// far more than a finite-difference step moves them (~0.3%), so the loss is smooth there.
inline constexpr double kFdRatios[8] = {0.55, 0.9, 1.1, 1.45, 0.7, 1.2, 0.95, 1.5};

// Old log-probs at ratios kFdRatios to the current `logp`, reference log-probs within 0.5 of
// it (uniform, from `seed`); then left out of `p` as the case says: the old ones without
// `old`, the reference ones for kBetaWithoutRef.
void SetOldAndRefLogprobs(const std::vector<double>& logp, uint32_t seed, bool old, KlCase kl,
                          Inputs* in, PolicyProblem* p);

// The problem finite differences vary: `p` with the old and reference log-probs it leaves out
// (the current ones, detached: constants to the gradient) frozen at `logp` rounded to fp32,
// since perturbing X or W would move them too. q points into frozen: not copied or moved.
struct FrozenProblem {
  std::vector<float> frozen;
  PolicyProblem q;
  FrozenProblem(const PolicyProblem& p, const std::vector<double>& logp);
  FrozenProblem(const FrozenProblem&) = delete;
  FrozenProblem& operator=(const FrozenProblem&) = delete;
};

// grad_scale times q's loss: the objective whose gradient the reference returns.
double ScaledLoss(const PolicyProblem& q);

// EXPECTs the KL metric the case gives: above 1e-3 with reference log-probs, else 0.
void ExpectKlMetric(const PolicyReferenceOutputs& r, KlCase kl);

// EXPECTs `g`'s dX, dW (and db with `bias`) near the central differences of `objective` in
// in's X, W (and b), and the gradients not all near zero.
void ExpectHeadGradientMatches(Inputs& in, const HeadGradients& g, bool bias,
                               const std::function<double()>& objective);

// The parts of a finite-difference case's name both suites share.
std::string OldKlName(bool old, KlCase kl);           // "_old" or "_noold", then the KL case
std::string MaskHeadName(bool masked, bool bias);     // "_mask", "_bias_softcap"

// Max |a - b| <= tol * max |b|, and b not all zeros.
void ExpectNearAll(const std::vector<double>& a, const std::vector<double>& b, double tol,
                   const char* what);

// EXPECTs the reference to refuse `p` with INVALID_ARGUMENT, its message holding `substring`.
void ExpectRefused(const PolicyProblem& p, const std::string& substring);

// The reference's outputs of `p`, EXPECTing it accepted.
PolicyReferenceOutputs RunPolicyReference(const PolicyProblem& p);

// vespo's weight of every row, phi_i (Liger's get_gamma_weights, written again for the tests),
// at the log-probs `logp`, and dphi_i, how far it can move while each counted row's logp moves
// by at most logp_bound_j (empty: 0). phi moves with its sequence's u through every counted
// row's log-ratio (not without old log-probs); it is unimodal in u, its peak at
// log w = log(k / lambda), so over |u' - u| <= e its largest move is at an end or the peak.
struct VespoWeights {
  std::vector<double> phi, dphi;
};
VespoWeights VespoWeightsOf(const PolicyProblem& p, const std::vector<double>& logp,
                            const std::vector<double>& logp_bound);

}  // namespace lossd

#endif  // LOSSD_TESTING_CPU_POLICY_TEST_UTIL_H_
