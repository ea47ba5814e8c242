// Times the fused linear + cross-entropy (forward + backward, bf16, all tensors on the GPU)
// against the 3-GEMM cuBLAS floor at the same shapes in the same process: median of CUDA-event
// timings after warm-up, on random data. Also reports the chunk workspace (peak extra device
// memory), TFLOP/s = 6 BT H V / t, checks that two runs give bit-identical dX and dW, and
// compares the loss, dX and dW with a float64 reference at the same shape.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/kernel/bench_util.h"
#include "bench/kernel/gpu_energy.h"
#include "bench/kernel/reference_fp64.h"
#include "kernels/cuda/ce_kernels.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/fused_loss.h"
#include "core/dtype.h"
#include "core/loss_problem.h"

ABSL_FLAG(std::string, shapes,
          "1024x1024x32000,8192x4096x128256,8192x2304x256000,16384x4096x128256,"
          "32768x4096x128256",
          "comma-separated BTxHxV");
ABSL_FLAG(int, runs, 20, "timed runs per measurement (median reported)");
ABSL_FLAG(int, warmup, 3, "untimed runs first");
ABSL_FLAG(std::string, budgets_mib, "0,1024",
          "chunk budgets (MiB) to time the fused op at; 0 = the backend's default for the shape "
          "(DefaultChunkBudget)");
ABSL_FLAG(std::string, schedules, "0,1,2",
          "schedules to time (0 row halves, 1 column halves, 2 the whole-batch layout where it "
          "applies)");
ABSL_FLAG(std::string, ce_cols, "",
          "also time the one-read CE kernel with at most these many columns a block (comma "
          "list), beside its default, and a device copy of the same bytes");
ABSL_FLAG(double, ce_softcap, 0,
          "softcap for the CE kernels timed alone (--ce_only and the CE summary; 0: off)");
ABSL_FLAG(double, ce_smoothing, 0,
          "label smoothing for the CE kernels timed alone (--ce_only and the CE summary; 0: off)");
ABSL_FLAG(bool, ce_only, false,
          "time only the cross-entropy kernels (both of them) at each shape's first-budget chunks");
ABSL_FLAG(std::string, side_sms, "",
          "SM targets for the dW GEMMs to time with the column-halves schedule");
ABSL_FLAG(std::string, host_io, "",
          "BTxHxV: also time CudaBackend::Compute with host tensors (fresh W each call, dX and "
          "bf16 dW back)");
ABSL_FLAG(std::string, csv, "", "also write the results as CSV to this file");
ABSL_FLAG(bool, autotune, true,
          "time cuBLASLt's candidates for the fused op's GEMMs on first use (the backend's "
          "default); the floor is timed both ways");
ABSL_FLAG(int, gemm_ws_mib, 4, "cuBLASLt workspace per stream (MiB) for the fused op's GEMMs");
ABSL_FLAG(std::string, algo_ranks, "0,0,0",
          "cuBLASLt heuristic rank for the fused op's logits, dX and dW GEMMs");
ABSL_FLAG(std::string, bt_sweep, "",
          "HxV:BT,BT,...: also time the fused op (autotuned, default budget) on a fresh engine "
          "at each BT in turn, as a trainer with a moving BT calls it: the first call (with "
          "whatever tuning it does) against the median of the calls after it");
ABSL_FLAG(double, energy_seconds, 0,
          "> 0: also measure the energy (NVML's counter) of the floor, the tuned floor, the "
          "fused op, the chunked GEMMs alone, the CE kernels alone and a device copy of the CE's "
          "bytes, each run back to back for this many seconds after as long a warm-up, at the "
          "first budget and schedule of each shape");
ABSL_FLAG(bool, check_fp64, true,
          "check the fused op's loss, dX and dW at each shape against a float64 reference "
          "computed on the device (DGEMMs), after the timing");
ABSL_FLAG(int, algo_sweep, 0,
          "> 0: also time each GEMM of the floor and of the first budget's chunks alone at "
          "heuristic ranks 0..N-1 and workspaces 4 and 32 MiB (which algorithm pays)");

