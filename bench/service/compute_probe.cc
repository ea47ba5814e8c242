// SPDX-License-Identifier: Apache-2.0
// One client, one connection, back-to-back Computes with W by handle and dX only: the call
// that a micro-batch of a trainer makes. Prints each call's wall time and the server's
// compute_seconds, then medians and the wire rate (X up + dX down over the time the call did
// not spend computing). Made to split an end-to-end Compute into wire and compute time
// together with lossd's per-phase metrics and a profiler; never checks lossd's numbers.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/host_tensor.h"
#include "client/lossd_client.h"
#include "core/dtype.h"

ABSL_FLAG(std::string, target, "localhost:50051", "lossd address.");
ABSL_FLAG(std::string, shape, "8192x4096x64", "BTxHxV (bf16).");
ABSL_FLAG(int, runs, 10, "Timed calls after one untimed warm-up.");
ABSL_FLAG(uint64_t, part_bytes, 4u << 20, "Bytes per sent part.");
ABSL_FLAG(uint32_t, response_part_bytes, 0, "Bytes per received part (0 = server default).");
ABSL_FLAG(bool, fresh_output, false,
          "Receive dX into a buffer the client allocates per call instead of a reused one.");

namespace lossd {
namespace bench {
namespace {

using client::ComputeRequest;
using client::HostTensor;
using client::LossClient;
using client::OutputBuffer;
using client::OutputTensor;
using Clock = std::chrono::steady_clock;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0 : n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// bf16 bits of a float, rounded toward zero (inputs need only be finite and varied).
uint16_t Bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

int Main() {
  std::vector<int64_t> dims;
  for (absl::string_view p : absl::StrSplit(absl::GetFlag(FLAGS_shape), 'x')) {
    int64_t d = 0;
    if (!absl::SimpleAtoi(p, &d) || d <= 0) {
      std::fprintf(stderr, "bad --shape\n");
      return 2;
    }
    dims.push_back(d);
  }
  if (dims.size() != 3) {
    std::fprintf(stderr, "--shape is BTxHxV\n");
    return 2;
  }
  const int64_t bt = dims[0], h = dims[1], v = dims[2];
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  std::vector<uint16_t> x(bt * h), w(v * h);
  for (auto& e : x) e = Bf16(uni(rng));
  for (auto& e : w) e = Bf16(0.05f * uni(rng));
  std::vector<int32_t> targets(bt);
  for (int64_t i = 0; i < bt; ++i) targets[i] = static_cast<int32_t>(rng() % v);
  std::vector<uint8_t> dx(bt * h * 2, 0x5A);  // touched once, reused by every call

  client::ClientOptions o;
  o.target = absl::GetFlag(FLAGS_target);
  o.part_bytes = absl::GetFlag(FLAGS_part_bytes);
  o.response_part_bytes = absl::GetFlag(FLAGS_response_part_bytes);
  o.wait_for_ready = true;
  auto lc = LossClient::Create(o);
  if (!lc.ok()) {
    std::fprintf(stderr, "%s\n", lc.status().ToString().c_str());
    return 1;
  }
  HostTensor wt = HostTensor::View(DType::kBF16, {v, h}, w.data());
  const auto p0 = Clock::now();
  auto put = (*lc)->PutWeights(wt, nullptr);
  if (!put.ok()) {
    std::fprintf(stderr, "PutWeights: %s\n", put.status().ToString().c_str());
    return 1;
  }
  const double put_s = std::chrono::duration<double>(Clock::now() - p0).count();
  std::printf("PutWeights of %.1f MB: %.1f ms, %.2f GB/s (first upload: includes the server's "
              "first touch of the weight memory)\n",
              w.size() * 2e-6, put_s * 1e3, w.size() * 2 / put_s * 1e-9);
  ComputeRequest r;
  r.x = HostTensor::View(DType::kBF16, {bt, h}, x.data());
  r.weight_handle = put->handle;
  r.targets = HostTensor::View(DType::kI32, {bt}, targets.data());
  r.want.dx = true;
  r.want.dw = false;
  if (!absl::GetFlag(FLAGS_fresh_output)) {
    r.output_into[OutputTensor::kDx] = OutputBuffer{dx.data(), dx.size()};
  }
  std::vector<double> walls, computes;
  const int runs = absl::GetFlag(FLAGS_runs);
  for (int i = 0; i <= runs; ++i) {
    const auto t0 = Clock::now();
    auto res = (*lc)->Compute(r);
    const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
    if (!res.ok()) {
      std::fprintf(stderr, "Compute: %s\n", res.status().ToString().c_str());
      return 1;
    }
    std::printf("call %d: wall %.1f ms, compute %.1f ms%s\n", i, wall * 1e3,
                res->compute_seconds * 1e3, i == 0 ? " (warm-up)" : "");
    if (i == 0) continue;
    walls.push_back(wall);
    computes.push_back(res->compute_seconds);
  }
  const double wall = Median(walls), compute = Median(computes);
  const double bytes = 2.0 * bt * h * 2;  // X up, dX down
  std::printf(
      "median: wall %.1f ms, compute %.1f ms, wall - compute %.1f ms; X+dX %.1f MB: %.2f GB/s "
      "over the whole call, %.2f GB/s over wall - compute\n",
      wall * 1e3, compute * 1e3, (wall - compute) * 1e3, bytes * 1e-6, bytes / wall * 1e-9,
      bytes / std::max(1e-9, wall - compute) * 1e-9);
  (void)(*lc)->DropWeights(put->handle);
  return 0;
}

}  // namespace
}  // namespace bench
}  // namespace lossd

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  lossd::client::TuneMallocForLargeMessages();
  return lossd::bench::Main();
}
