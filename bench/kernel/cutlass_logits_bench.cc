// SPDX-License-Identifier: Apache-2.0
// The go/no-go spike of issue 26: one chunk's logits GEMM z = X_c W^T (bf16, fp32 accumulate)
// through lossd's cuBLASLt layer (its heuristic's first choice and its autotuned choice) beside
// CUTLASS 3.x sm_90a kernels, plain and with the per-(row, column tile) max and sum of exp in
// their epilogue (cutlass_logits.h). Prints the median milliseconds of each, in rounds, and
// checks the statistics against a double-precision reference over the stored logits. Needs an
// sm_90 GPU. Flags: --cases (CxHxV chunk GEMMs), --runs, --warmup.
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "bench/kernel/bench_util.h"
#include "bench/kernel/cutlass_check.h"
#include "bench/kernel/cutlass_logits.h"
#include "bench/kernel/kernel_flags.h"
#include "bench/kernel/timing.h"
#include "kernels/cuda/chunk_plan.h"
#include "kernels/cuda/fused_loss.h"

ABSL_FLAG(std::string, cases, "2048x4096x128256,4096x4096x128256,2048x2304x256000,4096x2304x256000",
          "chunk logits GEMMs to time, CxHxV (C rows of a chunk; BT only sets how many chunks)");
ABSL_FLAG(std::string, orders, "0:1,1:1,1:4,2:1,2:4",
          "the persistent scheduler's raster:swizzle pairs tried for each CUTLASS kernel "
          "(raster 0 heuristic, 1 along M, 2 along N); the fastest is timed in the rounds");