namespace lossd {
namespace bench {
namespace {

#define BENCH_CHECK_CUDA(expr)                                                          \
  do {                                                                                  \
    cudaError_t e_ = (expr);                                                            \
    if (e_ != cudaSuccess) {                                                            \
      std::fprintf(stderr, "%s failed: %s (%s:%d)\n", #expr, cudaGetErrorString(e_),    \
                   __FILE__, __LINE__);                                                 \
      return 1;                                                                         \
    }                                                                                   \
  } while (0)
#define BENCH_CHECK_OK(expr)                                                            \
  do {                                                                                  \
    absl::Status s_ = (expr);                                                           \
    if (!s_.ok()) {                                                                     \
      std::fprintf(stderr, "%s failed: %s\n", #expr, s_.ToString().c_str());            \
      return 1;                                                                         \
    }                                                                                   \
  } while (0)

struct Row {
  int64_t bt, h, v;
  struct Fused {
    uint64_t budget;
    bool is_default = false;  // the backend's default budget for the shape
    int schedule;
    int side_sms;
    int64_t chunk_rows;
    int blocks = 0;  // whole-batch layout's vocabulary blocks
    double gemms_ms = 0;  // this budget's chunked GEMMs alone (first schedule of each budget)
    double ms;
    // The floor timed in the same rounds as this configuration: cuBLASLt's first choice for
    // each GEMM, and the fastest of its first kTuneCandidates for each.
    double floor_ms = 0, tuned_floor_ms = 0;
    uint64_t workspace;
    int64_t measured_extra;
  };
  std::vector<Fused> fused;
  double gemms_ms = 0;  // the chunked GEMMs alone, one stream, first budget's chunks
  double ce_ms = 0;     // the cross-entropy kernels alone over the same chunks
  double ce_two_pass_ms = 0;  // the same with the two-pass kernel forced
  int ce_cluster = 0;         // blocks per row of the one-read kernel (0: two-pass)
  double whole_gemms_ms = 0;  // the whole-batch layout's GEMMs alone, first budget
  bool deterministic = true;
  double mean_loss;
  bool checked_fp64 = false;  // fp64 holds the errors against the float64 reference
  Fp64Errors fp64;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// Times the bodies (which enqueue on `stream`) in rounds, each once a round, after
// `warmup` rounds: the median milliseconds of each. The H200 runs these GEMMs at its power cap,
// and the clock that the cap allows drops as the GPU warms (on a GPU host: 1472 MHz over the
// first 8 s of a run, 1425-1437 MHz from the 10th s on, at 690 W of 700 W throughout), so bodies
// timed one after the other, the floor first, would not run at the same clock; in rounds they do.
int TimeRoundsMs(cudaStream_t stream, int warmup, int runs,
                 const std::vector<std::function<absl::Status()>>& bodies,
                 std::vector<double>* medians) {
  cudaEvent_t start, stop;
  BENCH_CHECK_CUDA(cudaEventCreate(&start));
  BENCH_CHECK_CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < warmup; ++i) {
    for (const auto& body : bodies) BENCH_CHECK_OK(body());
  }
  BENCH_CHECK_CUDA(cudaStreamSynchronize(stream));
  std::vector<std::vector<double>> ms(bodies.size());
  // The rounds go through every order of the bodies in turn, so that each body runs first,
  // last and after each other one about equally often (what ran just before sets the clock a
  // body starts at).
  std::vector<size_t> order(bodies.size());
  std::iota(order.begin(), order.end(), size_t{0});
  for (int i = 0; i < runs; ++i) {
    for (const size_t b : order) {
      BENCH_CHECK_CUDA(cudaEventRecord(start, stream));
      BENCH_CHECK_OK(bodies[b]());
      BENCH_CHECK_CUDA(cudaEventRecord(stop, stream));
      BENCH_CHECK_CUDA(cudaEventSynchronize(stop));
      float t = 0;
      BENCH_CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
      ms[b].push_back(t);
    }
    std::next_permutation(order.begin(), order.end());
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  medians->clear();
  for (auto& m : ms) medians->push_back(Median(m));
  return 0;
}

// Times `body` (which enqueues on `stream`) alone: median milliseconds.
int TimeMs(cudaStream_t stream, int warmup, int runs, std::function<absl::Status()> body,
           double* median_ms) {
  std::vector<double> ms;
  if (TimeRoundsMs(stream, warmup, runs, {std::move(body)}, &ms)) return 1;
  *median_ms = ms[0];
  return 0;
}

// The board's energy counter when --energy_seconds asks for it (Main opens it).
GpuEnergy* g_meter = nullptr;

// `body` back to back for about --energy_seconds, after as long a warm-up so the board has
// settled at its power cap: milliseconds and joules per run and the mean power, printed as
// one line named `what`. Batches of about 50 ms are enqueued between synchronisations, so the
// GPU never waits for the host.
int MeasureEnergy(cudaStream_t stream, const std::string& what,
                  const std::function<absl::Status()>& body) {
  if (g_meter == nullptr) return 0;
  const double seconds = absl::GetFlag(FLAGS_energy_seconds);
  BENCH_CHECK_CUDA(cudaStreamSynchronize(stream));
  absl::Time t = absl::Now();
  BENCH_CHECK_OK(body());
  BENCH_CHECK_CUDA(cudaStreamSynchronize(stream));
  const double one_ms = std::max(1e-3, absl::ToDoubleMilliseconds(absl::Now() - t));
  const int64_t batch = std::max<int64_t>(1, static_cast<int64_t>(50.0 / one_ms));
  auto run_for = [&](double s, int64_t* runs) -> int {
    const absl::Time end = absl::Now() + absl::Seconds(s);
    while (absl::Now() < end) {
      for (int64_t i = 0; i < batch; ++i) BENCH_CHECK_OK(body());
      BENCH_CHECK_CUDA(cudaStreamSynchronize(stream));
      *runs += batch;
    }
    return 0;
  };
  int64_t runs = 0;
  if (run_for(seconds, &runs)) return 1;  // warm-up
  runs = 0;
  uint64_t e0 = 0, e1 = 0;
  if (!g_meter->Read(&e0)) return 1;
  t = absl::Now();
  if (run_for(seconds, &runs)) return 1;
  const double elapsed = absl::ToDoubleSeconds(absl::Now() - t);
  if (!g_meter->Read(&e1)) return 1;
  const double joules = static_cast<double>(e1 - e0) * 1e-3;
  std::printf("energy %s: %.3f ms/run at %.0f W = %.4f J/run (%lld runs in %.1f s)\n",
              what.c_str(), elapsed * 1e3 / runs, joules / elapsed, joules / runs,
              static_cast<long long>(runs), elapsed);
  std::fflush(stdout);
  return 0;
}

// Device buffers of a (bt, h, v) problem, filled with random data: x ~ U(-1, 1) and
// w ~ U(-a, a) with a = 6 / sqrt(H) (logits of standard deviation 2), random targets; dX,
// fp32 dW and 16 bytes a row for the row results (BenchProblem's layout). Freed by the caller.
int AllocateProblem(int64_t bt, int64_t h, int64_t v, cudaStream_t stream, void** x, void** w,
                    void** dx, void** dw, void** rows, void** tg) {
  BENCH_CHECK_CUDA(cudaMalloc(x, bt * h * 2));
  BENCH_CHECK_CUDA(cudaMalloc(w, v * h * 2));
  BENCH_CHECK_CUDA(cudaMalloc(dx, bt * h * 2));
  BENCH_CHECK_CUDA(cudaMalloc(dw, v * h * 4));
  BENCH_CHECK_CUDA(cudaMalloc(rows, bt * 16));
  BENCH_CHECK_CUDA(cudaMalloc(tg, bt * 4));
  BENCH_CHECK_CUDA(FillUniformBf16(*x, bt * h, 1, 1.0f, stream));
  BENCH_CHECK_CUDA(FillUniformBf16(*w, v * h, 2, 6.0f / std::sqrt(static_cast<float>(h)), stream));
  BENCH_CHECK_CUDA(FillTargets(static_cast<int32_t*>(*tg), bt, 3, static_cast<int32_t>(v), stream));
  return 0;
}

// The benchmark's problem on device buffers: bf16, mean reduction, every target counted
// (summary), dX in bf16 and a fresh fp32 dW; `rows` holds 16 bytes a row (lse, ce, z-loss,
// prediction).
cuda::DeviceLossArgs BenchProblem(int64_t bt, int64_t h, int64_t v, const void* x, const void* w,
                                  const void* tg, void* rows, void* dx, void* dw) {
  cuda::DeviceLossArgs a;
  a.bt = bt;
  a.h = h;
  a.v = v;
  a.dtype = DType::kBF16;
  a.x = x;
  a.w = w;
  a.targets = static_cast<const int32_t*>(tg);
  a.summary.tokens = bt;
  a.summary.weight_sum = static_cast<double>(bt);
  a.summary.class_weight_sum = static_cast<double>(v);
  a.row_lse = static_cast<float*>(rows);
  a.row_ce = a.row_lse + bt;
  a.row_z = a.row_ce + bt;
  a.row_pred = reinterpret_cast<int32_t*>(a.row_z + bt);
  a.dx = dx;
  a.dx_dtype = DType::kBF16;
  a.dw_acc = static_cast<float*>(dw);
  a.accumulate_dw = false;
  return a;
}

int64_t FreeBytes() {
  size_t free_b = 0, total = 0;
  cudaMemGetInfo(&free_b, &total);
  return static_cast<int64_t>(free_b);
}

// The fused op's three GEMMs over chunks of `chunk` rows, one after the other on `stream` (the
// timed stream, whichever engine's algorithm cache picks the kernels), no CE: logits
// z = X_c W^T (bf16), dX_c = z W (bf16), dW (+)= z^T X_c into fp32 (beta 1 after the first
// chunk). With chunk = BT these are the 3-GEMM floor. `role` picks one of the three (0 logits,
// 1 dX, 2 dW; -1 all), `rank` cuBLASLt's candidate (0: the engine's choice); `tune` times the
// candidates (FusedLoss::TuneGemm) instead of running the GEMMs.
absl::Status ChunkedGemms(cuda::FusedLoss& engine, cudaStream_t stream, void* ws,
                          uint64_t ws_bytes, int64_t bt, int64_t h, int64_t v, int64_t chunk,
                          const void* x, const void* w, void* z, void* dx, void* dw,
                          int role = -1, int32_t rank = 0, bool tune = false) {
  auto gemm = [&](bool ta, bool tb, int64_t m, int64_t n, int64_t k, const void* a, int64_t lda,
                  const void* b, int64_t ldb, float beta, void* d, int64_t ldd,
                  cudaDataType dt) {
    return tune ? engine.TuneGemm(stream, ws, ws_bytes, ta, tb, m, n, k, 1.0f, a, lda, b, ldb,
                                  CUDA_R_16BF, beta, d, ldd, dt)
                : engine.Gemm(stream, ws, ws_bytes, ta, tb, m, n, k, 1.0f, a, lda, b, ldb,
                              CUDA_R_16BF, beta, d, ldd, dt, 0, rank);
  };
  for (int64_t c0 = 0; c0 < bt; c0 += chunk) {
    const int64_t r = std::min(chunk, bt - c0);
    const char* xc = static_cast<const char*>(x) + c0 * h * 2;
    absl::Status s;
    if (role < 0 || role == 0) s = gemm(true, false, v, r, h, w, h, xc, h, 0.0f, z, v, CUDA_R_16BF);
    if (s.ok() && (role < 0 || role == 1)) {
      s = gemm(false, false, h, r, v, w, h, z, v, 0.0f, static_cast<char*>(dx) + c0 * h * 2, h,
               CUDA_R_16BF);
    }
    if (s.ok() && (role < 0 || role == 2)) {
      s = gemm(false, true, h, v, r, xc, h, z, v, c0 > 0 ? 1.0f : 0.0f, dw, h, CUDA_R_32F);
    }
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

// Each GEMM alone at cuBLASLt heuristic ranks 0..N-1 and workspaces of 4 and 32 MiB: the
// floor's three (unchunked) and the chunks' three (all chunks of `chunk` rows, dW with beta 1
// after the first, as the fused op runs them). Prints one line per point; a rank cuBLASLt does
// not offer ends that sweep.
int SweepAlgos(cuda::FusedLoss& engine, int64_t bt, int64_t h, int64_t v, int64_t chunk,
               const void* x, const void* w, void* dx, void* dw) {
  cudaStream_t stream = engine.stream();
  const int runs = std::max(5, absl::GetFlag(FLAGS_runs) / 2);
  void *z, *ws;
  BENCH_CHECK_CUDA(cudaMalloc(&z, bt * v * 2));
  BENCH_CHECK_CUDA(cudaMalloc(&ws, 32ull << 20));
  BENCH_CHECK_CUDA(FillUniformBf16(z, bt * v, 4, 0.01f, stream));
  const char* names[3] = {"logits", "dX", "dW"};
  for (int chunked = 0; chunked < 2; ++chunked) {
    const int64_t c = chunked ? chunk : bt;
    for (int role = 0; role < 3; ++role) {
      for (unsigned long long ws_mib : {4ull, 32ull}) {
        for (int rank = 0; rank < absl::GetFlag(FLAGS_algo_sweep); ++rank) {
          auto body = [&]() {
            return ChunkedGemms(engine, stream, ws, ws_mib << 20, bt, h, v, c, x, w, z, dx, dw,
                                role, rank);
          };
          // A rank that is not offered fails on the first call; probe before timing.
          const absl::Status probe = body();
          if (!probe.ok()) {
            std::fprintf(stderr, "  sweep %s %s ws %llu MiB rank %d: %s\n",
                         chunked ? "chunks" : "floor", names[role], ws_mib, rank,
                         probe.ToString().c_str());
            break;
          }
          double ms = 0;
          if (TimeMs(stream, 1, runs, body, &ms)) return 1;
          std::printf("sweep %lldx%lldx%lld %s C=%lld %s ws=%llu MiB rank=%d: %.3f ms\n",
                      static_cast<long long>(bt), static_cast<long long>(h),
                      static_cast<long long>(v), chunked ? "chunks" : "floor",
                      static_cast<long long>(c), names[role], ws_mib, rank, ms);
          std::fflush(stdout);
        }
      }
    }
  }
  BENCH_CHECK_CUDA(cudaFree(z));
  BENCH_CHECK_CUDA(cudaFree(ws));
  return 0;
}

// One timed configuration: a schedule and the dW GEMMs' SM target.
struct Config {
  int schedule;
  int side_sms;
};

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
  for (absl::string_view c : absl::StrSplit(absl::GetFlag(FLAGS_ce_cols), ',', absl::SkipEmpty())) {
    if (!absl::SimpleAtoi(c, &cols)) {
      std::fprintf(stderr, "bad --ce_cols entry\n");
      return 1;
    }
    double ms = 0;
    cuda::CrossEntropyParams probe{};
    probe.logits = z;
    probe.rows = std::min(chunk_rows, bt);
    probe.v = v;
    probe.one_read_cols = cols;
    const int k = cuda::CrossEntropyCluster(probe);
    if (TimeMs(stream, 1, runs, ce_only, &ms)) return 1;
    std::fprintf(stderr, "  %lldx%lldx%lld CE one-read, at most %d columns a block (%d blocks a "
                 "row): %.2f ms\n",
                 static_cast<long long>(bt), static_cast<long long>(h), static_cast<long long>(v),
                 cols, k, ms);
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
  if (copy_dst != nullptr) BENCH_CHECK_CUDA(cudaFree(copy_dst));
  return 0;
}

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

  if (absl::GetFlag(FLAGS_ce_only)) {
    // The CE kernels alone at the first budget's chunks; no floor, no fused op.
    const cuda::DeviceLossArgs a = BenchProblem(bt, h, v, x, w, tg, rows, dx, dw);
    const uint64_t budget =
        budgets[0] != 0 ? budgets[0] : cuda::DefaultChunkBudget(bt, v, DType::kBF16);
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
    const uint64_t gws = static_cast<uint64_t>(absl::GetFlag(FLAGS_gemm_ws_mib)) << 20;
    f.is_default = budgets[bi] == 0;
    f.budget = f.is_default ? cuda::DefaultChunkBudget(bt, v, DType::kBF16, gws) : budgets[bi];
    f.schedule = schedules[si].schedule;
    f.side_sms = schedules[si].side_sms;
    cuda::ChunkPlan plan =
        f.schedule == 2
            ? cuda::PlanWhole(bt, h, v, DType::kBF16, true, DType::kBF16, f.budget, gws)
            : cuda::PlanChunks(bt, v, DType::kBF16, f.budget, 0,
                               static_cast<cuda::Schedule>(f.schedule), gws);
    if (f.schedule == 2 && plan.blocks == 0) {
      std::fprintf(stderr, "  %lldx%lldx%lld budget %llu MiB: whole-batch layout does not apply\n",
                   static_cast<long long>(bt), static_cast<long long>(h),
                   static_cast<long long>(v), static_cast<unsigned long long>(f.budget >> 20));
      continue;
    }
    plan.side_sms = f.side_sms;
    f.chunk_rows = plan.chunk_rows;
    f.blocks = plan.blocks;
    f.workspace = plan.workspace_bytes;
    BENCH_CHECK_CUDA(cudaDeviceSynchronize());
    const int64_t free_before = FreeBytes();
    void* ws;
    BENCH_CHECK_CUDA(cudaMalloc(&ws, plan.workspace_bytes));
    auto fused = [&]() { return engine.Enqueue(a, plan, ws); };
    std::vector<double> ms;
    if (TimeRoundsMs(stream, warmup, runs, {floor, tuned_floor, fused}, &ms)) return 1;
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
    f.floor_ms = ms[0], f.tuned_floor_ms = ms[1], f.ms = ms[2];
    BENCH_CHECK_CUDA(cudaDeviceSynchronize());
    f.measured_extra = free_before - FreeBytes();
    if (f.schedule == 2 && row->whole_gemms_ms == 0) {
      // The whole-batch layout's GEMMs alone, one stream, no CE: what its layout costs.
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
      if (TimeMs(stream, warmup, runs, gemms, &row->whole_gemms_ms)) return 1;
    }
    if (si == 0) {
      // Where the time goes: the same chunks' GEMMs alone (one stream) at each budget, and at
      // the first the CE kernels.
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
    }
    if (bi == 0) {
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
      if (absl::GetFlag(FLAGS_check_fp64)) {
        // The outputs of the second run above against float64, at the benchmark's own shape.
        // Every schedule at the first budget is checked; the worst of each error is kept.
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
      }
      cudaFree(dx0);
      cudaFree(dw0);
      cudaFree(count);
    }
    BENCH_CHECK_CUDA(cudaFree(ws));
    row->fused.push_back(f);
    std::fprintf(stderr,
                 "  %lldx%lldx%lld budget %llu MiB schedule %d/%d: C=%lld %.2f ms (floor %.2f, "
                 "tuned %.2f)\n",
                 static_cast<long long>(bt), static_cast<long long>(h),
                 static_cast<long long>(v), static_cast<unsigned long long>(f.budget >> 20),
                 f.schedule, f.side_sms,
                 static_cast<long long>(f.chunk_rows), f.ms, f.floor_ms, f.tuned_floor_ms);
  }
  for (void* p : {x, w, dx, dw, rows, tg, fz, fws}) BENCH_CHECK_CUDA(cudaFree(p));
  return 0;
}

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

int Main() {
  std::vector<uint64_t> budgets;
  for (absl::string_view b : absl::StrSplit(absl::GetFlag(FLAGS_budgets_mib), ',')) {
    uint64_t mib = 0;
    if (!absl::SimpleAtoi(b, &mib)) {
      std::fprintf(stderr, "bad --budgets_mib entry '%s'\n", std::string(b).c_str());
      return 2;
    }
    budgets.push_back(mib << 20);
  }
  std::vector<Config> schedules;
  for (absl::string_view b : absl::StrSplit(absl::GetFlag(FLAGS_schedules), ',')) {
    int sc = 0;
    if (!absl::SimpleAtoi(b, &sc) || sc < 0 || sc > 2) {
      std::fprintf(stderr, "bad --schedules entry '%s'\n", std::string(b).c_str());
      return 2;
    }
    schedules.push_back({sc, 0});
    if (sc == 1 && !absl::GetFlag(FLAGS_side_sms).empty()) {
      for (absl::string_view t : absl::StrSplit(absl::GetFlag(FLAGS_side_sms), ',')) {
        int sms = 0;
        if (!absl::SimpleAtoi(t, &sms) || sms < 0) {
          std::fprintf(stderr, "bad --side_sms entry '%s'\n", std::string(t).c_str());
          return 2;
        }
        if (sms > 0) schedules.push_back({1, sms});
      }
    }
  }
  std::unique_ptr<GpuEnergy> meter;
  if (absl::GetFlag(FLAGS_energy_seconds) > 0) {
    meter = GpuEnergy::Open(0);
    if (meter == nullptr) {
      std::fprintf(stderr, "--energy_seconds: NVML's energy counter is not available here\n");
      return 1;
    }
    g_meter = meter.get();
  }
  auto engine = cuda::FusedLoss::Create(0);
  // A second engine for the floor with cuBLASLt's first choices: its algorithm cache is never
  // tuned (the first engine's is, for the fused op and the tuned floor).
  auto floor_engine = cuda::FusedLoss::Create(0);
  if (!engine.ok() || !floor_engine.ok()) {
    std::fprintf(stderr, "%s\n",
                 (engine.ok() ? floor_engine.status() : engine.status()).ToString().c_str());
    return 1;
  }
  {
    std::vector<std::string> r = absl::StrSplit(absl::GetFlag(FLAGS_algo_ranks), ',');
    int ranks[3];
    if (r.size() != 3 || !absl::SimpleAtoi(r[0], &ranks[0]) ||
        !absl::SimpleAtoi(r[1], &ranks[1]) || !absl::SimpleAtoi(r[2], &ranks[2])) {
      std::fprintf(stderr, "bad --algo_ranks\n");
      return 2;
    }
    for (int i = 0; i < 3; ++i) {
      (*engine)->set_algo_rank(static_cast<cuda::GemmRole>(i), ranks[i]);
    }
    (*engine)->set_autotune(absl::GetFlag(FLAGS_autotune));
  }
  cudaDeviceProp prop;
  BENCH_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::vector<Row> rows;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_shapes), ',', absl::SkipEmpty())) {
    std::vector<std::string> parts = absl::StrSplit(s, 'x');
    int64_t bt, h, v;
    if (parts.size() != 3 || !absl::SimpleAtoi(parts[0], &bt) ||
        !absl::SimpleAtoi(parts[1], &h) || !absl::SimpleAtoi(parts[2], &v)) {
      std::fprintf(stderr, "bad shape '%s'\n", std::string(s).c_str());
      return 2;
    }
    Row row;
    if (RunShape(**engine, **floor_engine, bt, h, v, budgets, schedules, &row)) return 1;
    rows.push_back(row);
  }
  if (!absl::GetFlag(FLAGS_bt_sweep).empty()) {
    if (int rc = RunBtSweep(absl::GetFlag(FLAGS_bt_sweep)); rc != 0) return rc;
  }
  if (!absl::GetFlag(FLAGS_host_io).empty()) {
    std::vector<std::string> parts = absl::StrSplit(absl::GetFlag(FLAGS_host_io), 'x');
    int64_t bt, h, v;
    if (parts.size() != 3 || !absl::SimpleAtoi(parts[0], &bt) ||
        !absl::SimpleAtoi(parts[1], &h) || !absl::SimpleAtoi(parts[2], &v)) {
      std::fprintf(stderr, "bad --host_io shape\n");
      return 2;
    }
    if (RunHostIo(bt, h, v)) return 1;
  }
  std::printf("GPU: %s (%d SMs), fwd+bwd bf16, median of %d runs after %d warm-up\n\n",
              prop.name, prop.multiProcessorCount, absl::GetFlag(FLAGS_runs),
              absl::GetFlag(FLAGS_warmup));
  std::printf("| BT, H, V | 3-GEMM floor | tuned floor | budget | C | schedule | fused "
              "| fused / floor | fused / tuned floor "
              "| TFLOP/s | workspace | measured extra | deterministic | mean loss "
              "| chunked GEMMs alone |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  FILE* csv = nullptr;
  if (!absl::GetFlag(FLAGS_csv).empty()) {
    csv = std::fopen(absl::GetFlag(FLAGS_csv).c_str(), "w");
    if (csv != nullptr) {
      std::fprintf(csv,
                   "bt,h,v,floor_ms,tuned_floor_ms,budget_mib,chunk_rows,schedule,side_sms,"
                   "fused_ms,ratio,tflops,workspace_mib,measured_extra_mib,deterministic,"
                   "mean_loss\n");
    }
  }
  for (const Row& r : rows) {
    const double flop = 6.0 * r.bt * r.h * r.v;
    for (const Row::Fused& f : r.fused) {
      std::printf("| %lld, %lld, %lld | %.2f ms | %.2f ms | %s%llu MiB | %lld | %s | %.2f ms | "
                  "%.3fx | %.3fx | %.0f | %.0f MiB | %.0f MiB | %s | %.4f | %s |\n",
                  static_cast<long long>(r.bt), static_cast<long long>(r.h),
                  static_cast<long long>(r.v), f.floor_ms, f.tuned_floor_ms,
                  f.is_default ? "default, " : "", static_cast<unsigned long long>(f.budget >> 20),
                  static_cast<long long>(f.chunk_rows),
                  f.schedule == 0   ? "rows"
                  : f.schedule == 2 ? absl::StrFormat("whole batch, %d blocks", f.blocks).c_str()
                                    : (f.side_sms > 0 ? absl::StrFormat("columns, dW on %d SMs",
                                                                      f.side_sms)
                                                    : std::string("columns"))
                                        .c_str(),
                  f.ms, f.ms / f.floor_ms, f.ms / f.tuned_floor_ms,
                  flop / (f.ms * 1e-3) / 1e12, f.workspace / 1048576.0,
                  f.measured_extra / 1048576.0, r.deterministic ? "yes" : "NO", r.mean_loss,
                  f.gemms_ms > 0 ? absl::StrFormat("%.2f ms", f.gemms_ms).c_str() : "");
      if (csv != nullptr) {
        std::fprintf(csv,
                     "%lld,%lld,%lld,%.4f,%.4f,%llu,%lld,%d,%d,%.4f,%.4f,%.1f,%.1f,%.1f,%d,%.5f\n",
                     static_cast<long long>(r.bt), static_cast<long long>(r.h),
                     static_cast<long long>(r.v), f.floor_ms, f.tuned_floor_ms,
                     static_cast<unsigned long long>(f.budget >> 20),
                     static_cast<long long>(f.chunk_rows), f.schedule, f.side_sms, f.ms,
                     f.ms / f.floor_ms,
                     flop / (f.ms * 1e-3) / 1e12, f.workspace / 1048576.0,
                     f.measured_extra / 1048576.0, r.deterministic ? 1 : 0, r.mean_loss);
      }
    }
    // The first configuration's floor; the whole-batch GEMMs only where that layout was timed.
    const double floor_ms = r.fused.empty() ? 0 : r.fused.front().floor_ms;
    std::printf("| %lld, %lld, %lld | floor %.0f TFLOP/s; chunked GEMMs alone %.2f ms, "
                "CE kernels alone %.2f ms (%s; two-pass kernel %.2f ms)%s | | | | | | | | | | | "
                "| |\n",
                static_cast<long long>(r.bt), static_cast<long long>(r.h),
                static_cast<long long>(r.v), floor_ms > 0 ? flop / (floor_ms * 1e-3) / 1e12 : 0.0,
                r.gemms_ms, r.ce_ms,
                r.ce_cluster > 0
                    ? absl::StrFormat("one-read, %d blocks a row", r.ce_cluster).c_str()
                    : "two-pass",
                r.ce_two_pass_ms,
                r.whole_gemms_ms > 0
                    ? absl::StrFormat(", whole-batch GEMMs alone %.2f ms", r.whole_gemms_ms).c_str()
                    : "");
  }
  if (csv != nullptr) std::fclose(csv);
  // The accuracy bar for bf16 inputs: dX and dW at bf16 level (relative norm error
  // about 3e-3 at most), the loss within 1e-5 relative.
  constexpr double kGradRelNorm = 3e-3, kLossRel = 1e-5;
  bool accurate = true;
  bool any_checked = false;
  for (const Row& r : rows) any_checked = any_checked || r.checked_fp64;
  if (any_checked) {
    std::printf("\nAgainst the float64 reference (DGEMMs on the device, same inputs; the "
                "worst over the schedules timed at the first budget):\n\n"
                "| BT, H, V | float64 loss | loss rel. error | dX rel. norm error | "
                "dW rel. norm error | within (%.0e, %.0e) |\n|---|---|---|---|---|---|\n",
                kGradRelNorm, kLossRel);
  }
  for (const Row& r : rows) {
    if (!r.checked_fp64) continue;
    const bool ok = r.fp64.loss_rel <= kLossRel && r.fp64.dx_rel_norm <= kGradRelNorm &&
                    r.fp64.dw_rel_norm <= kGradRelNorm;
    accurate = accurate && ok;
    std::printf("| %lld, %lld, %lld | %.6f | %.2e | %.2e | %.2e | %s |\n",
                static_cast<long long>(r.bt), static_cast<long long>(r.h),
                static_cast<long long>(r.v), r.fp64.ref_loss, r.fp64.loss_rel,
                r.fp64.dx_rel_norm, r.fp64.dw_rel_norm, ok ? "yes" : "NO");
  }
  for (const Row& r : rows) {
    if (!r.deterministic) return 3;
  }
  if (!accurate) return 4;
  return 0;
}

}  // namespace
}  // namespace bench
}  // namespace lossd

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return lossd::bench::Main();
}
