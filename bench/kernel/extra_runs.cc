// SPDX-License-Identifier: Apache-2.0
#include "bench/kernel/extra_runs.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/kernel/kernel_flags.h"
#include "bench/kernel/problem.h"
#include "bench/kernel/timing.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/fused_loss.h"

namespace lossd {
namespace bench {

// A moving BT: one fresh autotuning engine, each BT of the list in turn at the default budget.
// The first call of a BT is timed on the host clock (the tuning it does blocks), the calls
// after it with CUDA events; both next to how many GEMM choices that BT timed.
int RunBtSweep(const std::string& spec) {
  std::vector<std::string> hv_bts = absl::StrSplit(spec, ':');
  std::vector<std::string> hv = absl::StrSplit(hv_bts.size() == 2 ? hv_bts[0] : "", 'x');
  int64_t h = 0, v = 0;
  std::vector<int64_t> bts;
  bool ok = hv_bts.size() == 2 && hv.size() == 2 && absl::SimpleAtoi(hv[0], &h) &&
            absl::SimpleAtoi(hv[1], &v) && h > 0 && v > 0;
  for (absl::string_view b : absl::StrSplit(ok ? hv_bts[1] : "", ',', absl::SkipEmpty())) {
    int64_t bt = 0;
    ok = ok && absl::SimpleAtoi(b, &bt) && bt > 0;
    bts.push_back(bt);
  }
  if (!ok || bts.empty()) {
    std::fprintf(stderr, "bad --bt_sweep '%s' (want HxV:BT,BT,...)\n", spec.c_str());
    return 2;
  }
  auto engine = cuda::FusedLoss::Create(0);
  if (!engine.ok()) {
    std::fprintf(stderr, "%s\n", engine.status().ToString().c_str());
    return 1;
  }
  (*engine)->set_autotune(true);
  cudaStream_t stream = (*engine)->stream();
  const int64_t max_bt = *std::max_element(bts.begin(), bts.end());
  uint64_t ws_bytes = 0;
  for (int64_t bt : bts) {
    ws_bytes = std::max(ws_bytes, cuda::PlanChunks(bt, v, DType::kBF16,
                                                   cuda::DefaultChunkBudget(bt, v, DType::kBF16),
                                                   0)
                                      .workspace_bytes);
  }
  void *x, *w, *dx, *dw, *rows, *tg, *ws;
  if (AllocateProblem(max_bt, h, v, stream, &x, &w, &dx, &dw, &rows, &tg)) return 1;
  BENCH_CHECK_CUDA(cudaMalloc(&ws, ws_bytes));
  std::printf("\nA moving BT (H = %lld, V = %lld, bf16, default budget, one fresh autotuning "
              "engine, in this order)\n\n| BT | C | first call | median of the next %d | "
              "GEMM choices timed |\n|---|---|---|---|---|\n",
              static_cast<long long>(h), static_cast<long long>(v), absl::GetFlag(FLAGS_runs));
  for (int64_t bt : bts) {
    const cuda::DeviceLossArgs a = BenchProblem(bt, h, v, x, w, tg, rows, dx, dw);
    const cuda::ChunkPlan plan = cuda::PlanChunks(
        bt, v, DType::kBF16, cuda::DefaultChunkBudget(bt, v, DType::kBF16), 0);
    BENCH_CHECK_CUDA(cudaStreamSynchronize(stream));
    const int64_t tunings = (*engine)->tunings();
    const absl::Time t0 = absl::Now();
    BENCH_CHECK_OK((*engine)->Enqueue(a, plan, ws));
    BENCH_CHECK_CUDA(cudaStreamSynchronize(stream));
    const double first_ms = absl::ToDoubleMilliseconds(absl::Now() - t0);
    const int64_t timed = (*engine)->tunings() - tunings;
    double ms = 0;
    if (TimeMs(stream, 1, absl::GetFlag(FLAGS_runs),
               [&]() { return (*engine)->Enqueue(a, plan, ws); }, &ms)) {
      return 1;
    }
    std::printf("| %lld | %lld | %.2f ms | %.2f ms | %lld |\n", static_cast<long long>(bt),
                static_cast<long long>(plan.chunk_rows), first_ms, ms,
                static_cast<long long>(timed));
  }
  for (void* p : {x, w, dx, dw, rows, tg, ws}) BENCH_CHECK_CUDA(cudaFree(p));
  return 0;
}

// The backend's whole Compute from host memory: uploads of X and W, the fused op, downloads of
// dX and dW (bf16). Median of 5 after one warm-up.
int RunHostIo(int64_t bt, int64_t h, int64_t v) {
  std::vector<uint16_t> x(bt * h), w(v * h);
  uint64_t state = 12345;
  auto next = [&state]() {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return static_cast<float>(state >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f;
  };
  for (auto& e : x) e = FloatToBf16(next());
  const float a = 6.0f / std::sqrt(static_cast<float>(h));
  for (auto& e : w) e = FloatToBf16(a * next());
  std::vector<int64_t> targets(bt);
  for (int64_t i = 0; i < bt; ++i) targets[i] = (i * 7919) % v;
  std::vector<uint16_t> dx(bt * h), dw(v * h);
  float loss = 0;
  {
    auto backend = cuda::CudaBackend::Create(cuda::CudaBackendOptions{});
    if (!backend.ok()) {
      std::fprintf(stderr, "%s\n", backend.status().ToString().c_str());
      return 1;
    }
    LossProblem p;
    p.bt = bt;
    p.h = h;
    p.v = v;
    p.dtype = DType::kBF16;
    p.x = x.data();
    p.w = w.data();
    p.targets = targets.data();
    LossOutputs out;
    out.grad_dtype = DType::kBF16;
    out.loss = &loss;
    out.dx = dx.data();
    out.dw = dw.data();
    std::vector<double> secs;
    for (int i = 0; i < 6; ++i) {
      LossStats stats;
      BENCH_CHECK_OK((*backend)->Compute(p, out, &stats));
      if (i > 0) secs.push_back(stats.compute_seconds);
    }
    const double t = Median(secs);
    const double gb = 2.0 * (bt * h * 2 + v * h * 2) / 1e9;
    std::printf("host I/O %lldx%lldx%lld: Compute %.1f ms (%.2f GB moved, %.1f GB/s), "
                "loss %.4f\n",
                static_cast<long long>(bt), static_cast<long long>(h),
                static_cast<long long>(v), t * 1e3, gb, gb / t, loss);
  }
  return 0;
}

}  // namespace bench
}  // namespace lossd
