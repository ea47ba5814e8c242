// SPDX-License-Identifier: Apache-2.0
// The ping-pong (two consumer warpgroups on alternate tiles, one's epilogue under the other's
// mainloop) configurations of cutlass_logits.h.
#include "bench/kernel/cutlass_logits_impl.cuh"

namespace lossd {
namespace bench {

std::vector<std::unique_ptr<CutlassLogits>> MakePingpongKernels() {
  using namespace cute;
  using K = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using E = cutlass::epilogue::TmaWarpSpecialized;
  using T = Shape<_128, _128, _64>;
  using Cl = Shape<_2, _1, _1>;
  std::vector<std::unique_ptr<CutlassLogits>> v;
  v.push_back(std::make_unique<CutlassLogitsKernel<T, Cl, K, E, false>>("pingpong 128x128x64 c2x1"));
  v.push_back(std::make_unique<CutlassLogitsKernel<T, Cl, K, E, true>>(
      "pingpong 128x128x64 c2x1 +stats"));
  return v;
}

}  // namespace bench
}  // namespace lossd
