// The reference-exp configuration of cutlass_logits.h: the ping-pong kernel of
// cutlass_logits_pingpong.cu with Sm90RowRefExp as its epilogue (a file of its own so nvcc
// builds it beside the others).
#include "bench/kernel/cutlass_logits_impl.cuh"

namespace lossd {
namespace bench {

std::vector<std::unique_ptr<CutlassLogits>> MakeRefExpKernels() {
  using namespace cute;
  using K = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using E = cutlass::epilogue::TmaWarpSpecialized;
  using T = Shape<_128, _128, _64>;
  using Cl = Shape<_2, _1, _1>;
  std::vector<std::unique_ptr<CutlassLogits>> v;
  v.push_back(std::make_unique<CutlassLogitsKernel<T, Cl, K, E, 2>>("pingpong 128x128x64 c2x1 +refexp"));
  return v;
}

}  // namespace bench
}  // namespace lossd
