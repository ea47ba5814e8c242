// SPDX-License-Identifier: Apache-2.0
// An Epilogue Visitor Tree node for CUTLASS's sm90 TMA warp-specialized epilogues that makes
// the logits GEMM write E = exp(z - ref[row]) instead of z, and for each row of a CTA tile the
// sum of E over the tile's columns and the tile's largest logit (rounded to bf16) with its
// column (the row's prediction, first column on ties, once the combining pass has taken the
// best tile). With ref[row] a logit of the row known before the GEMM (the
// target's, from a dot product), the backward needs no pass over the logits at all:
//   p = E / S with S = sum over the row of E (the tile sums combined), so
//   G = s (p - onehot) = (s / S) (E - S onehot),
// and E - S onehot differs from E in one element a row. dX = diag(s / S) (E' W) and
// dW = E'^T (diag(s / S) X) are then plain GEMMs over the stored E' (fused_loss_ref_exp.cc).
// exp is taken of the fp32 accumulator (no bf16 rounding of z first). E overflows only where a
// logit exceeds ref by more than ~88 (the combining pass sees S = inf and says so). Never
// reduces across CTA tiles: the combining pass does.
#ifndef LOSSD_KERNELS_CUDA_SM90_ROW_REF_EXP_NODE_CUH_
#define LOSSD_KERNELS_CUDA_SM90_ROW_REF_EXP_NODE_CUH_

#include "cute/tensor.hpp"
#include "cutlass/bfloat16.h"
#include "cutlass/numeric_conversion.h"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"
#include "kernels/cuda/sm90/row_node_util.cuh"

namespace lossd {
namespace cuda {

// CtaTileShapeMNK: the kernel's CTA tile. Reads ref[row] (fp32, ld entries: rows past M are
// read and ignored) and writes tile_sum[n_tile * ld + row], tile_max[n_tile * ld + row] (the
// largest logit rounded to bf16) and tile_arg[n_tile * ld + row] (its first column)
// ((ceil(N / CTA_N), ld) row-major, ld = M rounded up to CTA_M) for every row of every tile in
// the problem (L = 1).
template <class CtaTileShapeMNK>
struct Sm90RowRefExp {
  struct SharedStorage {};