namespace lossd {
namespace bench {
namespace {

struct Case {
  int64_t c, h, v;
};

struct Buffers {
  void* x = nullptr;       // (C, H) bf16
  void* w = nullptr;       // (V, H) bf16
  void* z_lt = nullptr;    // (C, V) bf16, cuBLASLt's
  void* z_cu = nullptr;    // (C, V) bf16, CUTLASS's
  float* tmax = nullptr;   // (tiles, ld)
  float* tsum = nullptr;   // (tiles, ld)
  float* rmax = nullptr;   // (tiles, ld) reference
  float* rsum = nullptr;   // (tiles, ld) reference
  float* lse = nullptr;    // (C) combined
  float* rlse = nullptr;   // (C) reference
  float* tgt = nullptr;    // (C) gathered target logits
  int32_t* targets = nullptr;  // (C)
  void* ws_lt = nullptr;   // cuBLASLt workspace, lossd's size
  void* ws_cu = nullptr;   // CUTLASS workspace
  ~Buffers() {
    for (void* p : {x, w, z_lt, z_cu, static_cast<void*>(tmax), static_cast<void*>(tsum),
                    static_cast<void*>(rmax), static_cast<void*>(rsum), static_cast<void*>(lse),
                    static_cast<void*>(rlse), static_cast<void*>(tgt),
                    static_cast<void*>(targets), ws_lt, ws_cu}) {
      if (p != nullptr) cudaFree(p);
    }
  }
};

template <class T>
cudaError_t Alloc(T** p, size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(p), bytes);
}

absl::Status FromCuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(std::string(what) + ": " + cudaGetErrorString(e));
}

absl::Status FromString(const std::string& err) {
  return err.empty() ? absl::OkStatus() : absl::InternalError(err);
}

std::vector<Case> ParseCases(const std::string& s) {
  std::vector<Case> out;
  for (absl::string_view item : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    std::vector<std::string> p = absl::StrSplit(item, 'x');
    Case k{};
    if (p.size() != 3 || !absl::SimpleAtoi(p[0], &k.c) || !absl::SimpleAtoi(p[1], &k.h) ||
        !absl::SimpleAtoi(p[2], &k.v) || k.c <= 0 || k.h <= 0 || k.v <= 0 || k.h % 8 != 0 ||
        k.v % 8 != 0) {
      std::fprintf(stderr, "--cases: bad item '%s' (want CxHxV, H and V multiples of 8)\n",
                   std::string(item).c_str());
      return {};
    }
    out.push_back(k);
  }
  return out;
}

// Compares one stats kernel's outputs with the reference over its own stored logits, and its
// logits with cuBLASLt's. Prints one line.
int CheckStats(CutlassLogits& k, const Case& cs, Buffers& b, cudaStream_t st) {
  const int64_t tiles = (cs.v + k.TileN() - 1) / k.TileN();
  const int64_t ld = (cs.c + k.TileM() - 1) / k.TileM() * k.TileM();
  const size_t nstat = static_cast<size_t>(tiles * ld);
  // Poisoned first, so a statistic the epilogue never writes shows as NaN.
  BENCH_CHECK_CUDA(cudaMemsetAsync(b.tmax, 0xFF, nstat * sizeof(float), st));
  BENCH_CHECK_CUDA(cudaMemsetAsync(b.tsum, 0xFF, nstat * sizeof(float), st));
  BENCH_CHECK_OK(FromString(k.Run(st)));
  BENCH_CHECK_CUDA(ReferenceTileStats(b.z_cu, cs.c, cs.v, k.TileN(), ld, b.rmax, b.rsum, st));
  BENCH_CHECK_CUDA(CombineTileStats(b.tmax, b.tsum, cs.c, tiles, ld, b.lse, st));
  BENCH_CHECK_CUDA(ReferenceRowLse(b.z_cu, cs.c, cs.v, b.rlse, st));
  unsigned long long* diff = nullptr;
  BENCH_CHECK_CUDA(Alloc(&diff, sizeof(*diff)));
  BENCH_CHECK_CUDA(CountMismatches(b.z_cu, b.z_lt, cs.c * cs.v / 2, diff, st));
  std::vector<float> tm(nstat), ts(nstat), rm(nstat), rs(nstat), l(cs.c), rl(cs.c);
  unsigned long long zdiff = 0;
  BENCH_CHECK_CUDA(cudaMemcpyAsync(&zdiff, diff, sizeof(zdiff), cudaMemcpyDeviceToHost, st));
  BENCH_CHECK_CUDA(cudaMemcpyAsync(tm.data(), b.tmax, nstat * 4, cudaMemcpyDeviceToHost, st));
  BENCH_CHECK_CUDA(cudaMemcpyAsync(ts.data(), b.tsum, nstat * 4, cudaMemcpyDeviceToHost, st));
  BENCH_CHECK_CUDA(cudaMemcpyAsync(rm.data(), b.rmax, nstat * 4, cudaMemcpyDeviceToHost, st));
  BENCH_CHECK_CUDA(cudaMemcpyAsync(rs.data(), b.rsum, nstat * 4, cudaMemcpyDeviceToHost, st));
  BENCH_CHECK_CUDA(cudaMemcpyAsync(l.data(), b.lse, cs.c * 4, cudaMemcpyDeviceToHost, st));
  BENCH_CHECK_CUDA(cudaMemcpyAsync(rl.data(), b.rlse, cs.c * 4, cudaMemcpyDeviceToHost, st));
  BENCH_CHECK_CUDA(cudaStreamSynchronize(st));
  cudaFree(diff);
  double max_err = 0, sum_rel = 0, lse_err = 0;
  int64_t bad = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    for (int64_t r = 0; r < cs.c; ++r) {
      const size_t i = static_cast<size_t>(t * ld + r);
      const double em = std::fabs(double(tm[i]) - rm[i]);
      const double es = std::fabs(double(ts[i]) - rs[i]) / rs[i];
      if (!(em <= 0.0) || !(es <= 1e-4)) ++bad;  // NaN counts as bad
      max_err = std::max(max_err, std::isnan(em) ? INFINITY : em);
      sum_rel = std::max(sum_rel, std::isnan(es) ? INFINITY : es);
    }
  }
  for (int64_t r = 0; r < cs.c; ++r) {
    const double e = std::fabs(double(l[r]) - rl[r]);
    lse_err = std::max(lse_err, std::isnan(e) ? INFINITY : e);
  }
  std::printf("  check %-32s max |err| %.3g, sum rel err %.3g (%lld of %lld outside 0 / 1e-4), "
              "combined lse |err| %.3g, z words differing from cuBLASLt's %llu of %lld\n",
              k.Name().c_str(), max_err, sum_rel, static_cast<long long>(bad),
              static_cast<long long>(tiles * cs.c), lse_err, zdiff,
              static_cast<long long>(cs.c * cs.v / 2));
  return bad == 0 && lse_err < 1e-3 ? 0 : 2;
}

