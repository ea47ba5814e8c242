// An Epilogue Visitor Tree node for CUTLASS's sm90 TMA warp-specialized epilogues that makes
// the logits GEMM write E = exp(z - ref[row]) instead of z, and for each row of a CTA tile the
// sum of E over the tile's columns. With ref[row] a logit of the row known before the GEMM (the
// target's, from a dot product), the backward needs no pass over the logits at all:
//   p = E / S with S = sum over the row of E (the tile sums combined), so
//   G = s (p - onehot) = (s / S) (E - S onehot),
// and E - S onehot differs from E in one element a row. dX = diag(s / S) (E' W) and
// dW = E'^T (diag(s / S) X) are then plain GEMMs over the stored E' (cutlass_fused_bench).
// exp is taken of the fp32 accumulator (no bf16 rounding of z first). E overflows only where a
// logit exceeds ref by more than ~88 (the combining pass sees S = inf and says so). Never
// reduces across CTA tiles: the combining pass does.
#ifndef LOSSD_BENCH_KERNEL_ROW_REF_EXP_NODE_CUH_
#define LOSSD_BENCH_KERNEL_ROW_REF_EXP_NODE_CUH_

#include "cute/tensor.hpp"
#include "cutlass/numeric_conversion.h"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"
#include "bench/kernel/row_stats_node.cuh"  // RowLanes, TileStatBlock, PartitionForRowStats

namespace lossd {
namespace bench {

// CtaTileShapeMNK: the kernel's CTA tile. Reads ref[row] (fp32, ld entries: rows past M are
// read and ignored) and writes tile_sum[n_tile * ld + row] ((ceil(N / CTA_N), ld) row-major, ld
// = M rounded up to CTA_M) for every row of every tile in the problem (L = 1).
template <class CtaTileShapeMNK>
struct Sm90RowRefExp {
  struct SharedStorage {};

  struct Arguments {
    const float* ref = nullptr;  // (ld)
    float* tile_sum = nullptr;   // (ceil(N / CTA_N), ld) row-major
    int64_t ld = 0;              // M rounded up to CTA_M (checked)
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args,
                                                  void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    auto [M, N, K, L] = cute::append<4>(problem_shape, 1);
    const int64_t tile_m = cute::size<0>(CtaTileShapeMNK{});
    return L == 1 && args.ref != nullptr &&
           args.ld == (int64_t(M) + tile_m - 1) / tile_m * tile_m;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*,
                                              cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  CUTLASS_HOST_DEVICE Sm90RowRefExp() {}
  CUTLASS_HOST_DEVICE Sm90RowRefExp(Params const& params, SharedStorage const&)
      : params(params) {}

  Params params;

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(
      cutlass::epilogue::fusion::ProducerLoadArgs<Args...> const&) {
    return cutlass::epilogue::fusion::EmptyProducerLoadCallbacks{};
  }

  template <class ArgsTuple>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(ArgsTuple&& args_tuple, Params const& params)
        : args_tuple(cute::forward<ArgsTuple>(args_tuple)), params(params) {}

    ArgsTuple args_tuple;
    Params const& params;

    template <typename ElementAccumulator, typename ElementInput, int FragmentSize>
    CUTLASS_DEVICE auto visit(cutlass::Array<ElementAccumulator, FragmentSize> const&,
                              int epi_v, int epi_m, int epi_n,
                              cutlass::Array<ElementInput, FragmentSize> const& frg_input) {
      auto& [tRref, tRsum, tCcD, residue_tCcD, gSum, lane_layout_MN, lane_mn, cD,
             residue_cD] = args_tuple;
      cute::Tensor tRref_mn = tRref(cute::_, cute::_, cute::_, epi_m, epi_n);
      cute::Tensor tRsum_mn = tRsum(cute::_, cute::_, cute::_, epi_m, epi_n);
      cute::Tensor tCcD_mn = tCcD(cute::_, cute::_, cute::_, epi_m, epi_n);
      cutlass::Array<float, FragmentSize> out;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        const int idx = epi_v * FragmentSize + i;
        const float e = __expf(float(frg_input[i]) - tRref_mn(idx));
        out[i] = e;
        if (cute::elem_less(tCcD_mn(idx), residue_tCcD)) tRsum_mn(idx) += e;
      }
      return out;
    }

    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&&, SyncFn const&, int, int, bool is_last_iteration,
                               VTensor) {
      if (!is_last_iteration) return;
      auto& [tRref, tRsum, tCcD, residue_tCcD, gSum, lane_layout_MN, lane_mn, cD,
             residue_cD] = args_tuple;
      if (!cute::elem_less(cD(cute::_0{}, cute::_0{}), residue_cD)) return;  // tile fully OOB
      // The lanes that share a row fold their sums into the lane whose N coordinate is 0, in
      // a fixed order (bit-identical reruns).
      cute::Tensor fsum = cute::filter(tRsum);
      CUTLASS_PRAGMA_UNROLL
      for (int cols = cute::size<1>(lane_layout_MN) / 2; cols > 0; cols /= 2) {
        const int delta = lane_layout_MN(cute::_0{}, cols);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < cute::size(fsum); ++i) {
          fsum(i) += __shfl_down_sync(0xFFFFFFFF, fsum(i), delta);
        }
      }
      if (cute::get<1>(lane_mn) != 0) return;
      cute::Tensor tGsum = cute::filter_zeros(gSum);
      cute::Tensor tRsum_f = cute::filter_zeros(tRsum);
      cute::Tensor tCcD_f = cute::make_tensor(tCcD.data(),
                                              cute::make_layout(tRsum_f.shape(), tCcD.stride()));
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < cute::size(tRsum_f); ++i) {
        if (cute::elem_less(tCcD_f(i), residue_tCcD)) tGsum(i) = tRsum_f(i);
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(
      cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
    using namespace cute;
    auto lanes = RowLanes<ReferenceSrc>(args);
    auto lane_layout_MN = get<0>(lanes);
    auto lane_mn = get<1>(lanes);
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    Tensor gSum = TileStatBlock(params.tile_sum, args);
    // The reference: ref[r] for every column (stride 0 along N and L).
    Tensor mRef = make_tensor(make_gmem_ptr(params.ref),
                              make_layout(make_shape(M, N, L), make_stride(_1{}, _0{}, _0{})));
    Tensor gRef = local_tile(mRef, take<0, 2>(args.tile_shape_mnk), make_coord(m, n, l));
    Tensor tGsum = PartitionForRowStats<ReferenceSrc>(gSum, args);
    Tensor tGref = PartitionForRowStats<ReferenceSrc>(gRef, args);
    Tensor tRsum = make_tensor_like<float>(tGsum);  // (CPY,CPY_M,CPY_N,EPI_M,EPI_N), 0 along N
    Tensor tRref = make_tensor_like<float>(tGref);
    fill(tRsum, 0.f);
    // One load a row this thread holds; rows past M read the padding the caller allocates.
    Tensor tGref_f = filter_zeros(tGref);
    Tensor tRref_f = filter_zeros(tRref);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(tRref_f); ++i) tRref_f(i) = tGref_f(i);

    auto args_tuple = make_tuple(cute::move(tRref), cute::move(tRsum), args.tCcD,
                                 args.residue_tCcD, tGsum, lane_layout_MN, lane_mn, args.cD,
                                 args.residue_cD);
    return ConsumerStoreCallbacks<decltype(args_tuple)>(cute::move(args_tuple), params);
  }
};

}  // namespace bench
}  // namespace lossd

#endif  // LOSSD_BENCH_KERNEL_ROW_REF_EXP_NODE_CUH_
