// SPDX-License-Identifier: Apache-2.0
#include "bench/kernel/fused_run.h"

#include <cuda_runtime_api.h>

#include <cstdio>
#include <functional>
#include <string>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "bench/kernel/ce_timing.h"
#include "bench/kernel/floor.h"
#include "bench/kernel/kernel_flags.h"
#include "bench/kernel/output_checks.h"
#include "bench/kernel/problem.h"
#include "bench/kernel/timing.h"
#include "core/dtype.h"

namespace lossd {
namespace bench {
namespace {

int64_t g_default_rows = cuda::kMinDefaultChunkRows;

// A shape and its device buffers (AllocateProblem's).
struct Buffers {
  int64_t bt, h, v;
  void *x, *w, *dx, *dw, *rows, *tg;
};

// --ce_only: the CE kernels alone at the first budget's chunks; no floor, no fused op.
int RunCeOnly(cuda::FusedLoss& engine, const Buffers& b, const std::vector<uint64_t>& budgets,
              Row* row) {
  const int64_t bt = b.bt, h = b.h, v = b.v;
  void *x = b.x, *w = b.w, *dx = b.dx, *dw = b.dw, *rows = b.rows, *tg = b.tg;
  const cuda::DeviceLossArgs a = BenchProblem(bt, h, v, x, w, tg, rows, dx, dw);
  const uint64_t budget =
      budgets[0] != 0 ? budgets[0]
                      : cuda::DefaultChunkBudget(bt, v, DType::kBF16, cuda::kGemmWorkspaceBytes,
                                                 g_default_rows);
  const cuda::ChunkPlan plan = cuda::PlanChunks(bt, v, DType::kBF16, budget, 0);
  void* ws;
  BENCH_CHECK_CUDA(cudaMalloc(&ws, plan.workspace_bytes));
  char* z = static_cast<char*>(ws);
  char* gws = z + ((plan.chunk_rows * v * 2 + 255) / 256 * 256);
  if (TimeCrossEntropy(engine, a, bt, h, v, plan.chunk_rows, w, x, z, gws,
                       plan.gemm_workspace_bytes, row)) {
    return 1;
  }
  for (void* p : {x, w, dx, dw, rows, tg, ws}) BENCH_CHECK_CUDA(cudaFree(p));
  return 0;
}

// The configuration `c` at `budget` (0: the default): *f's settings and *plan, row chunks for
// the reference-exp path where `ref_exp` (as the backend plans them). False (said on stderr)
// where the whole-batch layout does not apply.
bool PlanConfig(int64_t bt, int64_t h, int64_t v, uint64_t budget, const Config& c,
                bool ref_exp, Row::Fused* out, cuda::ChunkPlan* plan_out) {
  Row::Fused& f = *out;
  const uint64_t gws = static_cast<uint64_t>(absl::GetFlag(FLAGS_gemm_ws_mib)) << 20;
  const int64_t rows =
      (budget & kRowsBudget) != 0 ? static_cast<int64_t>(budget & ~kRowsBudget) : 0;
  if (rows > 0) budget = 0;
  f.is_default = budget == 0 && rows == 0;
  f.budget =
      f.is_default ? cuda::DefaultChunkBudget(bt, v, DType::kBF16, gws, g_default_rows) : budget;
  f.schedule = c.schedule;
  f.side_sms = c.side_sms;
  if (ref_exp && f.schedule != 2 && budget == 0) {
    f.budget = cuda::DefaultRefExpBudget(bt, h, v, gws, g_default_rows);
  }
  cuda::ChunkPlan plan =
      f.schedule == 2 ? cuda::PlanWhole(bt, h, v, DType::kBF16, true, DType::kBF16, f.budget, gws)
      : ref_exp       ? cuda::PlanRefExpChunks(bt, h, v, f.budget, rows, gws)
                      : cuda::PlanChunks(bt, v, DType::kBF16, f.budget, rows,
                                         static_cast<cuda::Schedule>(f.schedule), gws);
  if (rows > 0) f.budget = plan.workspace_bytes;
  if (ref_exp && f.schedule != 2) plan.schedule = static_cast<cuda::Schedule>(f.schedule);
  if (f.schedule == 2 && plan.blocks == 0) {
    std::fprintf(stderr, "  %lldx%lldx%lld budget %llu MiB: whole-batch layout does not apply\n",
                 static_cast<long long>(bt), static_cast<long long>(h),
                 static_cast<long long>(v), static_cast<unsigned long long>(f.budget >> 20));
    return false;
  }
  plan.side_sms = f.side_sms;
  f.chunk_rows = plan.chunk_rows;
  f.blocks = plan.blocks;
  f.workspace = plan.workspace_bytes;
  *plan_out = plan;
  return true;
}

// The floor, the tuned floor and the fused op in the same rounds: their medians into *f.
int TimeConfig(cudaStream_t stream, int warmup, int runs,
               const std::vector<std::function<absl::Status()>>& bodies, int64_t bt, int64_t h,
               int64_t v, Row::Fused* f) {
  std::vector<double> ms;
  if (TimeRoundsMs(stream, warmup, runs, bodies, &ms)) return 1;
  // A time that implies more than any GPU's tensor cores (5 PFLOP/s) means the events did not
  // enclose the work (work queued on another stream): a wrong table, not a fast one.
  for (double t : ms) {
    if (6.0 * bt * h * v / (t * 1e-3) > 5e15) {
      std::fprintf(stderr, "%lldx%lldx%lld: %.3f ms is faster than any GPU; timing broken\n",
                   static_cast<long long>(bt), static_cast<long long>(h),
                   static_cast<long long>(v), t);
      return 1;
    }
  }
  f->floor_ms = ms[0], f->tuned_floor_ms = ms[1], f->ms = ms[2];
  return 0;
}

// The whole-batch layout's GEMMs alone, one stream, no CE: what its layout costs.
int TimeWholeGemms(cuda::FusedLoss& engine, const cuda::ChunkPlan& plan, const Buffers& bufs,
                   void* ws, int warmup, int runs, double* ms) {
  cudaStream_t stream = engine.stream();
  const int64_t bt = bufs.bt, h = bufs.h, v = bufs.v;
  const void *x = bufs.x, *w = bufs.w;
  void* dw = bufs.dw;
  const int64_t n = plan.blocks, nb = plan.block_cols;
  const int64_t split = cuda::RowSplit(bt);
  char* last = static_cast<char*>(ws);
  float* dxs = reinterpret_cast<float*>(last + (bt * nb * 2 + 255) / 256 * 256);
  char* gws_p = reinterpret_cast<char*>(dxs) + (bt * h * 4 + 255) / 256 * 256;
  auto col0 = [&](int64_t b) { return cuda::WholeBlock(plan, v, static_cast<int>(b)).col0; };
  auto cols = [&](int64_t b) { return cuda::WholeBlock(plan, v, static_cast<int>(b)).cols; };
  auto region = [&](int64_t b) { return static_cast<float*>(dw) + col0(b) * h; };
  auto gbase = [&](int64_t b) {
    return b + 1 < n ? reinterpret_cast<char*>(region(b + 1)) : last;
  };
  auto gemms = [&]() -> absl::Status {
    const int64_t r0s[2] = {0, split}, rns[2] = {split, bt - split};
    for (int hh = 0; hh < (split < bt ? 2 : 1); ++hh) {
      for (int64_t b = 0; b < n; ++b) {
        absl::Status st = engine.Gemm(
            stream, gws_p, plan.gemm_workspace_bytes, true, false, cols(b), rns[hh], h, 1.0f,
            static_cast<const char*>(w) + col0(b) * h * 2, h,
            static_cast<const char*>(x) + r0s[hh] * h * 2, h, CUDA_R_16BF, 0.0f,
            gbase(b) + r0s[hh] * cols(b) * 2, cols(b), CUDA_R_16BF);
        if (!st.ok()) return st;
      }
    }
    for (int hh = 0; hh < (split < bt ? 2 : 1); ++hh) {
      for (int64_t b = 0; b < n; ++b) {
        absl::Status st = engine.Gemm(
            stream, gws_p, plan.gemm_workspace_bytes, false, false, h, rns[hh], cols(b), 1.0f,
            static_cast<const char*>(w) + col0(b) * h * 2, h,
            gbase(b) + r0s[hh] * cols(b) * 2, cols(b), CUDA_R_16BF, b > 0 ? 1.0f : 0.0f,
            dxs + r0s[hh] * h, h, CUDA_R_32F);
        if (!st.ok()) return st;
      }
    }
    for (int64_t b = 0; b < n; ++b) {
      absl::Status st = engine.Gemm(stream, gws_p, plan.gemm_workspace_bytes, false, true, h,
                                    cols(b), bt, 1.0f, x, h, gbase(b), cols(b), CUDA_R_16BF,
                                    0.0f, region(b), h, CUDA_R_32F);
      if (!st.ok()) return st;
    }
    return absl::OkStatus();
  };
  return TimeMs(stream, warmup, runs, gemms, ms);
}

// Where the time goes: the same chunks' GEMMs alone (one stream) at each budget, and at
// the first the CE kernels (and, asked for, the GEMM sweep and the energy of each part).
int TimeParts(cuda::FusedLoss& engine, const cuda::DeviceLossArgs& a, const cuda::ChunkPlan& plan,
              const Buffers& bufs, void* ws, size_t run, int warmup, int runs,
              const std::function<absl::Status()>& floor,
              const std::function<absl::Status()>& tuned_floor,
              const std::function<absl::Status()>& fused, Row::Fused* out, Row* row) {
  cudaStream_t stream = engine.stream();
  Row::Fused& f = *out;
  const int64_t bt = bufs.bt, h = bufs.h, v = bufs.v;
  const void *x = bufs.x, *w = bufs.w;
  void *dx = bufs.dx, *dw = bufs.dw;
  char* z = static_cast<char*>(ws);
  char* gws = z + ((plan.chunk_rows * v * 2 + 255) / 256 * 256);
  if (run == 0 && absl::GetFlag(FLAGS_algo_sweep) > 0 &&
      SweepAlgos(engine, bt, h, v, plan.chunk_rows, x, w, dx, dw)) {
    return 1;
  }
  auto gemms = [&]() {
    return ChunkedGemms(engine, stream, gws, plan.gemm_workspace_bytes, bt, h, v,
                        plan.chunk_rows, x, w, z, dx, dw);
  };
  if (TimeMs(stream, warmup, runs, gemms, &f.gemms_ms)) return 1;
  if (run == 0) row->gemms_ms = f.gemms_ms;
  if (run == 0 && g_meter != nullptr) {
    const std::string shape = absl::StrFormat("%dx%dx%d", bt, h, v);
    if (MeasureEnergy(stream, shape + " floor", floor) ||
        MeasureEnergy(stream, shape + " tuned floor", tuned_floor) ||
        MeasureEnergy(stream, absl::StrFormat("%s fused op (C=%d)", shape, plan.chunk_rows),
                      fused) ||
        MeasureEnergy(stream, shape + " chunked GEMMs alone", gemms)) {
      return 1;
    }
  }
  if (run == 0 && TimeCrossEntropy(engine, a, bt, h, v, plan.chunk_rows, w, x, z, gws,
                                   plan.gemm_workspace_bytes, row)) {
    return 1;
  }
  return 0;
}

void LogConfig(int64_t bt, int64_t h, int64_t v, const Row::Fused& f) {
  std::fprintf(stderr,
               "  %lldx%lldx%lld budget %llu MiB schedule %d/%d: C=%lld %.2f ms (floor %.2f, "
               "tuned %.2f)\n",
               static_cast<long long>(bt), static_cast<long long>(h),
               static_cast<long long>(v), static_cast<unsigned long long>(f.budget >> 20),
               f.schedule, f.side_sms,
               static_cast<long long>(f.chunk_rows), f.ms, f.floor_ms, f.tuned_floor_ms);
}

}  // namespace

void SetDefaultChunkRows(int64_t rows) { g_default_rows = rows; }

int RunShape(cuda::FusedLoss& engine, cuda::FusedLoss& floor_engine, int64_t bt, int64_t h,
             int64_t v,
             const std::vector<uint64_t>& budgets, const std::vector<Config>& schedules,
             Row* row) {
  cudaStream_t stream = engine.stream();
  const int warmup = absl::GetFlag(FLAGS_warmup), runs = absl::GetFlag(FLAGS_runs);
  row->bt = bt;
  row->h = h;
  row->v = v;
  void *x, *w, *dx, *dw, *rows, *tg;
  if (AllocateProblem(bt, h, v, stream, &x, &w, &dx, &dw, &rows, &tg)) return 1;
  const Buffers bufs{bt, h, v, x, w, dx, dw, rows, tg};

  if (absl::GetFlag(FLAGS_ce_only)) return RunCeOnly(engine, bufs, budgets, row);

  // The floor: the same three GEMMs unchunked (logits bf16, dX bf16, dW fp32), 32 MiB workspace,
  // with cuBLASLt's first choice for each (floor_engine, never tuned) and with the fastest of its
  // candidates (engine, tuned here: what the fused op gets when it autotunes). Both are timed in
  // the same rounds as each fused configuration below.
  void *fz, *fws;
  const uint64_t fws_bytes = 32ull << 20;
  BENCH_CHECK_CUDA(cudaMalloc(&fz, bt * v * 2));
  BENCH_CHECK_CUDA(cudaMalloc(&fws, fws_bytes));
  auto floor_on = [&](cuda::FusedLoss* e) -> std::function<absl::Status()> {
    return [=]() {
      return ChunkedGemms(*e, stream, fws, fws_bytes, bt, h, v, bt, x, w, fz, dx, dw);
    };
  };
  const std::function<absl::Status()> floor = floor_on(&floor_engine);
  const std::function<absl::Status()> tuned_floor = floor_on(&engine);
  BENCH_CHECK_OK(ChunkedGemms(engine, stream, fws, fws_bytes, bt, h, v, bt, x, w, fz, dx, dw,
                              -1, 0, /*tune=*/true));
  // Once each before any memory is measured (the first launch of a kernel loads its code).
  BENCH_CHECK_OK(floor());
  BENCH_CHECK_OK(tuned_floor());

  const cuda::DeviceLossArgs a = BenchProblem(bt, h, v, x, w, tg, rows, dx, dw);

  for (size_t run = 0; run < budgets.size() * schedules.size(); ++run) {
    const size_t bi = run / schedules.size(), si = run % schedules.size();
    Row::Fused f;
    cuda::ChunkPlan plan;
    if (!PlanConfig(bt, h, v, budgets[bi], schedules[si], engine.ref_exp(), &f, &plan)) {
      continue;
    }
    BENCH_CHECK_CUDA(cudaDeviceSynchronize());
    const int64_t free_before = FreeBytes();
    void* ws;
    BENCH_CHECK_CUDA(cudaMalloc(&ws, plan.workspace_bytes));
    auto fused = [&]() { return engine.Enqueue(a, plan, ws); };
    if (TimeConfig(stream, warmup, runs, {floor, tuned_floor, fused}, bt, h, v, &f)) return 1;
    BENCH_CHECK_CUDA(cudaDeviceSynchronize());
    f.measured_extra = free_before - FreeBytes();
    if (f.schedule == 2 && row->whole_gemms_ms == 0 &&
        TimeWholeGemms(engine, plan, bufs, ws, warmup, runs, &row->whole_gemms_ms)) {
      return 1;
    }
    if (si == 0 && TimeParts(engine, a, plan, bufs, ws, run, warmup, runs, floor, tuned_floor,
                             fused, &f, row)) {
      return 1;
    }
    if (bi == 0 && CheckOutputs(engine, a, plan, ws, bt, h, v, x, w, tg, dx, dw, row)) return 1;
    BENCH_CHECK_CUDA(cudaFree(ws));
    row->fused.push_back(f);
    LogConfig(bt, h, v, f);
  }
  for (void* p : {x, w, dx, dw, rows, tg, fz, fws}) BENCH_CHECK_CUDA(cudaFree(p));
  return 0;
}

}  // namespace bench
}  // namespace lossd
