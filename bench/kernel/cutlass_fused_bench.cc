// SPDX-License-Identifier: Apache-2.0
// The fused path after issue 26's go: forward + backward of the mean cross-entropy of X W^T
// with the logits GEMM a CUTLASS sm_90a ping-pong kernel that writes each row tile's max and
// sum of exp in its epilogue (cutlass_logits.h), so the CE pass only combines statistics and
// forms G at copy speed (cutlass_ce.h), then lossd's cuBLASLt dX and dW GEMMs. Timed in the same
// rounds as the tuned 3-GEMM floor and lossd's default fused op, each over the same chunks:
//   seq      one stream: per chunk, logits + statistics, combine, G, dX, dW;
//   halves   a chunk's two row halves: the second half's logits GEMM and the first half's dX
//            run beside the other half's combine + G on a second stream; the logits kernel's
//            persistent grid leaves --side_sms SMs to it; one dW over the whole chunk;
// and each phase alone over every chunk (where the time goes); beside them lossd's own two
// paths: its default one (logits GEMM + cross-entropy kernel) and the reference-exp path that
// grew out of this benchmark (kernels/cuda/fused_loss_ref_exp.cc: no pass over the logits).
// Checked against the float64 reference and for bit-identical reruns before they are timed.
// Needs an sm_90 GPU.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "bench/kernel/bench_util.h"
#include "bench/kernel/cutlass_fused_path.h"
#include "bench/kernel/floor.h"
#include "bench/kernel/kernel_flags.h"
#include "bench/kernel/problem.h"
#include "bench/kernel/reference_fp64.h"
#include "bench/kernel/timing.h"
#include "kernels/cuda/chunk_plan.h"
#include "kernels/cuda/fused_loss.h"

ABSL_FLAG(std::string, side_sms_list, "0,16",
          "SMs the halves schedule's logits GEMM leaves to the CE pass on the other stream, one "
          "timed variant each");
ABSL_FLAG(double, logit_scale, 1.0,
          "W's range times this (the problem's logits have standard deviation 2 times it): the "
          "accuracy of the paths that store bf16 logits falls with it, and past ~20 the "
          "reference-exp path redoes chunks whose exp would overflow");
ABSL_FLAG(int64_t, ref_exp_rows, 0,
          "rows per chunk of lossd's reference-exp path (0: what its default budget holds, the "
          "backend's choice); more rows, more memory, fewer dW read-backs");
ABSL_FLAG(bool, time, true, "time the schedules after checking them (false: checks only)");
ABSL_FLAG(std::string, order, "1:1",
          "the CUTLASS persistent scheduler's raster:swizzle (raster 0 heuristic, 1 along M, 2 "
          "along N)");

