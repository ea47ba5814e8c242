// SPDX-License-Identifier: Apache-2.0
// The cooperative (two consumer warpgroups on one tile) configurations of cutlass_logits.h.
#include "bench/kernel/cutlass_logits_impl.cuh"

namespace lossd {
namespace bench {

std::vector<std::unique_ptr<CutlassLogits>> MakeCooperativeKernels() {
  using namespace cute;
  using K = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using E = cutlass::epilogue::TmaWarpSpecializedCooperative;
  using T = Shape<_128, _256, _64>;
  using Cl = Shape<_2, _1, _1>;
  std::vector<std::unique_ptr<CutlassLogits>> v;
  v.push_back(std::make_unique<CutlassLogitsKernel<T, Cl, K, E, false>>("coop 128x256x64 c2x1"));
  v.push_back(std::make_unique<CutlassLogitsKernel<T, Cl, K, E, true>>(
      "coop 128x256x64 c2x1 +stats"));
  return v;
}

}  // namespace bench
}  // namespace lossd