  struct Arguments {
    const float* ref = nullptr;  // (ld)
    float* tile_sum = nullptr;   // (ceil(N / CTA_N), ld) row-major
    float* tile_max = nullptr;   // (ceil(N / CTA_N), ld) row-major
    int32_t* tile_arg = nullptr;  // (ceil(N / CTA_N), ld) row-major
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
    return L == 1 && args.ref != nullptr && args.tile_sum != nullptr &&
           args.tile_max != nullptr && args.tile_arg != nullptr && args.ld == (int64_t(M) + tile_m - 1) / tile_m * tile_m;
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
      auto& [tRref, tRsum, tRmax, tRarg, tCcD, residue_tCcD, gSum, gMax, gArg, lane_layout_MN,
             lane_mn, cD, residue_cD, col0] = args_tuple;
      cute::Tensor tRref_mn = tRref(cute::_, cute::_, cute::_, epi_m, epi_n);
      cute::Tensor tRsum_mn = tRsum(cute::_, cute::_, cute::_, epi_m, epi_n);
      cute::Tensor tRmax_mn = tRmax(cute::_, cute::_, cute::_, epi_m, epi_n);
      cute::Tensor tRarg_mn = tRarg(cute::_, cute::_, cute::_, epi_m, epi_n);
      cute::Tensor tCcD_mn = tCcD(cute::_, cute::_, cute::_, epi_m, epi_n);
      cutlass::Array<float, FragmentSize> out;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        const int idx = epi_v * FragmentSize + i;
        const float z = float(frg_input[i]);
        const float e = __expf(z - tRref_mn(idx));
        out[i] = e;
        if (cute::elem_less(tCcD_mn(idx), residue_tCcD)) {
          tRsum_mn(idx) += e;
          // The prediction is the argmax of the logits rounded to bf16, the first column on
          // ties (whatever order the fragment visits its columns in): what the other paths
          // and the CPU backend, which store bf16 logits, predict.
          const float zb = float(cutlass::bfloat16_t(z));
          const int32_t col = col0 + int32_t(cute::get<1>(tCcD_mn(idx)));
          if (zb > tRmax_mn(idx) || (zb == tRmax_mn(idx) && col < tRarg_mn(idx))) {
            tRmax_mn(idx) = zb;
            tRarg_mn(idx) = col;
          }
        }
      }
      return out;
    }

    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&&, SyncFn const&, int, int, bool is_last_iteration,
                               VTensor) {
      if (!is_last_iteration) return;
      auto& [tRref, tRsum, tRmax, tRarg, tCcD, residue_tCcD, gSum, gMax, gArg, lane_layout_MN,
             lane_mn, cD, residue_cD, col0] = args_tuple;
      if (!cute::elem_less(cD(cute::_0{}, cute::_0{}), residue_cD)) return;  // tile fully OOB
      // The lanes that share a row fold their sums and maxima into the lane whose N
      // coordinate is 0, in a fixed order (bit-identical reruns).
      cute::Tensor fsum = cute::filter(tRsum);
      cute::Tensor fmax = cute::filter(tRmax);
      cute::Tensor farg = cute::filter(tRarg);
      CUTLASS_PRAGMA_UNROLL
      for (int cols = cute::size<1>(lane_layout_MN) / 2; cols > 0; cols /= 2) {
        const int delta = lane_layout_MN(cute::_0{}, cols);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < cute::size(fsum); ++i) {
          fsum(i) += __shfl_down_sync(0xFFFFFFFF, fsum(i), delta);
          const float m2 = __shfl_down_sync(0xFFFFFFFF, fmax(i), delta);
          const int32_t a2 = __shfl_down_sync(0xFFFFFFFF, farg(i), delta);
          if (m2 > fmax(i) || (m2 == fmax(i) && a2 < farg(i))) {
            fmax(i) = m2;
            farg(i) = a2;
          }
        }
      }
      if (cute::get<1>(lane_mn) != 0) return;
      cute::Tensor tGsum = cute::filter_zeros(gSum);
      cute::Tensor tGmax = cute::filter_zeros(gMax);
      cute::Tensor tGarg = cute::filter_zeros(gArg);
      cute::Tensor tRsum_f = cute::filter_zeros(tRsum);
      cute::Tensor tRmax_f = cute::filter_zeros(tRmax);
      cute::Tensor tRarg_f = cute::filter_zeros(tRarg);
      cute::Tensor tCcD_f = cute::make_tensor(tCcD.data(),
                                              cute::make_layout(tRsum_f.shape(), tCcD.stride()));
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < cute::size(tRsum_f); ++i) {
        if (cute::elem_less(tCcD_f(i), residue_tCcD)) {
          tGsum(i) = tRsum_f(i);
          tGmax(i) = tRmax_f(i);
          tGarg(i) = tRarg_f(i);
        }
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
    Tensor gMax = TileStatBlock(params.tile_max, args);
    Tensor gArg = TileStatBlock(params.tile_arg, args);
    // The reference: ref[r] for every column (stride 0 along N and L).
    Tensor mRef = make_tensor(make_gmem_ptr(params.ref),
                              make_layout(make_shape(M, N, L), make_stride(_1{}, _0{}, _0{})));
    Tensor gRef = local_tile(mRef, take<0, 2>(args.tile_shape_mnk), make_coord(m, n, l));
    Tensor tGsum = PartitionForRowStats<ReferenceSrc>(gSum, args);
    Tensor tGmax = PartitionForRowStats<ReferenceSrc>(gMax, args);
    Tensor tGarg = PartitionForRowStats<ReferenceSrc>(gArg, args);
    Tensor tGref = PartitionForRowStats<ReferenceSrc>(gRef, args);
    Tensor tRsum = make_tensor_like<float>(tGsum);  // (CPY,CPY_M,CPY_N,EPI_M,EPI_N), 0 along N
    Tensor tRmax = make_tensor_like<float>(tGmax);
    Tensor tRarg = make_tensor_like<int32_t>(tGarg);
    Tensor tRref = make_tensor_like<float>(tGref);
    fill(tRsum, 0.f);
    fill(tRmax, -INFINITY);
    fill(tRarg, INT32_MAX);
    // One load a row this thread holds; rows past M read the padding the caller allocates.
    Tensor tGref_f = filter_zeros(tGref);
    Tensor tRref_f = filter_zeros(tRref);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(tRref_f); ++i) tRref_f(i) = tGref_f(i);

    // tCcD holds coordinates relative to this thread's first element, and residue_tCcD is
    // (M, N) less that element's global coordinate: so its global column is N - residue's.
    const int32_t col0 = int32_t(N) - int32_t(get<1>(args.residue_tCcD));
    auto args_tuple = make_tuple(cute::move(tRref), cute::move(tRsum), cute::move(tRmax),
                                 cute::move(tRarg), args.tCcD, args.residue_tCcD, tGsum, tGmax,
                                 tGarg, lane_layout_MN, lane_mn, args.cD, args.residue_cD, col0);
    return ConsumerStoreCallbacks<decltype(args_tuple)>(cute::move(args_tuple), params);
  }
};

}  // namespace cuda
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_SM90_ROW_REF_EXP_NODE_CUH_
