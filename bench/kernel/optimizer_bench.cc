// SPDX-License-Identifier: Apache-2.0
// Times a hosted head's optimizer step on the GPU (kernels/cuda/optimizer.h) against the HBM
// time of the bytes it must move: a device-to-device cudaMemcpy, in the same process, that
// reads and writes as many bytes in all as the step does. Also times the gradient's sum of
// squares the same way. Median of --runs CUDA-event timings after --warmup, on random data.
// Prints both times, the bytes, the bandwidth of each and the ratio step / copy. Exit codes:
// 0; 1 on a failed CUDA call; 2 on a bad flag.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "core/dtype.h"
#include "kernels/cuda/optimizer.h"
#include "kernels/optimizer.h"

ABSL_FLAG(int64_t, v, 128256, "rows of the head (vocabulary)");
ABSL_FLAG(int64_t, h, 4096, "columns of the head (hidden size)");
ABSL_FLAG(std::string, optimizer, "adamw", "adamw or sgd");
ABSL_FLAG(bool, amsgrad, false, "AdamW's amsgrad (one more state read and written)");
ABSL_FLAG(double, momentum, 0.9, "SGD's momentum (0: no buffer)");
ABSL_FLAG(std::string, copy, "bf16", "the compute copy: bf16, fp16, fp32 or none");
ABSL_FLAG(int, runs, 20, "timed runs per measurement (median reported)");
ABSL_FLAG(int, warmup, 3, "untimed runs first");

