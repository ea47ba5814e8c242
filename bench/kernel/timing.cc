// SPDX-License-Identifier: Apache-2.0
#include "bench/kernel/timing.h"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/kernel/kernel_flags.h"

namespace lossd {
namespace bench {

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

}  // namespace bench
}  // namespace lossd