// Binds `k` to the case at each raster:swizzle order, times it briefly and leaves it bound to
// the fastest, whose "raster:swizzle" goes in *best_order.
int PickOrder(CutlassLogits& k, CutlassLogitsArgs a, void* ws, cudaStream_t st,
              std::string* best_order) {
  double best = INFINITY;
  CutlassLogitsArgs best_args = a;
  for (absl::string_view o : absl::StrSplit(absl::GetFlag(FLAGS_orders), ',', absl::SkipEmpty())) {
    std::vector<std::string> p = absl::StrSplit(o, ':');
    if (p.size() != 2 || !absl::SimpleAtoi(p[0], &a.raster) || !absl::SimpleAtoi(p[1], &a.swizzle)) {
      std::fprintf(stderr, "--orders: bad item '%s'\n", std::string(o).c_str());
      return 1;
    }
    BENCH_CHECK_OK(FromString(k.Init(a, ws)));
    double ms = 0;
    if (TimeMs(st, 2, 5, [&] { return FromString(k.Run(st)); }, &ms)) return 1;
    std::printf("  order %-32s raster %d swizzle %d: %.3f ms\n", k.Name().c_str(), a.raster,
                a.swizzle, ms);
    if (ms < best) {
      best = ms;
      best_args = a;
      *best_order = std::string(o);
    }
  }
  BENCH_CHECK_OK(FromString(k.Init(best_args, ws)));
  return 0;
}

int RunCase(const Case& cs, std::vector<std::unique_ptr<CutlassLogits>>& kernels,
            cuda::FusedLoss& heur, cuda::FusedLoss& tuned, cudaStream_t st) {
  Buffers b;
  const int64_t min_tile = 128;  // the smallest TileN and TileM of the kernels
  const int64_t tiles_max = (cs.v + min_tile - 1) / min_tile;
  const int64_t ld_max = (cs.c + 255) / 256 * 256;
  const size_t nstat = static_cast<size_t>(tiles_max * ld_max);
  BENCH_CHECK_CUDA(cudaMalloc(&b.x, cs.c * cs.h * 2));
  BENCH_CHECK_CUDA(cudaMalloc(&b.w, cs.v * cs.h * 2));
  BENCH_CHECK_CUDA(cudaMalloc(&b.z_lt, cs.c * cs.v * 2));
  BENCH_CHECK_CUDA(cudaMalloc(&b.z_cu, cs.c * cs.v * 2));
  for (float** p : {&b.tmax, &b.tsum, &b.rmax, &b.rsum}) {
    BENCH_CHECK_CUDA(Alloc(p, nstat * sizeof(float)));
  }
  for (float** p : {&b.lse, &b.rlse, &b.tgt}) BENCH_CHECK_CUDA(Alloc(p, cs.c * 4));
  BENCH_CHECK_CUDA(Alloc(&b.targets, cs.c * 4));
  BENCH_CHECK_CUDA(cudaMalloc(&b.ws_lt, cuda::kGemmWorkspaceBytes));
  // Logits of a few units (|x| < 1, |w| < 0.2 scaled by sqrt(H)), so exp(z - max) spans a
  // wide range and the sums are not flat.
  BENCH_CHECK_CUDA(FillUniformBf16(b.x, cs.c * cs.h, 1, 1.0f, st));
  BENCH_CHECK_CUDA(FillUniformBf16(b.w, cs.v * cs.h, 2, 12.8f / std::sqrt(float(cs.h)), st));
  BENCH_CHECK_CUDA(FillTargets(b.targets, cs.c, 3, static_cast<int32_t>(cs.v), st));

  auto lt = [&](cuda::FusedLoss& e) {
    return e.Gemm(st, b.ws_lt, cuda::kGemmWorkspaceBytes, true, false, cs.v, cs.c, cs.h, 1.0f,
                  b.w, cs.h, b.x, cs.h, CUDA_R_16BF, 0.0f, b.z_lt, cs.v, CUDA_R_16BF);
  };
  BENCH_CHECK_OK(tuned.TuneGemm(st, b.ws_lt, cuda::kGemmWorkspaceBytes, true, false, cs.v, cs.c,
                                cs.h, 1.0f, b.w, cs.h, b.x, cs.h, CUDA_R_16BF, 0.0f, b.z_lt, cs.v,
                                CUDA_R_16BF));
  std::vector<std::string> names = {"cuBLASLt heuristic", "cuBLASLt tuned"};
  std::vector<std::function<absl::Status()>> bodies = {[&] { return lt(heur); },
                                                       [&] { return lt(tuned); }};
  size_t ws_bytes = 0;
  CutlassLogitsArgs a;
  a.x = b.x;
  a.w = b.w;
  a.z = b.z_cu;
  a.tile_max = b.tmax;
  a.tile_sum = b.tsum;
  a.c = cs.c;
  a.h = cs.h;
  a.v = cs.v;
  for (auto& k : kernels) {
    a.ld = (cs.c + k->TileM() - 1) / k->TileM() * k->TileM();
    ws_bytes = std::max(ws_bytes, k->WorkspaceBytes(a));
  }
  BENCH_CHECK_CUDA(cudaMalloc(&b.ws_cu, std::max<size_t>(ws_bytes, 256)));
  // Each kernel keeps its own binding (Init) for the rounds; they share the workspace, which
  // the persistent scheduler of these kernels does not use across launches.
  for (auto& k : kernels) {
    a.ld = (cs.c + k->TileM() - 1) / k->TileM() * k->TileM();
    std::string order;
    if (PickOrder(*k, a, b.ws_cu, st, &order)) return 1;
    names.push_back(k->Name() + " [" + order + "]");
    CutlassLogits* kp = k.get();
    bodies.push_back([kp, st] { return FromString(kp->Run(st)); });
  }
  names.push_back("target gather (C rows)");
  bodies.push_back([&] { return FromCuda(GatherTargetLogits(b.z_cu, b.targets, cs.c, cs.v, b.tgt, st), "gather"); });
  names.push_back("combine tile stats (128-col tiles)");
  bodies.push_back([&] {
    return FromCuda(CombineTileStats(b.tmax, b.tsum, cs.c, tiles_max, ld_max, b.lse, st), "combine");
  });
  std::vector<double> ms;
  if (TimeRoundsMs(st, absl::GetFlag(FLAGS_warmup), absl::GetFlag(FLAGS_runs), bodies, &ms)) {
    return 1;
  }
  const double flops = 2.0 * cs.c * cs.h * cs.v;
  std::printf("case C=%lld H=%lld V=%lld (median of %d, in rounds)\n",
              static_cast<long long>(cs.c), static_cast<long long>(cs.h),
              static_cast<long long>(cs.v), absl::GetFlag(FLAGS_runs));
  // The last two bodies (gather, combine) are not GEMMs: no TFLOP/s for them.
  for (size_t i = 0; i < ms.size(); ++i) {
    if (i + 2 < ms.size()) {
      std::printf("  %-48s %8.3f ms  %6.1f TFLOP/s  %.3fx tuned cuBLASLt\n", names[i].c_str(),
                  ms[i], flops / ms[i] / 1e9, ms[i] / ms[1]);
    } else {
      std::printf("  %-48s %8.3f ms\n", names[i].c_str(), ms[i]);
    }
  }
  // The checks: cuBLASLt's logits (tuned choice) as the comparison for CUTLASS's.
  BENCH_CHECK_OK(lt(tuned));
  int rc = 0;
  for (auto& k : kernels) {
    if (k->Stats()) rc = std::max(rc, CheckStats(*k, cs, b, st));
  }
  return rc;
}