namespace lossd {
namespace bench {
namespace {

// The accuracy bench_kernel asks of the fused op (report.cc): bf16-level gradients, the loss
// within 1e-5 relative of the float64 reference.
constexpr double kGradRelNorm = 3e-3, kLossRel = 1e-5;

struct Problem {
  int64_t bt, h, v;
  void *x = nullptr, *w = nullptr, *dx = nullptr, *dw = nullptr, *rows = nullptr, *tg = nullptr;
  void *z = nullptr, *ws = nullptr, *fws = nullptr, *ref_dx = nullptr, *ref_dw = nullptr;
  unsigned long long* diff = nullptr;
  ~Problem() {
    for (void* p : {x, w, dx, dw, rows, tg, z, ws, fws, ref_dx, ref_dw,
                    static_cast<void*>(diff)}) {
      cudaFree(p);
    }
  }
};

// The mean loss, dX and dW now in `p` against the float64 reference; false (said) on a failure.
bool CompareFp64(Problem& p, double loss, Fp64Errors* e) {
  std::string error;
  if (!CompareWithFp64(p.bt, p.h, p.v, p.x, p.w, static_cast<const int32_t*>(p.tg), loss, p.dx,
                       static_cast<const float*>(p.dw), 2048, e, &error)) {
    std::fprintf(stderr, "float64 reference: %s\n", error.c_str());
    return false;
  }
  return true;
}

bool WithinBar(const Fp64Errors& e) {
  return e.loss_rel <= kLossRel && e.dx_rel_norm <= kGradRelNorm &&
         e.dw_rel_norm <= kGradRelNorm;
}

// Runs `run` twice on `st`, dX and dW poisoned before each, and counts the 4-byte words of dX
// (mism[0]) and dW (mism[1]) the second run wrote differently. 0, or 1 on a failure (said).
int RunTwice(Problem& p, cudaStream_t st, const std::function<absl::Status()>& run,
             unsigned long long mism[2]) {
  const size_t dx_bytes = p.bt * p.h * 2, dw_bytes = p.v * p.h * 4;
  for (int i = 0; i < 2; ++i) {
    BENCH_CHECK_CUDA(cudaMemsetAsync(p.dx, 0xFF, dx_bytes, st));
    BENCH_CHECK_CUDA(cudaMemsetAsync(p.dw, 0xFF, dw_bytes, st));
    BENCH_CHECK_OK(run());
    if (i == 0) {
      BENCH_CHECK_CUDA(cudaMemcpyAsync(p.ref_dx, p.dx, dx_bytes, cudaMemcpyDeviceToDevice, st));
      BENCH_CHECK_CUDA(cudaMemcpyAsync(p.ref_dw, p.dw, dw_bytes, cudaMemcpyDeviceToDevice, st));
    }
  }
  BENCH_CHECK_CUDA(CountMismatches(p.dx, p.ref_dx, dx_bytes / 4, p.diff, st));
  BENCH_CHECK_CUDA(cudaMemcpyAsync(&mism[0], p.diff, 8, cudaMemcpyDeviceToHost, st));
  BENCH_CHECK_CUDA(cudaStreamSynchronize(st));
  BENCH_CHECK_CUDA(CountMismatches(p.dw, p.ref_dw, dw_bytes / 4, p.diff, st));
  BENCH_CHECK_CUDA(cudaMemcpyAsync(&mism[1], p.diff, 8, cudaMemcpyDeviceToHost, st));
  BENCH_CHECK_CUDA(cudaStreamSynchronize(st));
  return 0;
}

// Runs a schedule of the path twice (outputs poisoned before each), checks the second run's
// outputs against the first word for word and against float64. 0, or 2 on a failed check.
int CheckSchedule(CutlassPath& path, int halves, const char* name, Problem& p,
                  cudaStream_t st) {
  unsigned long long mism[2] = {0, 0};
  if (RunTwice(p, st, [&] { return path.Run(halves); }, mism)) return 1;
  absl::StatusOr<double> loss = path.MeanLoss();
  BENCH_CHECK_OK(loss.status());
  Fp64Errors e;
  if (!CompareFp64(p, *loss, &e)) return 1;
  const bool ok = mism[0] == 0 && mism[1] == 0 && WithinBar(e);
  std::printf("  check %-14s loss %.6f (float64 %.6f, rel %.2e), dX rel norm %.2e, dW %.2e, "
              "rerun words differing dX %llu dW %llu: %s\n",
              name, *loss, e.ref_loss, e.loss_rel, e.dx_rel_norm, e.dw_rel_norm, mism[0],
              mism[1], ok ? "ok" : "FAILED");
  return ok ? 0 : 2;
}

// One of lossd's paths (ref_exp on or off, with its plan) against float64 on the same inputs,
// run twice (outputs poisoned before each) for a word-for-word rerun check. The default path is
// reported against the bar, not failed by it (the paths that read bf16 logits share its error
// at wide logits); the reference-exp path must meet it.
int CheckLossd(cuda::FusedLoss& engine, bool ref_exp, const cuda::DeviceLossArgs& a,
               const cuda::ChunkPlan& plan, void* ws, Problem& p) {
  cudaStream_t st = engine.stream();
  engine.set_ref_exp(ref_exp);
  const int64_t chunks0 = engine.ref_exp_chunks(), fallbacks0 = engine.ref_exp_fallbacks();
  unsigned long long mism[2] = {0, 0};
  if (RunTwice(p, st, [&] { return engine.Enqueue(a, plan, ws); }, mism)) return 1;
  std::vector<float> ce(p.bt);
  BENCH_CHECK_CUDA(cudaMemcpy(ce.data(), a.row_ce, p.bt * 4, cudaMemcpyDeviceToHost));
  const double loss = std::accumulate(ce.begin(), ce.end(), 0.0) / static_cast<double>(p.bt);
  Fp64Errors e;
  if (!CompareFp64(p, loss, &e)) return 1;
  const bool ok = mism[0] == 0 && mism[1] == 0 && (!ref_exp || WithinBar(e));
  const char* name = ref_exp ? "lossd ref-exp" : "lossd default";
  std::printf("  check %-14s loss %.6f (float64 %.6f, rel %.2e), dX rel norm %.2e, dW %.2e, "
              "rerun words differing dX %llu dW %llu, ref-exp chunks %lld (redone %lld): %s%s\n",
              name, loss, e.ref_loss, e.loss_rel, e.dx_rel_norm, e.dw_rel_norm, mism[0], mism[1],
              static_cast<long long>(engine.ref_exp_chunks() - chunks0),
              static_cast<long long>(engine.ref_exp_fallbacks() - fallbacks0),
              ok ? "ok" : "FAILED", WithinBar(e) ? "" : " (outside the bar)");
  return ok ? 0 : 2;
}

std::vector<int> ParseInts(const std::string& s) {
  std::vector<int> out;
  for (absl::string_view item : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    int n = 0;
    if (absl::SimpleAtoi(item, &n) && n >= 0) out.push_back(n);
  }
  return out;
}

int AllocateShape(Problem& p, cudaStream_t st) {
  if (AllocateProblem(p.bt, p.h, p.v, st, &p.x, &p.w, &p.dx, &p.dw, &p.rows, &p.tg)) return 1;
  BENCH_CHECK_CUDA(cudaMalloc(&p.z, p.bt * p.v * 2));  // the floor's whole logits
  BENCH_CHECK_CUDA(cudaMalloc(&p.fws, cuda::kGemmWorkspaceBytes));
  BENCH_CHECK_CUDA(cudaMalloc(&p.ref_dx, p.bt * p.h * 2));
  BENCH_CHECK_CUDA(cudaMalloc(&p.ref_dw, p.v * p.h * 4));
  BENCH_CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&p.diff), 8));
  return 0;
}

