// SPDX-License-Identifier: Apache-2.0
// The CUTLASS 3.x kernels behind cutlass_logits.h: one template over the tile, cluster and
// schedule, instantiated by the cutlass_logits_*.cu files (one per schedule, so nvcc compiles
// them in parallel). X is CUTLASS's A (M = C rows, K-major), W is B (N = V columns, K-major),
// z is D (row-major): the "TN" GEMM both operands' TMA loads prefer.
#ifndef LOSSD_BENCH_KERNEL_CUTLASS_LOGITS_IMPL_CUH_
#define LOSSD_BENCH_KERNEL_CUTLASS_LOGITS_IMPL_CUH_

#include <string>
#include <type_traits>

#include "bench/kernel/cutlass_logits.h"
#include "bench/kernel/row_stats_node.cuh"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

namespace lossd {
namespace bench {

// kMode: 0 plain logits, 1 logits + per-tile max and sum of exp (Sm90RowTileStats). (The
// reference-exp epilogue became the backend's: kernels/cuda/sm90/ref_exp_gemm.cu.)
template <class TileShape, class ClusterShape, class KernelSchedule, class EpilogueSchedule,
          int kMode>
class CutlassLogitsKernel final : public CutlassLogits {
  using Bf16 = cutlass::bfloat16_t;
  static constexpr int kAlign = 8;  // 16 bytes of bf16
  using Fusion = std::conditional_t<
      kMode == 1,
      cutlass::epilogue::fusion::Sm90EVT<Sm90RowTileStats<TileShape>,
                                         cutlass::epilogue::fusion::Sm90AccFetch>,
      cutlass::epilogue::fusion::LinearCombination<Bf16, float, void, float>>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void,
      cutlass::layout::RowMajor, kAlign, Bf16, cutlass::layout::RowMajor, kAlign,
      EpilogueSchedule, Fusion>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, cutlass::layout::RowMajor,
      kAlign, Bf16, cutlass::layout::ColumnMajor, kAlign, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop,
                                                      Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using Raster = typename cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Params::
      RasterOrderOptions;

 public:
  explicit CutlassLogitsKernel(std::string name) : name_(std::move(name)) {}
  std::string Name() const override { return name_; }
  int TileM() const override { return cute::size<0>(TileShape{}); }
  int TileN() const override { return cute::size<1>(TileShape{}); }
  bool Stats() const override { return kMode == 1; }

  size_t WorkspaceBytes(const CutlassLogitsArgs& a) const override {
    return Gemm::get_workspace_size(Arguments(a));
  }

  std::string Init(const CutlassLogitsArgs& a, void* workspace) override {
    typename Gemm::Arguments args = Arguments(a);
    cutlass::Status s = gemm_.can_implement(args);
    if (s != cutlass::Status::kSuccess) {
      return name_ + ": can_implement: " + cutlassGetStatusString(s);
    }
    s = gemm_.initialize(args, workspace);
    if (s != cutlass::Status::kSuccess) {
      return name_ + ": initialize: " + cutlassGetStatusString(s);
    }
    return "";
  }

  std::string Run(cudaStream_t stream) override {
    const cutlass::Status s = gemm_.run(stream);
    if (s != cutlass::Status::kSuccess) return name_ + ": run: " + cutlassGetStatusString(s);
    return "";
  }

 private:
  static typename Gemm::Arguments Arguments(const CutlassLogitsArgs& a) {
    const int m = static_cast<int>(a.c), n = static_cast<int>(a.v), k = static_cast<int>(a.h);
    using StrideA = typename Kernel::StrideA;
    using StrideB = typename Kernel::StrideB;
    using StrideC = typename Kernel::StrideC;
    using StrideD = typename Kernel::StrideD;
    cutlass::KernelHardwareInfo hw;
    hw.device_id = 0;
    hw.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(0);
    if (a.sms > 0 && a.sms < hw.sm_count) hw.sm_count = a.sms;
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {m, n, k, 1},
        {static_cast<const Bf16*>(a.x), cutlass::make_cute_packed_stride(StrideA{}, {m, k, 1}),
         static_cast<const Bf16*>(a.w), cutlass::make_cute_packed_stride(StrideB{}, {n, k, 1})},
        {{},
         nullptr,
         cutlass::make_cute_packed_stride(StrideC{}, {m, n, 1}),
         static_cast<Bf16*>(a.z),
         cutlass::make_cute_packed_stride(StrideD{}, {m, n, 1})},
        hw};
    if constexpr (kMode == 1) {
      args.epilogue.thread = {{}, {a.tile_max, a.tile_sum, a.ld}};
    } else {
      args.epilogue.thread.alpha = 1.0f;
      args.epilogue.thread.beta = 0.0f;
    }
    args.scheduler.raster_order =
        a.raster == 1 ? Raster::AlongM : a.raster == 2 ? Raster::AlongN : Raster::Heuristic;
    args.scheduler.max_swizzle_size = a.swizzle;
    return args;
  }

  std::string name_;
  Gemm gemm_;
};

}  // namespace bench
}  // namespace lossd

#endif  // LOSSD_BENCH_KERNEL_CUTLASS_LOGITS_IMPL_CUH_
