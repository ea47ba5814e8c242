// SPDX-License-Identifier: Apache-2.0
// The plain-data contract between the engine and every backend: one linear + cross-entropy
// problem (views of caller-owned buffers plus options) and where its results go. Knows nothing
// of gRPC, protobuf or CUDA; owns no memory.
//
// Math, per row i with target t_i != ignore_index (z = X W^T + b, optionally softcapped):
//   lse_i   = log sum_j exp z_ij
//   nll_i   = -cw[t_i] (z_it - lse_i)                     (cw = class weights, or 1)
//   smooth_i= -(1/V) sum_j cw[j] (z_ij - lse_i)
//   loss_i  = (1 - eps) nll_i + eps smooth_i + zs lse_i^2   (eps = label_smoothing, zs = z-loss)
// mean divides the cross-entropy part by sum_i cw[t_i] (PyTorch, whatever its sign; a zero sum
// gives a zero cross-entropy part) and the z-loss part by the non-ignored token count
// (Liger-Kernel); sum adds; none returns loss_i. Ignored rows give 0.
// token_scaling (Liger's use_token_scaling) multiplies loss_i and its gradient row by
// s_i = softmax(z_i)_t (the final logits, detached: s_i is a constant to the gradient), which
// backends take from the stored logits and round to the input dtype, as torch.softmax does.
#ifndef LOSSD_CORE_LOSS_PROBLEM_H_
#define LOSSD_CORE_LOSS_PROBLEM_H_

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "absl/status/status.h"
#include "core/dtype.h"