namespace lossd {
namespace bench {
namespace {

#define BENCH_CUDA(expr)                                                              \
  do {                                                                                \
    const cudaError_t e_ = (expr);                                                    \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s: %s (%s)\n", #expr, cudaGetErrorName(e_),             \
                   cudaGetErrorString(e_));                                           \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

// Fills n floats of device memory from a host pattern of 2^24 random values in [lo, hi),
// repeated: random enough for a bandwidth measurement, and quick at 525M elements.
void FillDevice(float* dst, int64_t n, float lo, float hi, uint64_t seed) {
  const int64_t pattern = std::min<int64_t>(n, int64_t{1} << 24);
  std::vector<float> host(pattern);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  for (float& x : host) x = dist(rng);
  for (int64_t at = 0; at < n; at += pattern) {
    const int64_t count = std::min(pattern, n - at);
    BENCH_CUDA(cudaMemcpy(dst + at, host.data(), count * 4, cudaMemcpyHostToDevice));
  }
}

float* DeviceFloats(int64_t n, float lo, float hi, uint64_t seed) {
  float* p = nullptr;
  BENCH_CUDA(cudaMalloc(reinterpret_cast<void**>(&p), n * 4));
  FillDevice(p, n, lo, hi, seed);
  return p;
}

// The median of `runs` timings of fn on `stream` (each between two events), in ms.
double MedianMs(cudaStream_t stream, const std::function<void()>& fn) {
  cudaEvent_t start, stop;
  BENCH_CUDA(cudaEventCreate(&start));
  BENCH_CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < absl::GetFlag(FLAGS_warmup); ++i) fn();
  std::vector<float> ms;
  for (int i = 0; i < absl::GetFlag(FLAGS_runs); ++i) {
    BENCH_CUDA(cudaEventRecord(start, stream));
    fn();
    BENCH_CUDA(cudaEventRecord(stop, stream));
    BENCH_CUDA(cudaEventSynchronize(stop));
    float t = 0;
    BENCH_CUDA(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  BENCH_CUDA(cudaEventDestroy(start));
  BENCH_CUDA(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// The copy that moves `bytes` in all: a cudaMemcpy of bytes / 2 reads that many and writes
// that many.
double CopyMs(cudaStream_t stream, int64_t bytes) {
  const int64_t half = bytes / 2;
  void *src = nullptr, *dst = nullptr;
  BENCH_CUDA(cudaMalloc(&src, half));
  BENCH_CUDA(cudaMalloc(&dst, half));
  BENCH_CUDA(cudaMemset(src, 1, half));
  const double ms = MedianMs(stream, [&] {
    BENCH_CUDA(cudaMemcpyAsync(dst, src, half, cudaMemcpyDeviceToDevice, stream));
  });
  BENCH_CUDA(cudaFree(src));
  BENCH_CUDA(cudaFree(dst));
  return ms;
}

void Report(const char* what, double ms, double copy_ms, int64_t bytes) {
  std::printf("%-22s %9.3f ms  %7.2f TB/s | copy of the same bytes %9.3f ms  %7.2f TB/s | "
              "ratio %.3f\n",
              what, ms, bytes / (ms * 1e9), copy_ms, bytes / (copy_ms * 1e9), ms / copy_ms);
}

int Main() {
  const int64_t n = absl::GetFlag(FLAGS_v) * absl::GetFlag(FLAGS_h);
  const std::string kind = absl::GetFlag(FLAGS_optimizer), copy = absl::GetFlag(FLAGS_copy);
  if (n <= 0 || (kind != "adamw" && kind != "sgd") ||
      (copy != "bf16" && copy != "fp16" && copy != "fp32" && copy != "none") ||
      absl::GetFlag(FLAGS_runs) < 1) {
    std::fprintf(stderr, "bad flags: --v, --h > 0; --optimizer adamw|sgd; "
                         "--copy bf16|fp16|fp32|none; --runs >= 1\n");
    return 2;
  }
  OptimizerParams p;
  p.kind = kind == "adamw" ? OptimizerKind::kAdamW : OptimizerKind::kSgd;
  p.lr = 1e-3;
  p.weight_decay = 0.1;
  p.amsgrad = absl::GetFlag(FLAGS_amsgrad);
  p.momentum = p.kind == OptimizerKind::kSgd ? absl::GetFlag(FLAGS_momentum) : 0;
  p.momentum_initialised = true;  // the steady state: the buffer is read and written
  p.step = 10;
  OptimizerTensors t;
  t.n = n;
  t.param = DeviceFloats(n, -1, 1, 1);
  t.grad = DeviceFloats(n, -1e-2f, 1e-2f, 2);
  const bool adamw = p.kind == OptimizerKind::kAdamW, sgd_buf = !adamw && p.momentum != 0;
  if (adamw || sgd_buf) t.state1 = DeviceFloats(n, -1e-3f, 1e-3f, 3);
  if (adamw) t.state2 = DeviceFloats(n, 0, 1e-4f, 4);
  if (adamw && p.amsgrad) t.state3 = DeviceFloats(n, 0, 2e-4f, 5);
  t.copy_dtype = copy == "fp16" ? DType::kF16 : copy == "fp32" ? DType::kF32 : DType::kBF16;
  const int64_t copy_bytes = copy == "none" ? 0 : static_cast<int64_t>(DTypeSize(t.copy_dtype));
  if (copy_bytes > 0) BENCH_CUDA(cudaMalloc(&t.copy, n * copy_bytes));
  // Bytes per element: every state read and written once, the master read and written, the
  // gradient read, the copy written. AdamW with a bf16 copy: 16 read + 14 written = 30.
  const int64_t states = (t.state1 != nullptr) + (t.state2 != nullptr) + (t.state3 != nullptr);
  const int64_t per_elem = 4 /*grad*/ + 8 /*param*/ + 8 * states + copy_bytes;
  const int64_t bytes = n * per_elem;

  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::printf("%s%s, %lld x %lld = %lld elements, copy %s: %lld bytes per element, %.3f GB in "
              "all; median of %d after %d warm-up\n",
              kind.c_str(), p.amsgrad ? " (amsgrad)" : "", (long long)absl::GetFlag(FLAGS_v),
              (long long)absl::GetFlag(FLAGS_h), (long long)n, copy.c_str(),
              (long long)per_elem, bytes / 1e9, absl::GetFlag(FLAGS_runs),
              absl::GetFlag(FLAGS_warmup));
  // The master drifts over the runs; its bandwidth does not.
  const double step_ms =
      MedianMs(stream, [&] { BENCH_CUDA(cuda::LaunchOptimizerStep(p, t, stream)); });
  const double step_copy_ms = CopyMs(stream, bytes);
  Report("optimizer step", step_ms, step_copy_ms, bytes);

  double* scratch = nullptr;
  BENCH_CUDA(cudaMalloc(reinterpret_cast<void**>(&scratch), cuda::kSumOfSquaresScratch * sizeof(double)));
  const double sum_ms =
      MedianMs(stream, [&] { BENCH_CUDA(cuda::LaunchSumOfSquares(t.grad, n, scratch, stream)); });
  const double sum_copy_ms = CopyMs(stream, n * 4);
  Report("sum of squares (grad)", sum_ms, sum_copy_ms, n * 4);
  BENCH_CUDA(cudaStreamSynchronize(stream));
  return 0;
}

}  // namespace
}  // namespace bench
}  // namespace lossd

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return lossd::bench::Main();
}
