// SPDX-License-Identifier: Apache-2.0
// lossd soak: many concurrent clients against an in-process server (default) or a running
// lossd (--target=127.0.0.1:PORT), for --duration seconds; prints the report and exits 1 on
// any unexpected outcome, wrong result or memory growth beyond --rss_growth_mib.
//   bazel run //tests/soak:soak -- --duration=600 --clients=8
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "tests/soak/soak_lib.h"

ABSL_FLAG(std::string, target, "", "host:port of a running lossd on this machine; empty = in-process.");
ABSL_FLAG(double, duration, 600, "Seconds of load.");
ABSL_FLAG(int, clients, 8, "Concurrent clients, one connection each.");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the clients' choices.");
ABSL_FLAG(double, warmup, 5, "Seconds before the RSS baseline is taken.");
ABSL_FLAG(uint64_t, rss_growth_mib, 64, "Largest RSS growth after warm-up that passes.");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  lossd::soak::SoakOptions o;
  o.target = absl::GetFlag(FLAGS_target);
  o.duration_seconds = absl::GetFlag(FLAGS_duration);
  o.clients = absl::GetFlag(FLAGS_clients);
  o.seed = absl::GetFlag(FLAGS_seed);
  o.warmup_seconds = absl::GetFlag(FLAGS_warmup);
  o.rss_growth_bound_bytes = absl::GetFlag(FLAGS_rss_growth_mib) << 20;
  lossd::soak::SoakReport r = lossd::soak::RunSoak(o);
  std::fputs(r.ToString().c_str(), stdout);
  return r.ok() ? 0 : 1;
}
