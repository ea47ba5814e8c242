// SPDX-License-Identifier: Apache-2.0
// The one validation of a loss problem (loss_problem.h): shapes, dtypes, pointers, memory
// kinds, option ranges, the grad_output and reduction rules, and the target range. The engine
// runs it on every problem before a backend sees it; backends and the CPU reference assume a
// problem that passed and only assert it in debug builds (LOSSD_DCHECK_VALID_PROBLEM).
// Every refusal is INVALID_ARGUMENT; the option and target messages are the ones clients read.
// Reads nothing but the targets; never allocates device memory, never aborts (but the debug
// check, which exists to abort).
#ifndef LOSSD_CORE_LOSS_PROBLEM_CHECK_H_
#define LOSSD_CORE_LOSS_PROBLEM_CHECK_H_

#include <cstdint>

#include "absl/status/status.h"
#include "core/dtype.h"
#include "core/loss_problem.h"

namespace lossd {

// The option rules, in the order the engine reports them (it checks the grad_output tensor's
// shape between the first and the second, so each is its own function):
// reduction known, and grad_output only with reduction none.
absl::Status CheckReduction(const LossOptions& o, bool has_grad_output);
// label_smoothing in [0, 1]; lse_square_scale and softcap finite and >= 0; grad_scale finite;
// temperature finite and > 0.
absl::Status CheckOptionRanges(const LossOptions& o);
// chunk_rows >= 0 (0 = the backend's choice).
absl::Status CheckChunkRows(const LossOptions& o);
// All three, in that order.
absl::Status CheckLossOptions(const LossOptions& o, bool has_grad_output);

// The kind's rules on the options, checked before the others (a cross-entropy-only option is
// reported as such, not as a bad value): a known kind; temperature 1 for cross-entropy; for
// the other kinds no class weights, no grad_output, reduction mean, and label_smoothing,
// lse_square_scale and token_scaling off.
absl::Status CheckKindOptions(LossKind kind, const LossOptions& o, bool has_class_weights,
                              bool has_grad_output);
// kPolicy's options for `bt` rows: a known loss type; epsilon_low, epsilon_high and beta
// finite and >= 0; sequences > 0 dividing bt; max_completion_length > 0 for dr_grpo (>= 0
// otherwise); dapo_normalizer finite and >= 0.
absl::Status CheckPolicyParams(const PolicyParams& p, int64_t bt);
// kDistill's options: jsd_beta in [0, 1]; weight_hard_loss and weight_soft_loss finite and
// >= 0.
absl::Status CheckDistillParams(const DistillParams& d);

// Every target in [0, v) or ignore_index.
absl::Status CheckTargets(const void* targets,  // (bt) target_dtype, host
                          DType target_dtype, int64_t bt, int64_t v, int64_t ignore_index);
// kDistill's targets: with weight_hard_loss != 0 present and each in [0, v) or ignore_index
// (CheckTargets); else only compared with ignore_index, any value.
absl::Status CheckDistillTargets(const LossProblem& p);

// The inputs of `p`: bt >= 0, h > 0, v > 0; a float dtype and an int32/int64 target dtype;
// x, w and targets non-null (x and targets may be null when bt = 0; targets also for
// kDistill); known memory kinds; the kind's inputs (its own present as it requires, another
// kind's absent; kDistill's teacher_h > 0, teacher_x and teacher_w non-null); the options
// (CheckKindOptions, CheckLossOptions and the kind's params); then the targets (CheckTargets;
// kDistill's CheckDistillTargets) and a top-k teacher's ids and log-probs (CheckDistillTopk),
// the only data it reads.
absl::Status ValidateLossInputs(const LossProblem& p);
// Where the results of `p` go: a gradient dtype of fp32 or the input dtype, no db (written or
// accumulated) without a bias, a known accumulator memory kind. Which outputs a kind has is
// not a rule here (a backend leaves alone, or writes as documented, those its kind lacks); the
// engine asks each kind only for its own.
absl::Status ValidateLossOutputs(const LossProblem& p, const LossOutputs& out);
// Both: what every backend assumes of a problem it is handed.
absl::Status ValidateLossProblem(const LossProblem& p, const LossOutputs& out);

// The debug builds' check of that assumption: prints `who` and the refusal to stderr and
// aborts unless ValidateLossInputs(p) (and, with `out`, ValidateLossOutputs) pass. For
// LOSSD_DCHECK_VALID_PROBLEM; a problem that fails here is a caller's bug, not a request's.
void DieUnlessValidProblem(const LossProblem& p, const LossOutputs* out, const char* who);

}  // namespace lossd

// A backend's (or the reference's) first line: a no-op in optimised builds (NDEBUG), where the
// engine's validation is the only one.
#ifdef NDEBUG
#define LOSSD_DCHECK_VALID_PROBLEM(p, out, who) static_cast<void>(0)
#else
#define LOSSD_DCHECK_VALID_PROBLEM(p, out, who) ::lossd::DieUnlessValidProblem((p), (out), (who))
#endif

#endif  // LOSSD_CORE_LOSS_PROBLEM_CHECK_H_
