// SPDX-License-Identifier: Apache-2.0
// The host side of the logprob and policy loss kinds in a CudaBackend Compute: their per-row
// inputs on the device (with the coefficients' power of two taken out, as the cross-entropy
// takes its scales out of G), and their outputs from the per-row statistics the row kernel
// wrote (row_loss_kernels.h): the loss, logp, entropy and policy's metrics, reduced on the
// host in double and in row order. Never validates a problem (the engine did).
#ifndef LOSSD_KERNELS_CUDA_ROW_LOSS_IO_H_
#define LOSSD_KERNELS_CUDA_ROW_LOSS_IO_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/loss_problem.h"
#include "kernels/backend.h"
#include "kernels/cuda/chunk_plan.h"
#include "kernels/cuda/device_io.h"
#include "kernels/cuda/fused_loss.h"

namespace lossd {
namespace cuda {

// Whether this backend computes `kind`: cross-entropy, logprob, policy and distill.
bool RowLossKindComputed(LossKind kind);

// Distill's rows: targets32[i] = -1 where the target is ignore_index, else 0 (any other value
// counts; no targets: every row counts), and the count of rows that count.
absl::StatusOr<TargetSummary> DistillRows(const LossProblem& p,
                                          std::vector<int32_t>* targets32);  // (BT) out

// Device bytes of the kind's own inputs (0 for cross-entropy): per-row arrays, and distill's
// teacher X (and W and bias when they are not in backend memory).
uint64_t RowLossInputBytes(const WorkspaceShape& s);

// Policy's per-row weight w_i (kernels/policy_rows.h: its normaliser by loss type or
// aggregation, 0 where masked) from the mask targets32[i] >= 0, and the mask count N in *tokens.
std::vector<double> PolicyRowWeights(const LossProblem& p,
                                     const std::vector<int32_t>& targets32,  // (BT)
                                     int64_t* tokens);

// Policy's entropy-bonus coefficients e_i = grad_scale w_i (-entropy_coeff), what G takes from
// the row's entropy; empty where entropy_coeff is 0.
std::vector<double> EntropyCoefficients(const LossProblem& p,
                                        const std::vector<int32_t>& targets32);  // (BT)

// Policy by sequence (PolicyBySequence: GSPO's sequence level, geo_mean): every row's
// grad_scale dloss/dlogp_i from the logp of a forward pass (0 on ignored rows), in double, by
// kernels/policy_rows.h's PolicySequenceRows (the CPU backend's too).
std::vector<double> SequenceCoefficients(const LossProblem& p,
                                         const std::vector<int32_t>& targets32,  // (BT)
                                         const std::vector<float>& logp);        // (BT)

// Sets *in to the logprob kind's inputs for coefficients c and e (BT; e may be empty): c / alpha
// uploaded as coef_logp, e / alpha as coef_entropy, alpha the power of two above the largest
// |c_i|, |e_i|.
absl::Status UploadSequenceCoefficients(CallBuffers& m, const std::vector<double>& c,
                                        const std::vector<double>& e, RowLossInputs* in);

// Sets a->kind and a->row_loss: the coefficients scaled by grad_scale / alpha, the policy's
// inputs and distill's teacher, uploaded. Nothing for cross-entropy, nor for policy at
// sequence level but the kind (its coefficients wait for a forward pass: policy_sequence.h).
absl::Status UploadRowLossInputs(CallBuffers& m, const LossProblem& p,
                                 const std::vector<int32_t>& targets32,  // (BT) -1 if ignored
                                 DeviceLossArgs* a);

// The kind's outputs from the per-row statistics (host.ce holds logp_i, or distill's row
// divergence; host.zl H_i): loss, logp, entropy, kl, clip_fraction (policy at either
// importance-sampling level, with is_ratio), and lse (the student's),
// predictions, accuracy and tokens as for cross-entropy; z_loss, which these kinds do not
// have, is 0.
void WriteRowLossOutputs(const LossProblem& p, const LossOutputs& out,
                         const std::vector<int32_t>& targets32, const HostRows& host);

}  // namespace cuda
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_ROW_LOSS_IO_H_