// One shape: tune, check every schedule of the path, then time everything in the same rounds.
int RunShape(cuda::FusedLoss& engine, int64_t bt, int64_t h, int64_t v) {
  cudaStream_t st = engine.stream();
  Problem p{bt, h, v};
  const cuda::ChunkPlan plan =
      cuda::PlanChunks(bt, v, DType::kBF16, cuda::DefaultChunkBudget(bt, v, DType::kBF16), 0);
  const int64_t chunk = plan.chunk_rows;
  if (AllocateShape(p, st)) return 1;
  if (const double k = absl::GetFlag(FLAGS_logit_scale); k != 1.0) {
    // As AllocateProblem fills W (seed 2 there too), times k.
    BENCH_CHECK_CUDA(FillUniformBf16(p.w, v * h, 2, static_cast<float>(6.0 * k / std::sqrt(double(h))), st));
  }
  const cuda::ChunkPlan rplan = cuda::PlanRefExpChunks(
      bt, h, v, cuda::DefaultRefExpBudget(bt, h, v), absl::GetFlag(FLAGS_ref_exp_rows));
  BENCH_CHECK_CUDA(cudaMalloc(&p.ws, std::max(plan.workspace_bytes, rplan.workspace_bytes)));
  const cuda::DeviceLossArgs args = BenchProblem(bt, h, v, p.x, p.w, p.tg, p.rows, p.dx, p.dw);
  const uint64_t gws = cuda::kGemmWorkspaceBytes;
  BENCH_CHECK_OK(ChunkedGemms(engine, st, p.fws, gws, bt, h, v, bt, p.x, p.w, p.z, p.dx, p.dw,
                              -1, 0, true));
  BENCH_CHECK_OK(ChunkedGemms(engine, st, p.fws, gws, bt, h, v, chunk, p.x, p.w, p.z, p.dx,
                              p.dw, -1, 0, true));
  // Tunes lossd's own GEMMs, each path's.
  engine.set_ref_exp(false);
  BENCH_CHECK_OK(engine.Enqueue(args, plan, p.ws));
  engine.set_ref_exp(true);
  BENCH_CHECK_OK(engine.Enqueue(args, rplan, p.ws));
  const std::vector<int> side = ParseInts(absl::GetFlag(FLAGS_side_sms_list));
  CutlassPath path(engine, bt, h, v, chunk, p.x, p.w, static_cast<const int32_t*>(p.tg), p.dx,
                   static_cast<float*>(p.dw));
  BENCH_CHECK_OK(path.Init(side));
  std::printf("shape BT=%lld H=%lld V=%lld, chunks of %lld rows (ref-exp %lld rows, workspace "
              "%.1f MiB against %.1f), logits' standard deviation %.3g\n",
              static_cast<long long>(bt), static_cast<long long>(h), static_cast<long long>(v),
              static_cast<long long>(chunk), static_cast<long long>(rplan.chunk_rows),
              rplan.workspace_bytes / 1048576.0, plan.workspace_bytes / 1048576.0,
              2.0 * absl::GetFlag(FLAGS_logit_scale));
  std::vector<std::string> names = {"tuned 3-GEMM floor", "lossd default", "lossd ref-exp",
                                    "cutlass seq"};
  std::vector<std::function<absl::Status()>> bodies = {
      [&] { return ChunkedGemms(engine, st, p.fws, gws, bt, h, v, bt, p.x, p.w, p.z, p.dx, p.dw); },
      [&] {
        engine.set_ref_exp(false);
        return engine.Enqueue(args, plan, p.ws);
      },
      [&] {
        engine.set_ref_exp(true);
        return engine.Enqueue(args, rplan, p.ws);
      },
      [&] { return path.Run(CutlassPath::kSeq); }};
  int rc = CheckLossd(engine, false, args, plan, p.ws, p);
  rc = std::max(rc, CheckLossd(engine, true, args, rplan, p.ws, p));
  rc = std::max(rc, CheckSchedule(path, CutlassPath::kSeq, "cutlass seq", p, st));
  for (size_t i = 0; i < side.size(); ++i) {
    const std::string n = "cutlass halves " + std::to_string(side[i]);
    names.push_back(n);
    bodies.push_back([&path, i] { return path.Run(static_cast<int>(i)); });
    rc = std::max(rc, CheckSchedule(path, static_cast<int>(i), n.c_str(), p, st));
  }
  if (!absl::GetFlag(FLAGS_time)) return rc;
  const size_t n_schedules = names.size();
  names.insert(names.end(), {"  seq: logits + statistics alone", "  seq: combine + G alone",
                             "  chunk dX GEMMs alone", "  chunk dW GEMMs alone"});
  for (int phase = 0; phase < 2; ++phase) {
    bodies.push_back([&path, phase] { return path.Phase(phase); });
  }
  for (int role : {1, 2}) {
    bodies.push_back([&, role] {
      return ChunkedGemms(engine, st, p.fws, gws, bt, h, v, chunk, p.x, p.w, p.z, p.dx, p.dw,
                          role);
    });
  }
  std::vector<double> ms;
  if (TimeRoundsMs(st, absl::GetFlag(FLAGS_warmup), absl::GetFlag(FLAGS_runs), bodies, &ms)) {
    return 1;
  }
  for (size_t i = 0; i < ms.size(); ++i) {
    std::printf("  %-34s %9.3f ms", names[i].c_str(), ms[i]);
    if (i < n_schedules) std::printf("  %.3fx the tuned floor", ms[i] / ms[0]);
    std::printf("\n");
  }
  return rc;
}

