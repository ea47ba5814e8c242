// SPDX-License-Identifier: Apache-2.0
#include "kernels/cuda/policy_sequence.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "core/loss_problem.h"
#include "core/status_macros.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/row_loss_io.h"

namespace lossd {
namespace cuda {

bool PolicySequenceLevel(const LossProblem& p) {
  return p.kind == LossKind::kPolicy && PolicyBySequence(p.policy);
}

bool WantsGradient(const DeviceLossArgs& a) {
  return a.dx != nullptr || a.dw_acc != nullptr || a.db_acc != nullptr;
}

absl::Status EnqueueSequenceForward(FusedLoss& engine, CallBuffers& m, const LossProblem& p,
                                    const std::vector<int32_t>& targets32,
                                    const ChunkPlan& plan, void* workspace,
                                    DeviceLossArgs* a) {
  // Step 1: the logprob kind with no coefficients and no gradient outputs is its statistics
  // only (write_grad 0: the logits are left as they are, no dX or dW GEMM runs).
  DeviceLossArgs forward = *a;
  forward.kind = LossKind::kLogprob;
  forward.row_loss = RowLossInputs();
  forward.dx = nullptr;
  forward.dw_acc = nullptr;
  forward.db_acc = nullptr;
  forward.accumulate_dw = false;
  forward.accumulate_db = false;
  LOSSD_RETURN_IF_ERROR(engine.Enqueue(forward, plan, workspace));
  std::vector<float> logp(p.bt);
  LOSSD_RETURN_IF_ERROR(m.Download(logp.data(), a->row_ce, static_cast<uint64_t>(p.bt) * 4));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(m.stream()));
  // Step 2. Pass 3 writes the row statistics again from the same logits: the loss and metrics
  // are reduced from those (WriteRowLossOutputs), the gradient's coefficients from these.
  a->kind = LossKind::kLogprob;
  return UploadSequenceCoefficients(m, SequenceCoefficients(p, targets32, logp),
                                    EntropyCoefficients(p, targets32), &a->row_loss);
}

}  // namespace cuda
}  // namespace lossd
