// SPDX-License-Identifier: Apache-2.0
// A bounded soak of a lossd server over loopback: many concurrent clients mixing valid
// computes (inline and by handle, with and without a server accumulator), invalid requests
// (each with its exact expected code), cancellations, deadlines and weight uploads, for a set
// duration. It checks every answer (the float64 reference once, then bit-identity), counts
// outcomes by code, measures latency, and compares process RSS and admitted memory at start
// and end. It never targets anything but the address it is given (loopback by default).
#ifndef LOSSD_TESTS_SOAK_SOAK_LIB_H_
#define LOSSD_TESTS_SOAK_SOAK_LIB_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace lossd {
namespace soak {

struct SoakOptions {
  std::string target;           // host:port of a running lossd; empty = an in-process server
  double duration_seconds = 600;
  int clients = 8;
  uint64_t seed = 1;
  // RSS is measured after this long (allocator pools and gRPC buffers warmed up) and at the
  // end; growth beyond the bound fails the soak.
  double warmup_seconds = 5;
  uint64_t rss_growth_bound_bytes = 64ull << 20;
  // Per-call deadline of the valid calls; generous, since a loaded 2-core host is slow.
  double call_deadline_seconds = 60;
};

struct SoakReport {
  uint64_t calls = 0;                   // every RPC made
  uint64_t served_ok = 0;               // of them, OK
  std::map<std::string, uint64_t> by_kind_and_code;  // "valid_inline:OK", "invalid_nan:INVALID_ARGUMENT"
  double compute_p50_ms = 0, compute_p99_ms = 0, compute_max_ms = 0;  // valid computes
  uint64_t rss_start = 0, rss_baseline = 0, rss_end = 0;  // bytes, this process
  uint64_t admitted_start = 0, admitted_end = 0;  // server's admitted memory, bytes
  uint64_t weight_cache_start = 0, weight_cache_end = 0;
  double seconds = 0;
  std::vector<std::string> failures;    // unexpected codes, wrong results, leaks (first 50)
  uint64_t failure_count = 0;
  bool ok() const { return failure_count == 0; }
  std::string ToString() const;
};

SoakReport RunSoak(const SoakOptions& options);

}  // namespace soak
}  // namespace lossd

#endif  // LOSSD_TESTS_SOAK_SOAK_LIB_H_