namespace lossd {

// 2^e for max = f 2^e, f in [0.5, 1): the power of two just above a positive finite max (1
// otherwise). The backends take it out of the stored gradient G (into their GEMMs' alpha):
// scaling by it is exact, so bf16 and fp32 storage give the same bits, while an fp16 G keeps
// its precision whatever the scale of the mean, the upstream gradient or the class weights.
inline double PowerOfTwoAbove(double max) {
  if (!(max > 0) || !std::isfinite(max)) return 1.0;
  int e = 0;
  std::frexp(max, &e);
  return std::ldexp(1.0, std::clamp(e, -100, 100));
}

// The class weights' share of that power of two: PowerOfTwoAbove(max_cw), the weights' largest
// magnitude (1 without weights: max_cw 0). With a z-loss, weights below 1 are not divided out:
// the z-loss part of G (2 zs lse p, times the row's scale) does not shrink with them, and
// would be scaled up past fp16's range.
inline double ClassWeightScale(double max_cw, double z_loss_scale) {
  if (z_loss_scale > 0 && max_cw < 1) return 1.0;
  return PowerOfTwoAbove(max_cw);
}

enum class Reduction : int32_t { kMean = 0, kSum = 1, kNone = 2 };

// What a Compute computes over the same chunked linear head (z = softcap(X W^T + b) / T):
// kCrossEntropy, the loss above (T must be 1). The others' float64 references are the oracle
// and document the math (docs/rl_losses.md):
// kLogprob (kernels/cpu/logprob_reference.h): per token log p(target) and the entropy at
//   temperature T; with upstream gradients dlogp, dentropy (either may be null = zeros) the
//   gradients of F = grad_scale sum_i (dlogp_i logp_i + dentropy_i H_i); `loss` = F.
// kPolicy (kernels/cpu/policy_reference.h): the GRPO / PPO-clip loss with Liger-Kernel's
//   semantics; the mask is `targets != ignore_index` (a masked row's target is ignore_index);
//   the gradients are of grad_scale * loss.
// kDistill (kernels/cpu/distill_reference.h): generalised JSD between the student (X, W,
//   bias) and a teacher (teacher_x, teacher_w, teacher_bias, of hidden size teacher_h, the
//   same V); targets only mark ignored rows; gradients for the student only.
// Cross-entropy-only inputs and options (class weights, grad_output, label smoothing, z-loss,
// token scaling, reduction other than mean) are refused for the other kinds.
enum class LossKind : int32_t { kCrossEntropy = 0, kLogprob = 1, kPolicy = 2, kDistill = 3 };
inline constexpr int kLossKinds = 4;
inline constexpr uint32_t LossKindBit(LossKind k) { return 1u << static_cast<int>(k); }
// Bits of a backend's loss_kinds (BackendInfo) above the kinds' own: options of a kind that a
// backend may compute or not. kPolicySequenceBit: kPolicy with ImportanceSampling::kSequence.
inline constexpr uint32_t kPolicySequenceBit = 1u << 16;
// kPolicyIsRatioBit: kPolicy with LossProblem::is_ratio.
inline constexpr uint32_t kPolicyIsRatioBit = 1u << 17;
// kDistillWeightsBit: kDistill with weight_hard_loss / weight_soft_loss other than (0, 1).
inline constexpr uint32_t kDistillWeightsBit = 1u << 20;
// kDistillTopkBit: kDistill from the teacher's top-k log-probs (LossProblem::teacher_topk).
inline constexpr uint32_t kDistillTopkBit = 1u << 21;
// verl's menu (PolicyParams below): kPolicyKlEstimatorBit, a kl_estimator other than kK3 or
// kl_straight_through; kPolicyEntropyBit, entropy_coeff != 0; kPolicyAggregationBit, an
// aggregation other than kLossType; kPolicyGpgBit, loss type gpg; kPolicyGeoMeanBit, loss type
// geo_mean; kPolicyKlCovBit, loss type kl_cov; kPolicyVespoBit, loss type vespo;
// kPolicyCispoClampBit, loss type cispo_clamp. Bits 24 and up, apart from the 16-23 other
// kinds' options take.
inline constexpr uint32_t kPolicyKlEstimatorBit = 1u << 24;
inline constexpr uint32_t kPolicyEntropyBit = 1u << 25;
inline constexpr uint32_t kPolicyAggregationBit = 1u << 26;
inline constexpr uint32_t kPolicyGpgBit = 1u << 27;
inline constexpr uint32_t kPolicyGeoMeanBit = 1u << 28;
inline constexpr uint32_t kPolicyKlCovBit = 1u << 29;
inline constexpr uint32_t kPolicyVespoBit = 1u << 30;
inline constexpr uint32_t kPolicyCispoClampBit = 1u << 31;
// "cross_entropy", "logprob", "policy", "distill"; "unknown" for a value out of range.
inline const char* LossKindName(LossKind k) {
  switch (k) {
    case LossKind::kCrossEntropy: return "cross_entropy";
    case LossKind::kLogprob: return "logprob";
    case LossKind::kPolicy: return "policy";
    case LossKind::kDistill: return "distill";
  }
  return "unknown";
}

// kPolicy's loss types (LigerFusedLinearGRPOLoss's loss_type; dapo is its default; gpg is
// verl's, -A logp with dapo's normalisation; geo_mean is verl's GMPO: each token's log-ratio
// clipped to [-epsilon_low, epsilon_high] on the side its advantage's sign picks, each
// sequence's geometric mean R_b = exp(mean of those), the loss the mean over the B sequences
// of -mean(A)_b R_b; kl_cov is verl's KL-Cov: -A r, plus ppo_kl_coef |logp - old| on the
// kl_cov_ratio share of the call's tokens with the largest covariance of A and logp; vespo is
// Liger's and TRL's: -phi A logp with phi a detached gamma weight of the sequence's summed
// log-ratio, dapo's normalisation; cispo_clamp is verl's cispo (and the CISPO paper's): -sg(w)
// A logp with w = clamp(r, 1 - epsilon_low, 1 + epsilon_high), where Liger's cispo takes
// min(r, epsilon_high); kernels/cpu/policy_reference.h has the formulas).
enum class PolicyLossType : int32_t {
  kDapo = 0,
  kGrpo = 1,
  kBnpo = 2,
  kDrGrpo = 3,
  kCispo = 4,
  kSapo = 5,
  kLuspo = 6,
  kGpg = 7,
  kGeoMean = 8,
  kKlCov = 9,
  kVespo = 10,
  kCispoClamp = 11,
};
inline constexpr int kPolicyLossTypes = 12;
// "dapo", "grpo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo", "gpg", "geo_mean", "kl_cov",
// "vespo", "cispo_clamp"; "unknown" for a value out of range.
inline const char* PolicyLossTypeName(PolicyLossType t) {
  switch (t) {
    case PolicyLossType::kDapo: return "dapo";
    case PolicyLossType::kGrpo: return "grpo";
    case PolicyLossType::kBnpo: return "bnpo";
    case PolicyLossType::kDrGrpo: return "dr_grpo";
    case PolicyLossType::kCispo: return "cispo";
    case PolicyLossType::kSapo: return "sapo";
    case PolicyLossType::kLuspo: return "luspo";
    case PolicyLossType::kGpg: return "gpg";
    case PolicyLossType::kGeoMean: return "geo_mean";
    case PolicyLossType::kKlCov: return "kl_cov";
    case PolicyLossType::kVespo: return "vespo";
    case PolicyLossType::kCispoClamp: return "cispo_clamp";
  }
  return "unknown";
}
// Whether a loss type takes the clipped surrogate -min(r A, clamp(r) A) (and so delta):
// every type but cispo and cispo_clamp (which clip a detached weight), sapo, gpg, geo_mean
// (which clips each token's log-ratio instead), kl_cov (which penalises instead of clipping)
// and vespo (which weights instead).
inline bool PolicyLossTypeClips(PolicyLossType t) {
  return t != PolicyLossType::kCispo && t != PolicyLossType::kSapo &&
         t != PolicyLossType::kGpg && t != PolicyLossType::kGeoMean &&
         t != PolicyLossType::kKlCov && t != PolicyLossType::kVespo &&
         t != PolicyLossType::kCispoClamp;
}

// kPolicy's per-token estimator of KL(pi || ref) in the beta term, with d_i = logp_i - ref_i
// (Schulman's k1, k2, k3; verl's kl_loss_type names them): kK3, Liger's and the default,
// exp(-d) + d - 1; kK1, d; kK2, d^2 / 2; kAbs, |d|; kLowVarKl, verl's "k3" / "low_var_kl":
// k3 of d clamped to [-20, 20], the value clamped to <= 10 (no gradient where a clamp holds).
enum class KlEstimator : int32_t { kK3 = 0, kK1 = 1, kK2 = 2, kAbs = 3, kLowVarKl = 4 };
inline constexpr int kKlEstimators = 5;
// "k3", "k1", "k2", "abs", "low_var_kl"; "unknown" for a value out of range.
inline const char* KlEstimatorName(KlEstimator e) {
  switch (e) {
    case KlEstimator::kK3: return "k3";
    case KlEstimator::kK1: return "k1";
    case KlEstimator::kK2: return "k2";
    case KlEstimator::kAbs: return "abs";
    case KlEstimator::kLowVarKl: return "low_var_kl";
  }
  return "unknown";
}

// kPolicy's aggregation of the per-token losses (verl's loss_agg_mode), m_i the mask, n_b
// sequence b's mask count, G the sequences with n_b > 0 (or the normaliser given), L the
// loss_scale_factor (or S): kLossType, the loss type's own (the default); kTokenMean,
// sum m l / D (D = dapo_normalizer, else the mask count); kSeqMeanTokenSum, sum_b (sum_{i in b}
// m l) / G; kSeqMeanTokenMean, sum_b (sum_{i in b} m l / n_b) / G; kSeqMeanTokenSumNorm,
// seq-mean-token-sum / L.
enum class PolicyAggregation : int32_t {
  kLossType = 0,
  kTokenMean = 1,
  kSeqMeanTokenSum = 2,
  kSeqMeanTokenMean = 3,
  kSeqMeanTokenSumNorm = 4,
};
inline constexpr int kPolicyAggregations = 5;
// "loss_type", "token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
// "seq-mean-token-sum-norm" (verl's spelling); "unknown" for a value out of range.
inline const char* PolicyAggregationName(PolicyAggregation a) {
  switch (a) {
    case PolicyAggregation::kLossType: return "loss_type";
    case PolicyAggregation::kTokenMean: return "token-mean";
    case PolicyAggregation::kSeqMeanTokenSum: return "seq-mean-token-sum";
    case PolicyAggregation::kSeqMeanTokenMean: return "seq-mean-token-mean";
    case PolicyAggregation::kSeqMeanTokenSumNorm: return "seq-mean-token-sum-norm";
  }
  return "unknown";
}

// kPolicy's importance-sampling level (Liger's importance_sampling_level): kToken, each
// token's own ratio r_i = exp(logp_i - old_i); kSequence (GSPO), one ratio per sequence,
// R_b = exp(sum_{i in b} m_i (logp_i - old_i) / max(1, n_b)), clipped once and weighting
// every token of b, its gradient flowing through the mean to every token of b. Sequence level
// with cispo or sapo is refused (as Liger refuses it).
enum class ImportanceSampling : int32_t { kToken = 0, kSequence = 1 };
inline constexpr int kImportanceSamplingLevels = 2;
// "token", "sequence"; "unknown" for a value out of range.
inline const char* ImportanceSamplingName(ImportanceSampling l) {
  switch (l) {
    case ImportanceSampling::kToken: return "token";
    case ImportanceSampling::kSequence: return "sequence";
  }
  return "unknown";
}

// kPolicy's options; defaults are Liger-Kernel's (LigerFusedLinearGRPOLoss's constructor).
struct PolicyParams {
  PolicyLossType loss_type = PolicyLossType::kDapo;
  float epsilon_low = 0.2f;   // finite, >= 0
  float epsilon_high = 0.2f;  // finite, >= 0
  float beta = 0.04f;         // KL coefficient: finite, >= 0
  // B: the rows are B sequences of BT / B tokens, sequence-major (grpo's per-sequence mean,
  // dr_grpo's B). > 0 and divides BT.
  int64_t sequences = 1;
  int64_t max_completion_length = 0;  // dr_grpo: required, > 0; else unused (>= 0)
  double dapo_normalizer = 0;         // dapo's (and cispo's) D: 0 = the mask count; else > 0
  // sapo's gate temperatures, for A > 0 and A <= 0: finite, > 0 (checked whatever the type).
  float sapo_temperature_pos = 1.0f;
  float sapo_temperature_neg = 1.05f;
  // Two-sided clipping of the clipped types: r capped at delta before the surrogate. 0 = none;
  // else finite and > 1 + epsilon_high. Refused for cispo and sapo (they have no surrogate).
  float delta = 0.0f;
  bool use_bias_correction_kl = false;  // the KL term times the (unclamped) ratio r
  ImportanceSampling importance_sampling = ImportanceSampling::kToken;
  // verl's menu. The KL term's estimator; with kl_straight_through (verl's '+' suffix, "k3+")
  // its value with k2's gradient d. A backend computes these with kPolicyKlEstimatorBit.
  KlEstimator kl_estimator = KlEstimator::kK3;
  bool kl_straight_through = false;
  // The entropy bonus: l_i -= entropy_coeff H_i (H_i the entropy at T, aggregated as the rest
  // is, as verl's entropy_coeff). Finite; kPolicyEntropyBit.
  float entropy_coeff = 0.0f;
  // How the per-token losses are aggregated; kPolicyAggregationBit. dapo_normalizer is D for
  // kTokenMean and G (sequences) for the seq-mean modes (0 = this call's count).
  PolicyAggregation aggregation = PolicyAggregation::kLossType;
  double loss_scale_factor = 0;  // L of kSeqMeanTokenSumNorm: 0 = S; else finite, > 0
  // kl_cov (verl's defaults): the share of the call's counted tokens penalised, in (0, 1]
  // (at least one token), and the penalty's coefficient, finite and >= 0.
  double kl_cov_ratio = 0.0002;
  float ppo_kl_coef = 1.0f;
  // vespo's gamma weight phi(w) = exp(lambda + k log w - lambda w) (phi(1) = 1), (k, lambda)
  // by the sign of the row's advantage: (k_pos, lambda_pos) where A >= 0, else the _neg pair
  // (Liger's and TRL's defaults). k finite; lambda finite and >= 0, used as max(lambda, 1e-4).
  float vespo_k_pos = 2.0f;
  float vespo_lambda_pos = 3.0f;
  float vespo_k_neg = 3.0f;
  float vespo_lambda_neg = 2.0f;
};

// Whether a policy Compute needs a group of rows' every log-prob before any of its rows'
// gradient: each sequence's for sequence-level importance sampling (GSPO), geo_mean's
// geometric mean and vespo's weight; the whole call's for kl_cov's covariance.
inline bool PolicyBySequence(const PolicyParams& p) {
  return p.importance_sampling == ImportanceSampling::kSequence ||
         p.loss_type == PolicyLossType::kGeoMean || p.loss_type == PolicyLossType::kKlCov ||
         p.loss_type == PolicyLossType::kVespo;
}
// The rows of such a group: the whole call (bt) for kl_cov, else one sequence's.
inline int64_t PolicyGroupRows(const PolicyParams& p, int64_t bt) {
  return p.loss_type == PolicyLossType::kKlCov ? bt : bt / (p.sequences > 0 ? p.sequences : 1);
}

// kDistill from the teacher's top-k log-probs (LossProblem::teacher_topk): what the divergence
// does with the teacher's mass outside its k ids (kernels/cpu/distill_reference.h has the
// formulas). kBucket, the default: one event more, the tail, the teacher's 1 - sum_k p_k
// (at least 0) against the student's mass outside the ids: a divergence of both
// distributions coarsened to k + 1 events, 0 only where the student gives each id the
// teacher's probability. kRenormalize: both renormalised over the k ids (the student's mass
// outside them gets no gradient). kNone: the k terms as they are, unnormalised (verl's
// forward_kl_topk).
enum class DistillTopkTail : int32_t { kBucket = 0, kRenormalize = 1, kNone = 2 };
inline constexpr int kDistillTopkTails = 3;
// "bucket", "renormalize", "none"; "unknown" for a value out of range.
inline const char* DistillTopkTailName(DistillTopkTail t) {
  switch (t) {
    case DistillTopkTail::kBucket: return "bucket";
    case DistillTopkTail::kRenormalize: return "renormalize";
    case DistillTopkTail::kNone: return "none";
  }
  return "unknown";
}
// The largest k a request may send (vLLM's default max_logprobs is 20, verl's topk 128).
inline constexpr int64_t kMaxDistillTopk = 1024;
// With kBucket, how far above 1 a row's k probabilities may sum (log-probs rounded to fp32);
// the tail is max(0, 1 - sum).
inline constexpr double kDistillTopkMassSlack = 1e-3;

// kDistill's options; defaults are Liger-Kernel's (LigerFusedLinearJSD's).
struct DistillParams {
  float jsd_beta = 0.5f;  // in [0, 1]: 0 forward KL(P || Q), 1 reverse KL(Q || P)
  // LigerFusedLinearJSDLoss's hard-label term: loss = (w_h sum_i ce_i + w_s sum_i jsd_i) / n,
  // ce_i the label's cross-entropy at temperature 1. Finite, >= 0; w_h != 0 needs targets in
  // [0, V). The defaults (0, 1) are the divergence alone (LigerFusedLinearJSD's); a backend
  // computes other weights only with kDistillWeightsBit.
  float weight_hard_loss = 0.0f;
  float weight_soft_loss = 1.0f;
  DistillTopkTail topk_tail = DistillTopkTail::kBucket;  // with LossProblem::teacher_topk
};
// Whether `d` asks for more than the divergence alone (kDistillWeightsBit).
inline bool DistillWeighted(const DistillParams& d) {
  return !(d.weight_hard_loss == 0.0f && d.weight_soft_loss == 1.0f);
}

// Every option's default, in this one place: LossOptions starts from them, the service fills an
// option a request leaves unset with them, and lossctl's flags, the clients and the proto's
// comments document these values. Gradients default to the input dtype (LossOutputs).
inline constexpr int64_t kDefaultIgnoreIndex = -100;  // PyTorch's and Liger-Kernel's
inline constexpr Reduction kDefaultReduction = Reduction::kMean;
inline constexpr float kDefaultLabelSmoothing = 0.0f;
inline constexpr float kDefaultZLossScale = 0.0f;
inline constexpr float kDefaultSoftcap = 0.0f;
inline constexpr float kDefaultGradScale = 1.0f;
inline constexpr int64_t kDefaultChunkRows = 0;
inline constexpr float kDefaultTemperature = 1.0f;

// The rules on these values are core/loss_problem_check.h's.
struct LossOptions {
  int64_t ignore_index = kDefaultIgnoreIndex;
  Reduction reduction = kDefaultReduction;
  float label_smoothing = kDefaultLabelSmoothing;  // eps in [0, 1]
  float z_loss_scale = kDefaultZLossScale;         // zs >= 0 (Liger's lse_square_scale)
  float softcap = kDefaultSoftcap;  // > 0: z = softcap * tanh(z / softcap); 0 = off
  // Upstream gradient of the scalar loss (mean, sum). With none, grad_output is used instead.
  float grad_scale = kDefaultGradScale;
  // Rows per chunk; 0 = the backend chooses from its memory budget.
  int64_t chunk_rows = kDefaultChunkRows;
  // Scale each non-ignored row's loss, z-loss and gradient by s_i (see the top of the file).
  bool token_scaling = false;
  // T: logits after the softcap are divided by it (kLogprob, kPolicy, kDistill; 1 for
  // kCrossEntropy). Finite, > 0.
  float temperature = kDefaultTemperature;
};

// Where a buffer lives. kHost: ordinary (or pinned) host memory. kBackend: memory the backend
// allocated through Backend::Allocate (device memory for the CUDA backend).
enum class Memory : int32_t { kHost = 0, kBackend = 1 };

// Rows that arrive and leave while a Compute runs (the server's overlapped path): X is still
// being received when the backend starts, and dX can be sent as it is written. A backend that
// is handed one reads rows [0, r) of X only after WaitX(r) returned OK, and calls DxReady(r)
// once rows [0, r) of dx hold their final values in the caller's buffer, in increasing r,
// ending with r = BT. Rows are visited in increasing order, so the results are bit-identical
// to the same problem given whole.
class RowStream {
 public:
  virtual ~RowStream() = default;
  // Blocks until rows [0, rows) of X are in place. An error (the sender went away, a part was
  // refused, the rows stalled) ends the Compute with that status; nothing more is read.
  virtual absl::Status WaitX(int64_t rows) = 0;
  // Rows [0, rows) of dx are final. Cheap and never blocks; may run on any thread, including a
  // device runtime's callback thread (so it must not call into the device runtime).
  virtual void DxReady(int64_t rows) = 0;
};

struct LossProblem {
  int64_t bt = 0;  // rows (tokens)
  int64_t h = 0;   // hidden size
  int64_t v = 0;   // vocabulary size
  DType dtype = DType::kBF16;  // of X, W and bias (bf16, fp16 or fp32)

