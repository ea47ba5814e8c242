// SPDX-License-Identifier: Apache-2.0
// The reference-exp logits GEMM of ref_exp_gemm.h as a CUTLASS 3.x sm_90a kernel: X is
// CUTLASS's A (M = c rows, K-major), W is B (N = v columns, K-major), E is D (row-major), the
// "TN" GEMM both operands' TMA loads prefer; a ping-pong warp-specialized 128 x 128 x 64 tile
// with 2 x 1 clusters, the configuration bench/RESULTS.md measured fastest with this epilogue.
#include <memory>
#include <string>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "kernels/cuda/ref_exp_gemm.h"
#include "kernels/cuda/sm90/row_ref_exp_node.cuh"

namespace lossd {
namespace cuda {
namespace {

using Bf16 = cutlass::bfloat16_t;
constexpr int kAlign = 8;  // 16 bytes of bf16
using TileShape = cute::Shape<cute::Int<kRefExpTileM>, cute::Int<kRefExpTileN>, cute::_64>;
using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
using Fusion = cutlass::epilogue::fusion::Sm90EVT<Sm90RowRefExp<TileShape>,
                                                  cutlass::epilogue::fusion::Sm90AccFetch>;
using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void,
    cutlass::layout::RowMajor, kAlign, Bf16, cutlass::layout::RowMajor, kAlign,
    cutlass::epilogue::TmaWarpSpecialized, Fusion>::CollectiveOp;
using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, cutlass::layout::RowMajor, kAlign,
    Bf16, cutlass::layout::ColumnMajor, kAlign, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::KernelTmaWarpSpecializedPingpong>::CollectiveOp;
using Kernel =
    cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
using Raster =
    typename cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Params::RasterOrderOptions;

class Sm90RefExpGemm final : public RefExpGemm {
 public:
  Sm90RefExpGemm() {
    int dev = 0;
    cudaGetDevice(&dev);
    sm_count_ = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(dev);
    device_ = dev;
  }

  size_t WorkspaceBytes(const RefExpGemmArgs& a) override {
    return Gemm::get_workspace_size(Arguments(a));
  }

  std::string Run(const RefExpGemmArgs& a, void* workspace, cudaStream_t stream) override {
    typename Gemm::Arguments args = Arguments(a);
    cutlass::Status s = gemm_.can_implement(args);
    if (s != cutlass::Status::kSuccess) {
      return std::string("reference-exp GEMM: can_implement: ") + cutlassGetStatusString(s);
    }
    s = gemm_.initialize(args, workspace, stream);
    if (s == cutlass::Status::kSuccess) s = gemm_.run(stream);
    if (s != cutlass::Status::kSuccess) {
      return std::string("reference-exp GEMM: ") + cutlassGetStatusString(s);
    }
    return "";
  }

 private:
  typename Gemm::Arguments Arguments(const RefExpGemmArgs& a) const {
    const int m = static_cast<int>(a.c), n = static_cast<int>(a.v), k = static_cast<int>(a.h);
    cutlass::KernelHardwareInfo hw;
    hw.device_id = device_;
    hw.sm_count = sm_count_;
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {m, n, k, 1},
        {static_cast<const Bf16*>(a.x),
         cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, {m, k, 1}),
         static_cast<const Bf16*>(a.w),
         cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, {n, k, 1})},
        {{},
         nullptr,
         cutlass::make_cute_packed_stride(typename Kernel::StrideC{}, {m, n, 1}),
         static_cast<Bf16*>(a.e),
         cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, {m, n, 1})},
        hw};
    args.epilogue.thread = {{}, {a.ref, a.tile_sum, a.tile_max, a.tile_arg, a.ld}};
    // Along M with swizzle 1: consecutive CTAs share a band of W, which the chunk's rows all
    // read (the order bench/RESULTS.md measured with this kernel).
    args.scheduler.raster_order = Raster::AlongM;
    args.scheduler.max_swizzle_size = 1;
    return args;
  }

  int device_ = 0;
  int sm_count_ = 0;
  Gemm gemm_;
};

}  // namespace

std::unique_ptr<RefExpGemm> MakeRefExpGemm() { return std::make_unique<Sm90RefExpGemm>(); }

}  // namespace cuda
}  // namespace lossd
