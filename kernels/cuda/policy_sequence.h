// SPDX-License-Identifier: Apache-2.0
// The policy kind by sequence (PolicyBySequence: GSPO's importance_sampling kSequence, and
// geo_mean's geometric mean) in a CudaBackend Compute. A sequence's ratio R_b needs every logp
// of it before any of its rows' G, and a chunk need not hold whole sequences, so the Compute
// makes two passes over the
// chunks with the kernels the logprob kind already runs:
//   1. a forward pass: the logits GEMM and the row kernel's statistics (logp_i), no G, no
//      GEMMs after it; logp comes back to the host (4 BT bytes);
//   2. on the host, in double (row_loss_io.h's SequenceCoefficients): each sequence's R_b and
//      each row's c_i = grad_scale dloss/dlogp_i, uploaded (4 BT bytes);
//   3. the Compute's own pass, as the logprob kind with dlogp = c_i: the logits GEMM again,
//      G = c_i ([j = t] - p) in place, the dX and dW/db GEMMs.
// The logits GEMM runs twice: 8 BT H V flops against the token level's 6 (1.33x), plus one
// device synchronisation. With no gradient wanted, pass 3 is skipped: one pass, as at token
// level. The loss and metrics come from the same logp on the host (WriteRowLossOutputs).
#ifndef LOSSD_KERNELS_CUDA_POLICY_SEQUENCE_H_
#define LOSSD_KERNELS_CUDA_POLICY_SEQUENCE_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "core/loss_problem.h"
#include "kernels/cuda/chunk_plan.h"
#include "kernels/cuda/device_io.h"
#include "kernels/cuda/fused_loss.h"

namespace lossd {
namespace cuda {

// Whether `p` is the policy kind by sequence.
bool PolicySequenceLevel(const LossProblem& p);

// Whether `a` asks for any gradient (dX, dW or db).
bool WantsGradient(const DeviceLossArgs& a);

// Steps 1 and 2 above, on the engine's stream (waits for it): `a` is the Compute's arguments,
// uploaded, with its outputs allocated; afterwards a->kind is kLogprob and a->row_loss holds
// the coefficients, ready for the Compute's own Enqueue (step 3) with the same plan and
// workspace. With hooks (overlapped rows) step 1 waits for X's rows as they arrive; step 3
// finds them on the device.
absl::Status EnqueueSequenceForward(FusedLoss& engine, CallBuffers& m, const LossProblem& p,
                                    const std::vector<int32_t>& targets32,  // (BT) -1 ignored
                                    const ChunkPlan& plan, void* workspace,
                                    DeviceLossArgs* a);

}  // namespace cuda
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_POLICY_SEQUENCE_H_
