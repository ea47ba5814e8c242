// SPDX-License-Identifier: Apache-2.0
// An Epilogue Visitor Tree node for CUTLASS's sm90 TMA warp-specialized epilogues: for each
// row of a CTA tile it writes the max and the sum of exp(z - max) over the tile's columns, so a
// later pass combines per-tile statistics instead of reading the logits again. The statistics
// are taken over the values the epilogue stores (the accumulator rounded to bf16), which are
// what a cross-entropy pass reading the stored logits would see. It passes its input through
// unchanged; the parent (the collective's store) writes the bf16 logits. Never reduces across
// CTA tiles: that is the combining pass's job.
#ifndef LOSSD_BENCH_KERNEL_ROW_STATS_NODE_CUH_
#define LOSSD_BENCH_KERNEL_ROW_STATS_NODE_CUH_

#include "cute/tensor.hpp"
#include "cutlass/bfloat16.h"
#include "cutlass/numeric_conversion.h"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"
#include "kernels/cuda/sm90/row_node_util.cuh"  // RowLanes, TileStatBlock, PartitionForRowStats

namespace lossd {
namespace bench {

using cuda::PartitionForRowStats;
using cuda::RowLanes;
using cuda::TileStatBlock;

// (max, sum of exp(z - max)) of one row over some columns; the empty state is (-inf, 0).
struct RowStat {
  float m, s;
};

// Merges (m2, s2) into (m, s); two empty states stay empty (no -inf - -inf).
__device__ __forceinline__ void RowStatMerge(float& m, float& s, float m2, float s2) {
  const float mx = fmaxf(m, m2);
  if (mx == -INFINITY) return;
  s = s * __expf(m - mx) + s2 * __expf(m2 - mx);
  m = mx;
}

// CtaTileShapeMNK: the kernel's CTA tile. Writes tile_max[n_tile * ld + row] and
// tile_sum[n_tile * ld + row] (fp32, (ceil(N / CTA_N), ld) row-major, ld = M rounded up to
// CTA_M) for every row of every tile in the problem (L = 1).
template <class CtaTileShapeMNK>
struct Sm90RowTileStats {
  struct SharedStorage {};

  struct Arguments {
    float* tile_max = nullptr;  // (ceil(N / CTA_N), ld) row-major
    float* tile_sum = nullptr;  // (ceil(N / CTA_N), ld) row-major
    int64_t ld = 0;             // M rounded up to CTA_M (checked)
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
    return L == 1 && args.ld == (int64_t(M) + tile_m - 1) / tile_m * tile_m;
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

