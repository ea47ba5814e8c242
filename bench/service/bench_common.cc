// SPDX-License-Identifier: Apache-2.0
#include "bench/service/bench_common.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include "absl/strings/str_format.h"

namespace lossd {
namespace bench {

double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double GB(double bytes) { return bytes * 1e-9; }

std::string Ms(double s) { return absl::StrFormat("%.1f", s * 1e3); }
std::string Num(double v, const char* fmt) { return absl::StrFormat(fmt, v); }
std::string Pct(double v) { return absl::StrFormat("%.0f%%", v * 100); }

uint8_t* BufferPool::Take(uint64_t bytes) {
  {
    absl::MutexLock lock(&mu_);
    auto& list = free_[bytes];
    if (!list.empty()) {
      uint8_t* b = list.back();
      list.pop_back();
      return b;
    }
  }
  uint8_t* b = new uint8_t[bytes];
  std::memset(b, 0x5A, bytes);
  return b;
}

void BufferPool::Give(uint64_t bytes, uint8_t* b) {
  absl::MutexLock lock(&mu_);
  free_[bytes].push_back(b);
}

void BufferPool::Trim() {
  absl::MutexLock lock(&mu_);
  for (auto& [n, list] : free_) {
    for (uint8_t* b : list) delete[] b;
    list.clear();
  }
}

BufferPool& Pool() {
  static BufferPool* p = new BufferPool;
  return *p;
}

void FillBf16(uint16_t* p, uint64_t n, float scale, uint64_t seed) {  // (n) bf16
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> ts;
  for (unsigned t = 0; t < threads; ++t) {
    ts.emplace_back([=] {
      const uint64_t b = n * t / threads, e = n * (t + 1) / threads;
      uint64_t x = seed * 0x9E3779B97F4A7C15ull + t + 1;
      for (uint64_t i = b; i < e; ++i) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        const float f = (static_cast<float>(x >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f) * scale;
        uint32_t bits;
        std::memcpy(&bits, &f, 4);
        p[i] = static_cast<uint16_t>(bits >> 16);
      }
    });
  }
  for (auto& t : ts) t.join();
}

const char* ModeName(Mode m) {
  switch (m) {
    case Mode::kInline: return "W inline";
    case Mode::kHandle: return "W by handle";
    case Mode::kAccum: return "handle + accumulator";
    case Mode::kAccumNoFetch: return "handle + accumulator, no fetch";
    case Mode::kHead: return "hosted head";
  }
  return "?";
}

absl::StatusOr<std::unique_ptr<client::LossClient>> NewClient(const Env& env, int connections) {
  client::ClientOptions o;
  o.target = env.target;
  o.part_bytes = env.part_bytes;
  o.deadline = env.deadline;
  o.connections = connections;
  o.wait_for_ready = true;
  o.overlap = env.overlap;
  return client::LossClient::Create(o);
}

}  // namespace bench
}  // namespace lossd
