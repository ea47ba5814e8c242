// SPDX-License-Identifier: Apache-2.0
// The float64 reference of the fused policy loss (GRPO / PPO-clip with a KL penalty to a
// reference policy) on a linear head: the loss, Liger-Kernel's two metrics, and dX, dW, db.
// Reads the inputs as stored; one row of V logits at a time, in double; never fast.
//
// Semantics: those of Liger-Kernel 0.8.5's LigerFusedLinearGRPOLoss with
// importance_sampling_level "token" or "sequence" (GSPO), vllm_is_ratio per token or None,
// and the reference log-probs given
// (not recomputed from ref_input / ref_weight), for its loss types grpo, bnpo, dr_grpo, dapo,
// cispo, sapo, luspo and vespo.
// Rows are B sequences of S tokens, sequence-major (row i = b S + s: Liger's (B, S) tensors
// flattened). Per row i:
//   logp_i = log softmax(softcap(x_i W^T + b) / T)_{t_i}      (Liger has no softcap: cap 0)
//   old_i  = old_logp_i; without old log-probs, logp_i detached (so r_i = 1, dr_i/dlogp_i = 1)
//   r_i    = exp(logp_i - old_i)                                  importance_sampling token
//   r_i    = R_b = exp(sum_{j in b} m_j (logp_j - old_j) / max(1, n_b))   sequence (GSPO), the
//            same for every token of sequence b, its gradient reaching every logp_j of b:
//            dR_b/dlogp_j = R_b m_j / max(1, n_b); refused with cispo and sapo (as Liger)
//   c_i    = clamp(r_i, 1 - eps_low, 1 + eps_high)
//   pg_i   = -min(q_i A_i, c_i A_i),  q_i = min(r_i, delta) (r_i without delta)  the clipped
//                                                         types: dapo grpo bnpo dr_grpo luspo
//   pg_i   = -sg(min(r_i, eps_high)) A_i logp_i                cispo (sg: no gradient; the
//                                                              bound is eps_high itself)
//   pg_i   = -sg(clamp(r_i, 1 - eps_low, 1 + eps_high)) A_i logp_i   cispo_clamp (verl's
//                                                              cispo, the CISPO paper's)
//   pg_i   = -A_i (4 / tau_i) sigmoid(tau_i (r_i - 1)),        sapo; tau_i = sapo_temperature_pos
//                                                              if A_i > 0, else _neg
//   pg_i  *= rho_i      with is_ratio (Liger's vllm_is_ratio: the trainer/rollout correction,
//                       already truncated by the caller; a constant: no gradient through it)
//   pg_i   = -A_i logp_i                                         gpg (verl's; no ratio)
//   geo_mean (verl's GMPO) has no pg_i of its own but a term per sequence b with n_b > 0:
//     d_i = logp_i - old_i, c_i = clamp(d_i, -eps_low, eps_high), s_i = sign(A_i),
//     e_i = s_i min(s_i d_i, s_i c_i)                 (the log-ratio clipped on A's side)
//     R_b = exp(sum_{i in b} m_i e_i / n_b),  Abar_b = sum_{i in b} m_i A_i / n_b,
//     rho_b = exp(sum_{i in b} m_i log(rho_i + 1e-10) / n_b)   (with is_ratio, verl's
//             geometric mean of the correction; else 1)
//     pg_b = -Abar_b R_b rho_b; the loss's policy term (1/B) sum_b pg_b, every sequence in B
//     (an empty one gives 0), whatever the aggregation, which weights only the KL and entropy
//     terms below (geo_mean's own: grpo's). Its gradient: dloss/dlogp_i gains
//     (1/B) pg_b g_i / n_b, g_i = 0 where A_i = 0 or clipped_i, else 1 (on the tie s d = s c
//     torch's min halves the gradient and clamp passes the other half whole). verl divides by
//     n_b + 1e-8, here by n_b. Refused: sequence level, use_bias_correction_kl.
//   pg_i   = -A_i r_i + [i in P] c |d_i|,  d_i = logp_i - old_i      kl_cov (verl's KL-Cov; no
//            clipping): P the k = max(1, floor(N kl_cov_ratio)) counted tokens with the largest
//            cov_i = (A_i - mean A)(logp_i - mean logp) (means over the counted tokens, logp
//            detached; ties to the lower row), c = ppo_kl_coef; d|d|/dd = sign(d) (0 at 0).
//            dapo's normaliser. Refused: sequence level, delta, use_bias_correction_kl.
//   pg_i   = -sg(phi_i) A_i logp_i                              vespo (Liger's and TRL's): per
//            sequence b, u_b = sum_{i in b} m_i clamp(d_i, -20, 20), d_i = logp_i - old_i,
//            plus with is_ratio sum_{i in b} clamp(log rho_i, log 1e-8, 20) over every row of b,
//            masked or not (Liger sums vllm_is_ratio unmasked; rho is not applied again);
//            log w_b = clamp(u_b, log 1e-8, 20), w_b = exp(log w_b);
//            phi_i = exp(l_i + k_i log w_b - l_i w_b) (phi = 1 at w = 1), (k_i, l_i) =
//            (vespo_k_pos, vespo_lambda_pos) where A_i >= 0, else the _neg pair, l_i at least
//            1e-4; 0 where not finite. sg: phi is a constant of the gradient (dpg_i = -phi_i
//            A_i). dapo's normaliser. Refused: sequence level, delta.
//   kl_i   = K(d_i), d_i = logp_i - ref_i, K the kl_estimator (without reference log-probs
//            ref_i = logp_i detached: kl_i = 0 and no gradient):
//              k3 (default, Liger's)  exp(-d) + d - 1            dK/dd = 1 - exp(-d)
//              k1                     d                           1
//              k2                     d^2 / 2                     d
//              abs                    |d|                         sign(d) (0 at 0, as torch)
//              low_var_kl (verl's k3) min(10, exp(-c) + c - 1),   1 - exp(-c) where d is in
//                                     c = clamp(d, -20, 20)       [-20, 20] and the value
//                                                                 <= 10, else 0
//            with kl_straight_through (verl's "k3+") the value is K's, the gradient k2's: d.
//            Times r_i with use_bias_correction_kl (r unclamped, with its gradient)
//   H_i    = -sum_j p_ij log p_ij, the entropy at T              (only if entropy_coeff != 0)
//   l_i    = pg_i + beta kl_i - entropy_coeff H_i                (the KL term only if beta != 0)
// With mask m_i in {0, 1}, N = sum_i m_i, n_b = the mask count of sequence b:
//   grpo, sapo  loss = (1/B) sum_b (sum_{i in b} m_i l_i) / max(1, n_b)   (geo_mean's too)
//   bnpo        loss = sum_i m_i l_i / max(1, N)
//   dr_grpo     loss = sum_i m_i l_i / (B max_completion_length)
//   dapo, cispo loss = sum_i m_i l_i / max(1, D)    D = dapo_normalizer if > 0, else N
//               (vespo's and cispo_clamp's too)
//   luspo       loss = sum_i m_i n_{b(i)} l_i / (B S)
//   gpg         as dapo
// With an aggregation (verl's loss_agg_mode) other than loss_type, it replaces the type's:
//   token-mean               loss = sum_i m_i l_i / max(1, D)        D as dapo's
//   seq-mean-token-sum       loss = sum_b sum_{i in b} m_i l_i / max(1, G)
//   seq-mean-token-mean      loss = sum_b (sum_{i in b} m_i l_i / n_b) / max(1, G)
//   seq-mean-token-sum-norm  loss = sum_b sum_{i in b} m_i l_i / (max(1, G) L)
//   G = dapo_normalizer if > 0 (verl's global_batch_size / dp_size), else the sequences with
//   n_b > 0; L = loss_scale_factor if > 0, else S (verl's horizon, loss_mask.shape[-1]).
// (Liger's D is num_items_in_batch / world_size when given, else the mask count all-reduced
// over the ranks / world_size; one call sees one rank, so a caller wanting either sends D.)
// Metrics, as Liger computes them (always over max(1, N), whatever the loss type):
//   kl            = sum_i m_i kl_i / max(1, N), reported only when beta != 0 (kl_i as above,
//                   bias-corrected when asked, as Liger's metric is)
//   clip_fraction = sum_i m_i clipped_i / max(1, N),
//                   clipped_i = (r_i < 1 - eps_low and A_i < 0) or (r_i > 1 + eps_high and A_i > 0)
//                   for the clipped types (r_i before delta); cispo: r_i > eps_high and
//                   A_i > 0; cispo_clamp: r_i outside [1 - eps_low, 1 + eps_high], either
//                   sign of A_i (verl's); geo_mean: (d_i > eps_high and A_i > 0) or
//                   (d_i < -eps_low and A_i < 0); kl_cov: i in P; sapo, gpg, vespo: never
// Gradients, of grad_scale * loss (w_i: row i's normaliser above, m_i / max(1, n_b) / B etc.):
//   token level: dloss/dlogp_i = w_i (dpg_i + beta dkl_i), dkl_i = 1 - exp(ref_i - logp_i)
//                   (+ k3_i, times r_i, with the bias correction), and dpg_i as below.
//   sequence level: split each row's derivative into the part through its ratio, e_i = dpg_i
//                   (+ beta k3_i r_i with the bias correction), and the rest, f_i = beta
//                   (1 - exp(ref_i - logp_i)) (times r_i with the bias correction); then
//                   dloss/dlogp_j = w_j f_j + m_j / max(1, n_b) sum_{i in b} w_i e_i.
//   The entropy term's gradient: dloss/dH_i = -entropy_coeff w_i, whatever the level.
//   dpg_i:
//     gpg:           -A_i
//     clipped types: -A_i r_i s_i; s_i = 0 if clipped_i, or if delta caps r_i (r_i >= delta,
//                    A_i < 0); 1/2 if r_i is exactly 1 - eps_low or 1 + eps_high; else 1
//     cispo:         -A_i min(r_i, eps_high)
//     cispo_clamp:   -A_i clamp(r_i, 1 - eps_low, 1 + eps_high)
//     vespo:         -A_i phi_i
//     sapo:          -4 A_i r_i g_i (1 - g_i), g_i = sigmoid(tau_i (r_i - 1))
//   dloss/dz_ij   = dloss/dlogp_i ([j = t_i] - p_ij), then 1/T, the softcap, and the head.
// The half is torch's (2.15, checked by client/python/tests/test_rl_reference_torch.py): on a
// bound, clamp passes no gradient and min splits its tie r A = c A into halves, so only r A's
// half reaches r. It matters where r = 1 sits on a bound: eps 0 without old log-probs. For the
// same reason delta's cap passes nothing at r = delta. delta > 1 + eps_high (checked) keeps
// q_i >= c_i, so it only changes tokens with A < 0 and r > delta.
// Where this differs from Liger: rows with mask 0 are skipped, their targets never read (Liger
// computes them and multiplies by 0, a NaN if such a row is not finite; its token-level luspo
// does not multiply by the token's own mask at all, so its padding enters the loss, which
// here it does not); advantages are per token (Liger's (B) repeated over each sequence's S
// tokens); delta with cispo or sapo is refused (Liger ignores it); everything is float64.
#ifndef LOSSD_KERNELS_CPU_POLICY_REFERENCE_H_
#define LOSSD_KERNELS_CPU_POLICY_REFERENCE_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "kernels/cpu/reference_head.h"

