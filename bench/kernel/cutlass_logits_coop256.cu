// SPDX-License-Identifier: Apache-2.0
// The cooperative configurations with 256-row tiles (each consumer warpgroup 128 rows) of
// cutlass_logits.h; a file of their own so nvcc compiles them beside the others.
#include "bench/kernel/cutlass_logits_impl.cuh"

namespace lossd {
namespace bench {

std::vector<std::unique_ptr<CutlassLogits>> MakeCooperative256Kernels() {
  using namespace cute;
  using K = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using E = cutlass::epilogue::TmaWarpSpecializedCooperative;
  using T = Shape<_256, _128, _64>;
  using Cl = Shape<_1, _2, _1>;
  std::vector<std::unique_ptr<CutlassLogits>> v;
  v.push_back(std::make_unique<CutlassLogitsKernel<T, Cl, K, E, false>>("coop 256x128x64 c1x2"));
  v.push_back(std::make_unique<CutlassLogitsKernel<T, Cl, K, E, true>>(
      "coop 256x128x64 c1x2 +stats"));
  return v;
}

}  // namespace bench
}  // namespace lossd