  const void* x = nullptr;        // (BT, H) row-major, dtype, host
  const void* w = nullptr;        // (V, H) row-major, dtype, in w_memory
  Memory w_memory = Memory::kHost;
  const void* bias = nullptr;     // (V) dtype, in w_memory; null = no bias
  const void* targets = nullptr;  // (BT) target_dtype, host
  DType target_dtype = DType::kI64;  // kI32 or kI64
  const float* class_weights = nullptr;  // (V) fp32, host; null = all ones
  const float* grad_output = nullptr;    // (BT) fp32, host; reduction none only; null = ones
  LossOptions options;
  LossKind kind = LossKind::kCrossEntropy;
  // kLogprob: upstream gradients (BT) fp32, host; null = zeros.
  const float* dlogp = nullptr;
  const float* dentropy = nullptr;
  // kPolicy: per token (BT) fp32, host. advantages required; old_logp null = the current
  // log-probs detached (ratio 1); ref_logp null = no KL term.
  const float* advantages = nullptr;
  const float* old_logp = nullptr;
  const float* ref_logp = nullptr;
  // kPolicy: (BT) fp32, host, finite and >= 0: rho_i on the policy term (Liger's
  // vllm_is_ratio); null = 1. A backend computes it only with kPolicyIsRatioBit.
  const float* is_ratio = nullptr;
  PolicyParams policy;
  // kDistill: the teacher head, same BT and V as the student, hidden size teacher_h, X's dtype.
  int64_t teacher_h = 0;
  const void* teacher_x = nullptr;     // (BT, teacher_h), host
  const void* teacher_w = nullptr;     // (V, teacher_h), in teacher_w_memory
  Memory teacher_w_memory = Memory::kHost;
  const void* teacher_bias = nullptr;  // (V), in teacher_w_memory; null = none
  // kDistill from the teacher's top-k instead of its head (then teacher_h 0, no teacher_x,
  // teacher_w or teacher_bias): per row k ids, (BT, k) teacher_topk_id_dtype (int32 or int64),
  // and their log-probs (BT, k) fp32, host; 0 < k <= min(V, kMaxDistillTopk). 0 = a teacher
  // head. A backend computes it only with kDistillTopkBit.
  int64_t teacher_topk = 0;
  const void* teacher_topk_ids = nullptr;
  DType teacher_topk_id_dtype = DType::kI64;
  const float* teacher_topk_logp = nullptr;
  DistillParams distill;
  // Null: X is complete. Else X (host) fills in while the Compute runs; see RowStream. Every
  // other input is complete before Compute is called.
  RowStream* rows = nullptr;
};

// Caller-owned output buffers, all in host memory unless noted. A null pointer means the
// output is not wanted, and the backend may skip the work it needs.
struct LossOutputs {
  DType grad_dtype = DType::kBF16;  // of dx, dw, db: the input dtype or kF32
  float* loss = nullptr;            // (BT) with reduction none, else (1)
  float* z_loss = nullptr;          // (BT) with reduction none, else (1), same reduction as loss
  float* lse = nullptr;             // (BT)
  int64_t* predictions = nullptr;   // (BT) argmax over V, first index on ties
  float* accuracy = nullptr;        // (1) fraction of non-ignored rows with argmax == target
  int64_t* tokens = nullptr;        // (1) non-ignored rows
  float* logp = nullptr;            // (BT) kLogprob, kPolicy: log p(target) at T; 0 if ignored
  float* entropy = nullptr;         // (BT) kLogprob: entropy at T; 0 on ignored rows
  float* kl = nullptr;              // (1) kPolicy: Liger's mean-KL metric (0 when beta is 0)
  float* clip_fraction = nullptr;   // (1) kPolicy: Liger's clip-fraction metric
  void* dx = nullptr;               // (BT, H) grad_dtype, overwritten
  void* dw = nullptr;               // (V, H) grad_dtype, overwritten
  void* db = nullptr;               // (V) grad_dtype, overwritten
  // Server-side accumulation: dW and db are ADDED (in a fixed order) into these fp32 buffers
  // in accum_memory instead of being written to dw/db.
  float* dw_accum = nullptr;        // (V, H) fp32
  float* db_accum = nullptr;        // (V) fp32
  Memory accum_memory = Memory::kHost;
};

// Bits of LossStats::nonfinite: which gradient outputs hold a NaN or Inf after a Compute. With
// an accumulator (LossOutputs::dw_accum, db_accum) the bits are about the accumulator's sum.
enum NonFiniteBits : uint32_t {
  kNonFiniteDx = 1u << 0,
  kNonFiniteDw = 1u << 1,
  kNonFiniteDb = 1u << 2,
};

// What a backend reports about one Compute, for metrics (and the non-finite check).
struct LossStats {
  double compute_seconds = 0.0;
  uint64_t peak_extra_bytes = 0;  // workspace above inputs and outputs
  int64_t chunk_rows = 0;
  // GEMM algorithm choices timed during this Compute (autotuning of shapes the backend had
  // not seen; 0 once a training run's shapes are known).
  int64_t gemm_tunings = 0;
  // NonFiniteBits of the outputs written (finite inputs can still overflow: a grad_scale of
  // 3e38 with reduction sum puts Inf into dW). Each output is read once, after the Compute.
  uint32_t nonfinite = 0;
};

}  // namespace lossd

#endif  // LOSSD_CORE_LOSS_PROBLEM_H_