namespace lossd {

// PolicyLossType and PolicyLossTypeName are core/loss_problem.h's.

// Defaults are Liger-Kernel's (LigerFusedLinearGRPOLoss's constructor).
struct PolicyOptions {
  PolicyLossType loss_type = PolicyLossType::kDapo;
  float epsilon_low = 0.2f;   // finite, >= 0
  float epsilon_high = 0.2f;  // finite, >= 0
  float beta = 0.04f;         // KL coefficient: finite, >= 0
  float temperature = 1.0f;   // T: finite, > 0
  float softcap = kDefaultSoftcap;  // finite, >= 0; 0 = off (Liger's only setting)
  // dr_grpo: required, > 0; unused by the other types (>= 0), as in Liger.
  int64_t max_completion_length = 0;
  // dapo's and cispo's D: 0 = this call's mask count; else finite, > 0. Unused by the other
  // types, as Liger ignores num_items_in_batch there (trainers pass it whatever the type).
  double dapo_normalizer = 0;
  float grad_scale = kDefaultGradScale;  // upstream gradient of the loss: finite
  // sapo's gate temperatures (A > 0, A <= 0): finite, > 0, checked whatever the type.
  float sapo_temperature_pos = 1.0f;
  float sapo_temperature_neg = 1.05f;
  // 0 = none; else finite and > 1 + epsilon_high, with a clipped type only.
  float delta = 0.0f;
  bool use_bias_correction_kl = false;
  // token (Liger's default) or sequence (GSPO); sequence with a clipped type only.
  ImportanceSampling importance_sampling = ImportanceSampling::kToken;
  KlEstimator kl_estimator = KlEstimator::kK3;
  bool kl_straight_through = false;  // K's value, k2's gradient (verl's '+')
  float entropy_coeff = 0.0f;        // finite
  PolicyAggregation aggregation = PolicyAggregation::kLossType;
  double loss_scale_factor = 0;      // seq-mean-token-sum-norm's L: 0 = S, else finite, > 0
  double kl_cov_ratio = 0.0002;      // kl_cov: in (0, 1]
  float ppo_kl_coef = 1.0f;          // kl_cov: finite, >= 0
  // vespo's gamma shapes (finite) and rates (finite, >= 0), for A >= 0 and A < 0.
  float vespo_k_pos = 2.0f;
  float vespo_lambda_pos = 3.0f;
  float vespo_k_neg = 3.0f;
  float vespo_lambda_neg = 2.0f;
};

struct PolicyProblem {
  HeadInputs head;                   // head.bt = batch * S rows, sequence-major
  int64_t batch = 1;                 // B: sequences, > 0, divides head.bt
  const void* targets = nullptr;     // (BT) sampled ids, target_dtype, in [0, V) where mask 1
  DType target_dtype = DType::kI64;  // kI32 or kI64
  const uint8_t* mask = nullptr;     // (BT) 0 or 1; null = all 1
  const float* advantages = nullptr;  // (BT) per token, finite
  const float* old_logp = nullptr;   // (BT) finite; null = the current log-probs, detached
  const float* ref_logp = nullptr;   // (BT) finite; null = no reference (KL 0)
  const float* is_ratio = nullptr;   // (BT) finite, >= 0: rho_i; null = 1
  PolicyOptions options;
};

struct PolicyReferenceOutputs {
  double loss = 0;
  double kl = 0;        // the mean-KL metric; 0 with has_kl false when beta == 0
  bool has_kl = false;  // beta != 0 (Liger returns the KL metric only then)
  double clip_fraction = 0;
  int64_t tokens = 0;         // N
  std::vector<double> kl_token;  // (BT) kl_i (bias-corrected when asked); 0 where mask 0
  std::vector<double> logp;   // (BT) logp_i; 0 where mask 0
  std::vector<double> ratio;  // (BT) r_i (sequence level, geo_mean: R_b); 0 where mask 0
  // (BT) dloss/dlogp_i / w_i, before grad_scale (token level: dl_i/dlogp_i); 0 where masked
  std::vector<double> dl_dlogp;
  HeadGradients grad;         // of grad_scale * loss
};

// Computes every output of `p`; INVALID_ARGUMENT (naming the field and value) for a problem
// outside the rules above. An all-masked problem gives loss 0, metrics 0 and zero gradients.
absl::Status PolicyReference(const PolicyProblem& p, PolicyReferenceOutputs* out);

}  // namespace lossd

#endif  // LOSSD_KERNELS_CPU_POLICY_REFERENCE_H_
