// SPDX-License-Identifier: Apache-2.0
// The process metrics every Prometheus user expects of a server, with the conventional names
// (process_cpu_seconds_total, process_resident_memory_bytes, process_virtual_memory_bytes,
// process_open_fds, process_max_fds, process_start_time_seconds), read from /proc at scrape
// time; prometheus-cpp has no such collector. Reads files only; a file it cannot read leaves
// its metric out rather than reporting a made-up 0.
#ifndef LOSSD_SERVICE_PROCESS_METRICS_H_
#define LOSSD_SERVICE_PROCESS_METRICS_H_

#include <string>
#include <vector>

#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"

namespace lossd {

// Appends to `out` a family of one unlabelled series of `type` (Gauge or Counter) with value
// `v`: what a collector that computes its values at scrape time returns.
void AddUnlabelledFamily(std::vector<prometheus::MetricFamily>* out, const char* name,
                         const char* help, prometheus::MetricType type, double v);

class ProcessCollector : public prometheus::Collectable {
 public:
  // `proc` is the /proc mount; tests point it at a folder of their own ("self/stat",
  // "self/fd/", "self/limits" and "stat" below it are read).
  explicit ProcessCollector(std::string proc = "/proc");

  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  std::string proc_;
  long ticks_per_second_;  // NOLINT(runtime/int): sysconf's type
  long page_bytes_;        // NOLINT(runtime/int)
};

}  // namespace lossd

#endif  // LOSSD_SERVICE_PROCESS_METRICS_H_