int Main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  cudaDeviceProp prop;
  BENCH_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  if (prop.major != 9) {
    std::fprintf(stderr, "needs an sm_90 GPU; device 0 is %s (sm_%d%d)\n", prop.name, prop.major,
                 prop.minor);
    return 1;
  }
  std::printf("device: %s, %d SMs; median of %d runs in rounds\n", prop.name,
              prop.multiProcessorCount, absl::GetFlag(FLAGS_runs));
  auto engine = cuda::FusedLoss::Create(0);
  if (!engine.ok()) {
    std::fprintf(stderr, "%s\n", engine.status().ToString().c_str());
    return 1;
  }
  (*engine)->set_autotune(true);
  int rc = 0;
  for (absl::string_view item :
       absl::StrSplit(absl::GetFlag(FLAGS_shapes), ',', absl::SkipEmpty())) {
    std::vector<std::string> f = absl::StrSplit(item, 'x');
    int64_t bt = 0, h = 0, v = 0;
    if (f.size() != 3 || !absl::SimpleAtoi(f[0], &bt) || !absl::SimpleAtoi(f[1], &h) ||
        !absl::SimpleAtoi(f[2], &v) || bt <= 0 || h % 8 != 0 || v % 8 != 0 || h <= 0 || v <= 0) {
      std::fprintf(stderr, "--shapes: bad item '%s' (want BTxHxV, H and V multiples of 8)\n",
                   std::string(item).c_str());
      return 1;
    }
    rc = std::max(rc, RunShape(**engine, bt, h, v));
    std::fflush(stdout);
  }
  std::printf("checks: %s\n", rc == 0 ? "all passed" : "FAILED");
  return rc;
}

}  // namespace
}  // namespace bench
}  // namespace lossd

int main(int argc, char** argv) { return lossd::bench::Main(argc, argv); }
