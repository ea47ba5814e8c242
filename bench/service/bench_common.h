// SPDX-License-Identifier: Apache-2.0
// The vocabulary of the service benchmark: a shape, the data it sends (bf16 X and W from a
// shared buffer pool, written once so no first-touch faults show inside a timed call), a
// measured point and a measured transfer, the run's settings, and the number formats of the
// report. Measures nothing itself and never checks the numbers lossd computes.
#ifndef LOSSD_BENCH_SERVICE_BENCH_COMMON_H_
#define LOSSD_BENCH_SERVICE_BENCH_COMMON_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/lossd_client.h"

namespace lossd {
namespace bench {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t);

double Median(std::vector<double> v);

// GB = 1e9 bytes.
double GB(double bytes);

// The report's number formats: milliseconds of seconds, a number, a percentage of a ratio.
std::string Ms(double s);
std::string Num(double v, const char* fmt = "%.2f");
std::string Pct(double v);

struct Shape {
  int64_t bt = 0, h = 0, v = 0;
  std::string Name() const { return absl::StrCat("(", bt, ", ", h, ", ", v, ")"); }
  uint64_t XBytes() const { return static_cast<uint64_t>(bt) * h * 2; }
  uint64_t WBytes() const { return static_cast<uint64_t>(v) * h * 2; }
  uint64_t AccBytes() const { return static_cast<uint64_t>(v) * h * 4; }
  double Flops() const { return 6.0 * bt * h * v; }
};

// ---- Data ------------------------------------------------------------------------------

// Page-backed, written once (so no first-touch faults show inside a timed call), reused.
class BufferPool {
 public:
  uint8_t* Take(uint64_t bytes);
  void Give(uint64_t bytes, uint8_t* b);
  // Frees every idle buffer (between points, so memory follows the current point).
  void Trim();

 private:
  absl::Mutex mu_;
  std::map<uint64_t, std::vector<uint8_t*>> free_ ABSL_GUARDED_BY(mu_);
};

BufferPool& Pool();

// Uniform bf16 values in [-scale, scale), filled on every core.
void FillBf16(uint16_t* p, uint64_t n, float scale, uint64_t seed);  // (n) bf16

// Inputs shared (read-only) by every client of one shape.
struct ShapeData {
  Shape s;
  std::unique_ptr<uint16_t[]> x;      // (BT, H) bf16
  std::vector<int32_t> targets;       // (BT)
};

// ---- One measured point ------------------------------------------------------------------

// kHead: every client is a data-parallel rank of one hosted head (world_size = clients):
// micro_batches Computes on the head, then the Step barrier; nothing fetched or uploaded.
enum class Mode { kInline, kHandle, kAccum, kAccumNoFetch, kHead };

const char* ModeName(Mode m);

struct Point {
  Shape shape;
  Mode mode = Mode::kHandle;
  int clients = 1;
  std::string error;
  std::vector<double> call_seconds;     // each Compute, client wall
  std::vector<double> compute_seconds;  // each Compute, server compute
  std::vector<double> step_seconds;     // accum: micro-batches + fetch + drop; head: + Step
  std::vector<double> fetch_seconds;    // accum: the striped fetch; head: the Step call
  double window_seconds = 0;            // barrier to the last client's end
  uint64_t micro_batches = 0;           // in the window
  double compute_sum = 0;               // in the window
  // Bytes one micro-batch Compute moves, each way.
  uint64_t up_bytes = 0, down_bytes = 0;
  // Overlapped runs: the median compute_seconds of the same calls made without overlap by one
  // client in the same run. An overlapped compute_seconds includes the waits for rows of X
  // still on the wire, so it is no measure of the device's work; this is (0: not measured).
  double plain_compute = 0;

  double PerMicroBatch() const {  // window-amortised
    return micro_batches ? window_seconds / micro_batches : 0;
  }
  // The device's work per call: measured without overlap where that was run.
  double DeviceCompute() const {
    return plain_compute > 0 ? plain_compute : compute_seconds.empty() ? 0 : Median(compute_seconds);
  }
  // Share of the window the device computed: its work per call times the calls.
  double Busy() const {
    if (window_seconds <= 0) return 0;
    return plain_compute > 0 ? plain_compute * micro_batches / window_seconds
                             : compute_sum / window_seconds;
  }
};

struct Env {
  std::string target;
  size_t part_bytes = 4u << 20;
  absl::Duration deadline;
  int stripes = 4;
  int micro_batches = 4;
  int runs = 5;
  bool overlap = true;
};

absl::StatusOr<std::unique_ptr<client::LossClient>> NewClient(const Env& env, int connections);

// ---- Transfers ---------------------------------------------------------------------------

struct Transfer {
  std::string name;
  uint64_t bytes = 0;
  int connections = 1;
  bool upload = true;
  std::vector<double> seconds;
  std::vector<double> header_seconds;  // fetches: time to the header (the server's snapshot)
  std::string error;
  double Gbps() const {
    const double m = Median(seconds);
    return m > 0 ? GB(bytes) / m : 0;
  }
};

}  // namespace bench
}  // namespace lossd

#endif  // LOSSD_BENCH_SERVICE_BENCH_COMMON_H_
