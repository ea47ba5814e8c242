// SPDX-License-Identifier: Apache-2.0
#include "bench/kernel/output_checks.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "bench/kernel/bench_util.h"
#include "bench/kernel/kernel_flags.h"
#include "bench/kernel/reference_fp64.h"
#include "bench/kernel/timing.h"

namespace lossd {
namespace bench {
namespace {

// The outputs of the second run against float64, at the benchmark's own shape. Every
// schedule at the first budget is checked; the worst of each error is kept.
int CheckFp64(int64_t bt, int64_t h, int64_t v, const void* x, const void* w, const void* tg,
              void* dx, void* dw, Row* row) {
  std::string error;
  Fp64Errors e;
  if (!CompareWithFp64(bt, h, v, x, w, static_cast<const int32_t*>(tg), row->mean_loss,
                       dx, static_cast<const float*>(dw), 2048, &e, &error)) {
    std::fprintf(stderr, "float64 reference: %s\n", error.c_str());
    return 1;
  }
  if (row->checked_fp64) {
    e.loss_rel = std::max(e.loss_rel, row->fp64.loss_rel);
    e.dx_rel_norm = std::max(e.dx_rel_norm, row->fp64.dx_rel_norm);
    e.dw_rel_norm = std::max(e.dw_rel_norm, row->fp64.dw_rel_norm);
  }
  row->fp64 = e;
  row->checked_fp64 = true;
  return 0;
}

}  // namespace

int CheckOutputs(cuda::FusedLoss& engine, const cuda::DeviceLossArgs& a,
                 const cuda::ChunkPlan& plan, void* ws, int64_t bt, int64_t h, int64_t v,
                 const void* x, const void* w, const void* tg, void* dx, void* dw, Row* row) {
  cudaStream_t stream = engine.stream();
  // Determinism at full size: two runs, dX and dW compared word for word.
  void *dx0, *dw0;
  unsigned long long* count;
  BENCH_CHECK_CUDA(cudaMalloc(&dx0, bt * h * 2));
  BENCH_CHECK_CUDA(cudaMalloc(&dw0, v * h * 4));
  BENCH_CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&count), sizeof(*count)));
  BENCH_CHECK_OK(engine.Enqueue(a, plan, ws));
  BENCH_CHECK_CUDA(cudaMemcpyAsync(dx0, dx, bt * h * 2, cudaMemcpyDeviceToDevice, stream));
  BENCH_CHECK_CUDA(cudaMemcpyAsync(dw0, dw, v * h * 4, cudaMemcpyDeviceToDevice, stream));
  BENCH_CHECK_CUDA(cudaMemsetAsync(dx, 0xFF, bt * h * 2, stream));
  BENCH_CHECK_CUDA(cudaMemsetAsync(dw, 0xFF, v * h * 4, stream));
  BENCH_CHECK_OK(engine.Enqueue(a, plan, ws));
  unsigned long long m1 = 0, m2 = 0;
  BENCH_CHECK_CUDA(CountMismatches(dx0, dx, bt * h / 2, count, stream));
  BENCH_CHECK_CUDA(cudaMemcpyAsync(&m1, count, sizeof(m1), cudaMemcpyDeviceToHost, stream));
  BENCH_CHECK_CUDA(cudaStreamSynchronize(stream));
  BENCH_CHECK_CUDA(CountMismatches(dw0, dw, v * h, count, stream));
  BENCH_CHECK_CUDA(cudaMemcpyAsync(&m2, count, sizeof(m2), cudaMemcpyDeviceToHost, stream));
  BENCH_CHECK_CUDA(cudaStreamSynchronize(stream));
  row->deterministic = row->deterministic && m1 == 0 && m2 == 0;
  std::vector<float> ce(bt);
  BENCH_CHECK_CUDA(cudaMemcpy(ce.data(), a.row_ce, bt * 4, cudaMemcpyDeviceToHost));
  double sum = 0;
  for (float c : ce) sum += c;
  row->mean_loss = sum / static_cast<double>(bt);
  if (absl::GetFlag(FLAGS_check_fp64) && CheckFp64(bt, h, v, x, w, tg, dx, dw, row)) return 1;
  cudaFree(dx0);
  cudaFree(dw0);
  cudaFree(count);
  return 0;
}

}  // namespace bench
}  // namespace lossd
