// SPDX-License-Identifier: Apache-2.0
// kinds_bench's policy rows beyond the kind's own (kinds_bench_shape.h).
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "bench/kernel/bench_util.h"
#include "bench/kernel/kernel_flags.h"
#include "bench/kernel/kinds_bench_shape.h"
#include "bench/kernel/kinds_table.h"
#include "bench/kernel/timing.h"
#include "core/loss_problem.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device_io.h"
#include "kernels/cuda/fused_loss.h"
#include "kernels/cuda/policy_sequence.h"
#include "kernels/policy_math.h"

namespace lossd {
namespace bench {

int RunPolicyVerl(cuda::CudaBackend& backend, cuda::FusedLoss& engine,
                  cuda::FusedLoss& floor_engine, const ShapeBuffers& b, KindRow* row,
                  bool* finite) {
  cuda::DeviceLossArgs a = ArgsOf(LossKind::kPolicy, b, absl::GetFlag(FLAGS_temperature));
  a.row_loss.policy.kl_estimator = policy_math::kK2;
  a.row_loss.policy.entropy_coeff = 0.01f;
  a.row_loss.coef_entropy = b.policy_entropy;
  if (RunKind(backend, engine, floor_engine, LossKind::kPolicy, b, row, finite, &a)) return 1;
  row->kind = "policy_verl";
  return 0;
}

// EnqueueSequenceForward (the forward pass, logp to the host, the coefficients uploaded), then
// the gradient pass, as CudaBackend::Compute runs them.
int RunPolicySequence(cuda::CudaBackend& backend, cuda::FusedLoss& engine,
                      cuda::FusedLoss& floor_engine, const ShapeBuffers& b, int64_t seq,
                      PolicyLossType type, KindRow* row) {
  cudaStream_t stream = engine.stream();
  std::vector<float> adv(b.bt), old(b.bt), ref(b.bt);
  std::vector<int32_t> targets32(b.bt);
  BENCH_CHECK_CUDA(cudaMemcpy(adv.data(), b.advantages, b.bt * 4, cudaMemcpyDeviceToHost));
  BENCH_CHECK_CUDA(cudaMemcpy(old.data(), b.old_logp, b.bt * 4, cudaMemcpyDeviceToHost));
  BENCH_CHECK_CUDA(cudaMemcpy(ref.data(), b.ref_logp, b.bt * 4, cudaMemcpyDeviceToHost));
  BENCH_CHECK_CUDA(cudaMemcpy(targets32.data(), b.tg, b.bt * 4, cudaMemcpyDeviceToHost));
  LossProblem p;
  p.bt = b.bt, p.h = b.h, p.v = b.v;
  p.kind = LossKind::kPolicy;
  p.advantages = adv.data();
  p.old_logp = old.data();
  p.ref_logp = ref.data();
  p.policy.sequences = b.bt / seq;
  p.policy.loss_type = type;  // the others by group at token level (PolicyBySequence)
  p.policy.importance_sampling = type == PolicyLossType::kDapo ? ImportanceSampling::kSequence
                                                               : ImportanceSampling::kToken;
  const cuda::ChunkPlan plan = backend.Plan(ShapeFor(LossKind::kPolicy, b));
  void* ws = nullptr;
  BENCH_CHECK_CUDA(cudaMalloc(&ws, plan.workspace_bytes));
  std::vector<std::unique_ptr<BackendBuffer>> held;
  cuda::CallBuffers m([&backend](uint64_t n) { return backend.Allocate(n); }, &held, stream);
  const float temperature = static_cast<float>(absl::GetFlag(FLAGS_temperature));
  std::vector<std::function<absl::Status()>> bodies = {
      [&]() { return Floor(floor_engine, stream, b, false, false); },
      [&]() { return Floor(engine, stream, b, false, false); },
      [&]() -> absl::Status {
        cuda::DeviceLossArgs a = ArgsOf(LossKind::kPolicy, b, temperature);
        absl::Status s = cuda::EnqueueSequenceForward(engine, m, p, targets32, plan, ws, &a);
        return s.ok() ? engine.Enqueue(a, plan, ws) : s;
      }};
  std::vector<double> ms;
  if (TimeRoundsMs(stream, absl::GetFlag(FLAGS_warmup), absl::GetFlag(FLAGS_runs), bodies,
                   &ms)) {
    return 1;
  }
  BENCH_CHECK_CUDA(cudaDeviceSynchronize());
  BENCH_CHECK_CUDA(cudaFree(ws));
  row->bt = b.bt, row->h = b.h, row->v = b.v;
  row->kind = type == PolicyLossType::kDapo ? std::string("policy_seq")
                                            : std::string("policy_") + PolicyLossTypeName(type);
  row->chunk_rows = plan.chunk_rows;
  row->schedule = static_cast<int>(plan.schedule);
  row->workspace = plan.workspace_bytes;
  row->flop = 6.0 * b.bt * b.v * b.h;
  row->floor_ms = ms[0], row->tuned_floor_ms = ms[1], row->ms = ms[2];
  std::fprintf(stderr, "  %lldx%lldx%lld %s (S %lld): C=%lld %.2f ms (floor %.2f)\n",
               static_cast<long long>(b.bt), static_cast<long long>(b.h),
               static_cast<long long>(b.v), row->kind.c_str(), static_cast<long long>(seq),
               static_cast<long long>(plan.chunk_rows), row->ms, row->floor_ms);
  return 0;
}

}  // namespace bench
}  // namespace lossd