  CUTLASS_HOST_DEVICE Sm90RowTileStats() {}
  CUTLASS_HOST_DEVICE Sm90RowTileStats(Params const& params, SharedStorage const&)
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
      auto& [tRmax, tRsum, tCcD, residue_tCcD, gMax, gSum, lane_layout_MN, lane_mn, epi_tile,
             tiled_copy, thread_idx, cD, residue_cD] = args_tuple;
      cute::Tensor tRmax_mn = tRmax(cute::_, cute::_, cute::_, epi_m, epi_n);
      cute::Tensor tRsum_mn = tRsum(cute::_, cute::_, cute::_, epi_m, epi_n);
      cute::Tensor tCcD_mn = tCcD(cute::_, cute::_, cute::_, epi_m, epi_n);
      // Two passes over the fragment instead of one online update a value: the new maxima
      // first (independent fmax), one rescale a row, then independent exponentials whose sum
      // is the only chain. An online update a value chained an exp, a compare and a
      // select per value on the same registers, which the epilogue could not
      // hide where K is short (the first version measured so: bench/RESULTS.md).
      cute::Tensor fmax = cute::filter(tRmax_mn);  // this subtile's rows, one register each
      cute::Tensor fsum = cute::filter(tRsum_mn);
      constexpr int kRows = decltype(cute::size(fmax))::value;
      float old_max[kRows];
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < kRows; ++r) old_max[r] = fmax(r);
      float z[FragmentSize];
      bool in[FragmentSize];
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        const int idx = epi_v * FragmentSize + i;
        in[i] = cute::elem_less(tCcD_mn(idx), residue_tCcD);
        // The value the store will write: statistics of the stored logits.
        z[i] = float(cutlass::bfloat16_t(float(frg_input[i])));
        if (in[i]) tRmax_mn(idx) = fmaxf(tRmax_mn(idx), z[i]);
      }
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < kRows; ++r) {
        // Equal maxima (the -inf of an untouched row included) need no rescale.
        if (old_max[r] != fmax(r)) fsum(r) *= __expf(old_max[r] - fmax(r));
      }
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        const int idx = epi_v * FragmentSize + i;
        if (in[i]) tRsum_mn(idx) += __expf(z[i] - tRmax_mn(idx));
      }
      return frg_input;
    }

    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&&, SyncFn const&, int, int, bool is_last_iteration,
                               VTensor) {
      if (!is_last_iteration) return;
      auto& [tRmax, tRsum, tCcD, residue_tCcD, gMax, gSum, lane_layout_MN, lane_mn, epi_tile,
             tiled_copy, thread_idx, cD, residue_cD] = args_tuple;
      if (!cute::elem_less(cD(cute::_0{}, cute::_0{}), residue_cD)) return;  // tile fully OOB
      // The lanes that share a row (the wgmma accumulator spreads a row over one quad) fold
      // their states into the lane whose N coordinate is 0.
      cute::Tensor fmax = cute::filter(tRmax);
      cute::Tensor fsum = cute::filter(tRsum);
      CUTLASS_PRAGMA_UNROLL
      for (int cols = cute::size<1>(lane_layout_MN) / 2; cols > 0; cols /= 2) {
        const int delta = lane_layout_MN(cute::_0{}, cols);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < cute::size(fmax); ++i) {
          const float m2 = __shfl_down_sync(0xFFFFFFFF, fmax(i), delta);
          const float s2 = __shfl_down_sync(0xFFFFFFFF, fsum(i), delta);
          RowStatMerge(fmax(i), fsum(i), m2, s2);
        }
      }
      if (cute::get<1>(lane_mn) != 0) return;
      cute::Tensor tGmax = cute::filter_zeros(gMax);
      cute::Tensor tGsum = cute::filter_zeros(gSum);
      cute::Tensor tRmax_f = cute::filter_zeros(tRmax);
      cute::Tensor tRsum_f = cute::filter_zeros(tRsum);
      cute::Tensor tCcD_f = cute::make_tensor(tCcD.data(),
                                              cute::make_layout(tRmax_f.shape(), tCcD.stride()));
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < cute::size(tRmax_f); ++i) {
        if (cute::elem_less(tCcD_f(i), residue_tCcD)) {
          tGmax(i) = tRmax_f(i);
          tGsum(i) = tRsum_f(i);
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
    Tensor gMax = TileStatBlock(params.tile_max, args);
    Tensor gSum = TileStatBlock(params.tile_sum, args);
    Tensor tGmax = PartitionForRowStats<ReferenceSrc>(gMax, args);
    Tensor tGsum = PartitionForRowStats<ReferenceSrc>(gSum, args);
    Tensor tRmax = make_tensor_like<float>(tGmax);  // (CPY,CPY_M,CPY_N,EPI_M,EPI_N), 0 along N
    Tensor tRsum = make_tensor_like<float>(tGsum);
    fill(tRmax, -INFINITY);
    fill(tRsum, 0.f);

    auto args_tuple = make_tuple(cute::move(tRmax), cute::move(tRsum), args.tCcD,
                                 args.residue_tCcD, tGmax, tGsum, lane_layout_MN, lane_mn,
                                 args.epi_tile, args.tiled_copy, args.thread_idx, args.cD,
                                 args.residue_cD);
    return ConsumerStoreCallbacks<decltype(args_tuple)>(cute::move(args_tuple), params);
  }
};

}  // namespace bench
}  // namespace lossd

#endif  // LOSSD_BENCH_KERNEL_ROW_STATS_NODE_CUH_