int Main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::vector<Case> cases = ParseCases(absl::GetFlag(FLAGS_cases));
  if (cases.empty()) return 1;
  cudaDeviceProp prop;
  BENCH_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  if (prop.major != 9) {
    std::fprintf(stderr, "needs an sm_90 GPU; device 0 is %s (sm_%d%d)\n", prop.name, prop.major,
                 prop.minor);
    return 1;
  }
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  auto heur = cuda::FusedLoss::Create(0);
  auto tuned = cuda::FusedLoss::Create(0);
  if (!heur.ok() || !tuned.ok()) {
    std::fprintf(stderr, "%s\n", (!heur.ok() ? heur.status() : tuned.status()).ToString().c_str());
    return 1;
  }
  (*tuned)->set_autotune(true);
  std::vector<std::unique_ptr<CutlassLogits>> kernels = MakeCooperativeKernels();
  for (auto& k : MakeCooperative256Kernels()) kernels.push_back(std::move(k));
  for (auto& k : MakePingpongKernels()) kernels.push_back(std::move(k));
  cudaStream_t st;
  // A blocking stream: CUTLASS's Init may clear its workspace on the legacy stream.
  BENCH_CHECK_CUDA(cudaStreamCreate(&st));
  int rc = 0;
  for (const Case& cs : cases) rc = std::max(rc, RunCase(cs, kernels, **heur, **tuned, st));
  cudaStreamDestroy(st);
  std::printf("checks: %s\n", rc == 0 ? "all passed" : "FAILED");
  return rc;
}

}  // namespace
}  // namespace bench
}  // namespace lossd

int main(int argc, char** argv) { return lossd::bench::Main(argc, argv); }
