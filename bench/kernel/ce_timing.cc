// SPDX-License-Identifier: Apache-2.0
#include "bench/kernel/ce_timing.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/kernel/kernel_flags.h"
#include "bench/kernel/timing.h"
#include "kernels/cuda/ce_kernels.h"

namespace lossd {
namespace bench {

namespace {

// --ce_cols: the one-read kernel at each of the column limits it lists (set in *cols, which
// `ce_only` reads), then `copy`, a device copy of the same bytes. 0, or 1 on a failure or a bad
// entry.
int TimeCeColumns(cudaStream_t stream, int runs, int64_t bt, int64_t h, int64_t v,
                  int64_t chunk_rows, void* z, const std::function<absl::Status()>& ce_only,
                  const std::function<absl::Status()>& copy, int32_t* cols) {
  for (absl::string_view c : absl::StrSplit(absl::GetFlag(FLAGS_ce_cols), ',', absl::SkipEmpty())) {
    if (!absl::SimpleAtoi(c, cols)) {
      std::fprintf(stderr, "bad --ce_cols entry\n");
      return 1;
    }
    double ms = 0;
    cuda::CrossEntropyParams probe{};
    probe.logits = z;
    probe.rows = std::min(chunk_rows, bt);
    probe.v = v;
    probe.one_read_cols = *cols;
    const int k = cuda::CrossEntropyCluster(probe);
    if (TimeMs(stream, 1, runs, ce_only, &ms)) return 1;
    std::fprintf(stderr, "  %lldx%lldx%lld CE one-read, at most %d columns a block (%d blocks a "
                 "row): %.2f ms\n",
                 static_cast<long long>(bt), static_cast<long long>(h), static_cast<long long>(v),
                 *cols, k, ms);
  }
  if (!absl::GetFlag(FLAGS_ce_cols).empty()) {
    // What the memory system gives a plain read + write of the same bytes (logits in, the
    // gradient out): the one-read kernel's floor.
    double ms = 0;
    if (TimeMs(stream, 1, runs, copy, &ms)) return 1;
    std::fprintf(stderr, "  %lldx%lldx%lld device copy of the same bytes: %.2f ms (%.2f TB/s "
                 "read + write)\n",
                 static_cast<long long>(bt), static_cast<long long>(h), static_cast<long long>(v),
                 ms, 2.0 * bt * v * 2 / (ms * 1e-3) / 1e12);
  }
  return 0;
}

}  // namespace

// The cross-entropy kernels alone over the chunks of `chunk_rows` rows, both kernels: the
// one-read kernel where it applies (row->ce_ms) and the two-pass kernel (row->ce_two_pass_ms),
// over real logits in z (C x V bf16; gws is a GEMM workspace).
int TimeCrossEntropy(cuda::FusedLoss& engine, const cuda::DeviceLossArgs& a, int64_t bt,
                     int64_t h, int64_t v, int64_t chunk_rows, const void* w, const void* x,
                     void* z, void* gws, uint64_t gws_bytes, Row* row) {
  cudaStream_t stream = engine.stream();
  const int runs = absl::GetFlag(FLAGS_runs);
  bool two_pass = false;
  int32_t cols = 0;
  auto ce_only = [&]() -> absl::Status {
    for (int64_t c0 = 0; c0 < bt; c0 += chunk_rows) {
      cuda::CrossEntropyParams p{};
      p.two_pass = two_pass ? 1 : 0;
      p.one_read_cols = cols;
      p.logits = z;
      p.elem = cuda::kElemBF16;
      p.rows = std::min(chunk_rows, bt - c0);
      p.v = v;
      p.targets = a.targets + c0;
      p.ce_scale = 1.0f / bt;
      p.class_weight_sum = static_cast<float>(v);
      p.softcap = static_cast<float>(absl::GetFlag(FLAGS_ce_softcap));
      p.label_smoothing = static_cast<float>(absl::GetFlag(FLAGS_ce_smoothing));
      p.write_grad = 1;
      p.row_lse = a.row_lse + c0;
      p.row_ce = a.row_ce + c0;
      p.row_z = a.row_z + c0;
      p.row_pred = a.row_pred + c0;
      if (c0 == 0 && !two_pass) row->ce_cluster = cuda::CrossEntropyCluster(p);
      const cudaError_t e = cuda::LaunchCrossEntropy(p, stream);
      if (e != cudaSuccess) return absl::InternalError(cudaGetErrorString(e));
    }
    return absl::OkStatus();
  };
  // Real logits in the buffer first, so the kernel sees realistic values.
  BENCH_CHECK_OK(engine.Gemm(stream, gws, gws_bytes, true, false, v, std::min(chunk_rows, bt), h,
                             1.0f, w, h, x, h, CUDA_R_16BF, 0.0f, z, v, CUDA_R_16BF));
  if (TimeMs(stream, 1, runs, ce_only, &row->ce_ms)) return 1;
  // A device copy of the same logits, read and written once, chunk by chunk: what moving the
  // CE's bytes costs at the least (timed with --ce_cols, its energy with --energy_seconds).
  void* copy_dst = nullptr;
  if (g_meter != nullptr || !absl::GetFlag(FLAGS_ce_cols).empty()) {
    BENCH_CHECK_CUDA(
        cudaMalloc(&copy_dst, static_cast<size_t>(std::min(chunk_rows, bt)) * v * 2));
  }
  auto copy = [&]() -> absl::Status {
    for (int64_t c0 = 0; c0 < bt; c0 += chunk_rows) {
      const size_t n = static_cast<size_t>(std::min(chunk_rows, bt - c0)) * v * 2;
      const cudaError_t e = cudaMemcpyAsync(copy_dst, z, n, cudaMemcpyDeviceToDevice, stream);
      if (e != cudaSuccess) return absl::InternalError(cudaGetErrorString(e));
    }
    return absl::OkStatus();
  };
  const std::string shape = absl::StrFormat("%dx%dx%d", bt, h, v);
  if (MeasureEnergy(stream, shape + " CE kernels alone (one-read)", ce_only) ||
      MeasureEnergy(stream, shape + " device copy of the CE's bytes", copy)) {
    return 1;
  }
  two_pass = true;
  if (TimeMs(stream, 1, runs, ce_only, &row->ce_two_pass_ms)) return 1;
  two_pass = false;
  if (TimeCeColumns(stream, runs, bt, h, v, chunk_rows, z, ce_only, copy, &cols)) return 1;
  if (copy_dst != nullptr) BENCH_CHECK_CUDA(cudaFree(copy_dst));
  return 0;
}

}  // namespace bench
}  // namespace lossd
