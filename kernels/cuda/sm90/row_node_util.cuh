// SPDX-License-Identifier: Apache-2.0
// What the row-statistics Epilogue Visitor Tree nodes of CUTLASS's sm90 TMA warp-specialized
// epilogues share (row_ref_exp_node.cuh here, bench/kernel/row_stats_node.cuh): which lanes of
// a warp hold one row, where a CTA tile's per-row statistics live, and a thread's share of
// them. nvcc only (sm_90a), over CUTLASS's headers.
#ifndef LOSSD_KERNELS_CUDA_SM90_ROW_NODE_UTIL_CUH_
#define LOSSD_KERNELS_CUDA_SM90_ROW_NODE_UTIL_CUH_

#include "cute/tensor.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"

namespace lossd {
namespace cuda {

// Which lanes of a warp share a row of the tiled copy (its thread-value layout mapped to
// lanes), and this lane's place in that layout: (lane_layout_MN, lane_mn). A row's lanes fold
// their states with shuffles over it, so no row may span two warps: true of the wgmma layouts
// (a warp owns 16 rows of every 64) that the tiles tried here use.
template <bool ReferenceSrc, class StoreArgs>
CUTLASS_DEVICE auto RowLanes(StoreArgs const& args) {
  using namespace cute;
  Layout ref_layout_MN = [&]() {
    auto mn_shape = shape(typename decltype(args.tiled_copy)::Tiler_MN{});
    if constexpr (ReferenceSrc) {
      return right_inverse(args.tiled_copy.get_layoutS_TV()).with_shape(mn_shape);
    } else {
      return right_inverse(args.tiled_copy.get_layoutD_TV()).with_shape(mn_shape);
    }
  }();
  using W = Int<decltype(args.tiled_copy)::TiledNumThr::value / cutlass::NumThreadsPerWarp>;
  Layout tv2lane = Layout<Shape<Int<cutlass::NumThreadsPerWarp>, W, _1>, Stride<_1, _0, _0>>{};
  Layout ref2lane = composition(tv2lane, ref_layout_MN);
  Layout lane_layout_MN = make_layout(filter(get<0>(ref2lane)), filter(get<1>(ref2lane)));
  Layout inv_lane_layout_MN = right_inverse(lane_layout_MN);
  auto lane_mn = idx2crd(inv_lane_layout_MN(cutlass::canonical_lane_idx()),
                         shape(lane_layout_MN));
  Layout tv2warp = Layout<Shape<Int<cutlass::NumThreadsPerWarp>, W, _1>, Stride<_0, _1, _0>>{};
  Layout ref2warp = composition(tv2warp, ref_layout_MN);
  static_assert(decltype(size(filter(get<1>(ref2warp))))::value <= 1,
                "a row statistics node: more than one warp shares a row");
  return make_tuple(lane_layout_MN, lane_mn);
}

// This CTA tile's block of a per-(row, column tile) statistic at `base`: compact and M-major,
// stride 0 along N inside a tile, so every column of row r in tile n lands on base[n * ld + r],
// ld = M rounded up to CTA_M.
template <class T, class StoreArgs>
CUTLASS_DEVICE auto TileStatBlock(T* base, StoreArgs const& args) {
  using namespace cute;
  auto [M, N, K, L] = args.problem_shape_mnkl;
  auto [m, n, k, l] = args.tile_coord_mnkl;
  Layout tile_layout = make_layout(take<0, 2>(args.tile_shape_mnk), make_stride(_1{}, _0{}));
  Layout all_layout = blocked_product(
      tile_layout, make_layout(ceil_div(make_shape(M, N, L), shape(tile_layout))));
  return local_tile(make_tensor(make_gmem_ptr(base), all_layout),
                    take<0, 2>(args.tile_shape_mnk), make_coord(m, n, l));
}

// A global tile partitioned as this thread's share of the epilogue's subtiles.
template <bool ReferenceSrc, class GTensor, class StoreArgs>
CUTLASS_DEVICE auto PartitionForRowStats(GTensor const& g, StoreArgs const& args) {
  return cutlass::epilogue::fusion::sm90_partition_for_epilogue<ReferenceSrc>(
      g, args.epi_tile, args.tiled_copy, args.thread_idx);
}

}  // namespace cuda
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_SM90_ROW_NODE_UTIL_CUH_
